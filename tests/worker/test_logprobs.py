"""Per-token logprobs through the whole path: Producer -> Redis -> worker -> replay stream ->
result(), also for a request that one worker started and another resumed."""

import time

import pytest

from producer import Producer, SamplingParams
from producer.completion import Completion

from .conftest import backlog, prompts_of, replay, run_until, tokens_of


def with_logprobs(n: int | None, max_tokens: int = 12) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=n)


def assert_greedy_logprobs(completion: Completion, n: int) -> None:
    """One entry per token with n alternatives, best first; greedy picked the best one. The tiny
    random model has no tokenizer, so no texts."""
    assert len(completion.logprobs) == len(completion.token_ids)
    for token_id, entry in zip(completion.token_ids, completion.logprobs):
        assert len(entry.top) == n and entry.text == "" and entry.logprob <= 0.0
        assert [alt.logprob for alt in entry.top] == sorted((alt.logprob for alt in entry.top), reverse=True)
        assert (entry.top[0].id, entry.top[0].logprob) == (token_id, entry.logprob)


def test_a_result_carries_each_tokens_logprob_and_its_top_n(make_worker, client, redis_url):
    worker = make_worker()
    prompt = prompts_of(1, seed=4)[0]
    with Producer(redis_url) as producer:
        handles = {n: producer.submit(prompt_ids=prompt, params=with_logprobs(n)) for n in (None, 0, 3)}
        run_until([worker], lambda: backlog(client) == 0 and not worker.flights)
        results = {n: handle.result(timeout=10) for n, handle in handles.items()}
    assert results[None].logprobs is None
    assert results[0].token_ids == results[3].token_ids == results[None].token_ids
    assert all(entry.top == [] for entry in results[0].logprobs)
    assert [entry.logprob for entry in results[0].logprobs] == \
        pytest.approx([entry.logprob for entry in results[3].logprobs], abs=1e-5)
    assert_greedy_logprobs(results[3], 3)


def test_tokens_resumed_on_another_worker_keep_their_logprobs(make_worker, client, redis_url):
    stalled = make_worker("w1", reclaim_idle_ms=600)
    rescuer = make_worker("w2", reclaim_idle_ms=600)
    prompt = prompts_of(1, seed=5)[0]
    with Producer(redis_url) as producer:
        resumed = producer.submit(prompt_ids=prompt, params=with_logprobs(3), request_id="resumed")
        for _ in range(6):
            stalled.poll()  # read + prefill, then one token per turn
        time.sleep(0.7)  # past the reclaim threshold without a refresh
        straight = producer.submit(prompt_ids=prompt, params=with_logprobs(3), request_id="straight")
        run_until([rescuer], lambda: backlog(client) == 0 and not rescuer.flights)
        resumed, straight = resumed.result(timeout=10), straight.result(timeout=10)
    first_attempt = tokens_of([event for event in replay(client, "resumed") if event.attempt == 1])
    assert 0 < len(first_attempt) < 12 and (resumed.attempts, straight.attempts) == (2, 1)
    assert resumed.token_ids == straight.token_ids
    assert_greedy_logprobs(resumed, 3)
    assert [[alt.id for alt in entry.top] for entry in resumed.logprobs] == \
        [[alt.id for alt in entry.top] for entry in straight.logprobs]
    assert [alt.logprob for entry in resumed.logprobs for alt in entry.top] == \
        pytest.approx([alt.logprob for entry in straight.logprobs for alt in entry.top], abs=1e-4)
