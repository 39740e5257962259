"""The whole path with the real pieces: Producer library -> Redis -> worker -> replay stream
and channel -> consumers, live and late. Greedy output equals the offline engine's."""

import threading

from producer import Producer

from .conftest import assert_numbered, backlog, greedy, offline, prompts_of, run_until


def test_fifty_requests_from_the_producer_reach_live_and_late_consumers_exactly_once(make_worker, model,
                                                                                     client, redis_url):
    worker = make_worker()
    producer = Producer(redis_url)
    prompts = prompts_of(50, seed=3)
    params = [greedy(4 + i % 9) for i in range(50)]
    handles = [producer.submit(prompt_ids=prompt, params=request_params, lane="normal" if i % 2 else None)
               for i, (prompt, request_params) in enumerate(zip(prompts, params))]
    assert {handle.lane for handle in handles} == {"fast", "normal"}
    streamed: dict[str, list] = {}
    live = [threading.Thread(target=lambda h=handle: streamed.__setitem__(h.id, list(h.stream(timeout=60))))
            for handle in handles[:25]]
    for thread in live:
        thread.start()

    run_until([worker], lambda: backlog(client) == 0 and not any(thread.is_alive() for thread in live), timeout=90)

    expected = offline(model, prompts, params)
    for i, handle in enumerate(handles):
        result = handle.result(timeout=10)  # for the second half, a consumer arriving after the end
        assert (result.token_ids, result.finish_reason) == (expected[i], "length"), handle.id
        assert result.usage.completion_tokens == params[i].max_tokens
    for handle in handles[:25]:
        events = streamed[handle.id]
        assert_numbered(events)
        assert [token for event in events[:-1] for token in event.ids] == expected[handles.index(handle)]
