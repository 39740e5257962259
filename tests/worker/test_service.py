"""The worker in-process against a real redis-server: requests in through the lane streams,
events out through replay streams and channels, and every way a request can end."""

import json
import threading
import time

import msgspec
import pytest
import redis
import structlog

from producer import EventsLost, Producer
from producer.protocol import (FIELD, GROUP, LANES, DoneEvent, ErrorEvent, Request, TokenEvent, decode_event, encode,
                               ensure_group)

from .conftest import (
    KEYS,
    assert_numbered,
    backlog,
    greedy,
    is_finished,
    offline,
    paced,
    prompts_of,
    replay,
    run_until,
    submit,
    tokens_of,
)


def test_fifty_concurrent_requests_of_mixed_lanes_match_the_offline_engine(make_worker, client, model, monkeypatch):
    worker = make_worker()
    lanes, add_request = {}, worker.engine.add_request

    def add_and_record_lane(request_id, **kwargs):
        sequence = add_request(request_id, **kwargs)
        lanes[request_id] = sequence.lane
        return sequence

    monkeypatch.setattr(worker.engine, "add_request", add_and_record_lane)
    prompts = prompts_of(50)
    params = [greedy(4 + i % 9) for i in range(50)]
    listener = client.pubsub()
    listener.psubscribe(KEYS.tokens("*"))
    listener.get_message(timeout=1)  # the subscription is confirmed: no event is published before it
    for i, (prompt, request_params) in enumerate(zip(prompts, params)):
        submit(client, Request(id=f"r{i}", prompt_ids=prompt, params=request_params), LANES[i % 2])

    run_until([worker], lambda: backlog(client) == 0)

    expected = offline(model, prompts, params)
    published: dict[str, list] = {}
    while (message := listener.get_message(timeout=0.1)) is not None:
        request_id = message["channel"].decode().split("{")[1].split("}")[0]
        published.setdefault(request_id, []).append(decode_event(message["data"]))
    for i in range(50):
        events = replay(client, f"r{i}")  # read after the request finished: a late consumer's view
        assert_numbered(events)
        assert tokens_of(events) == expected[i], f"r{i}"
        assert events[-1].finish_reason == "length"
        assert events[-1].usage.completion_tokens == params[i].max_tokens
        assert {event.attempt for event in events} == {1}
        assert published[f"r{i}"] == events, "the channel carries the same events, in the same order"
        assert 0 < client.ttl(KEYS.replay(f"r{i}")) <= worker.config.replay_ttl
    assert lanes == {f"default/r{i}": LANES[i % 2] for i in range(50)}, "each runs in the lane of its stream"
    for lane in LANES:
        assert client.xpending(KEYS.requests(lane), GROUP)["pending"] == 0
    assert worker.flights == {}  # dropped: the engine lets go of it at its next step


def cancel(client, request_id: str, publish: bool = True) -> None:
    client.set(KEYS.cancelled(request_id), 1, ex=60)
    if publish:
        client.publish(KEYS.cancel_channel, request_id)


def test_cancel_mid_stream_ends_the_request_and_frees_its_blocks_at_once(make_worker, client):
    worker = make_worker(heartbeat_interval=10.0)  # no sweep during the test: the nudge alone must do it
    pool = worker.engine.pool
    submit(client, Request(id="long", prompt_ids=list(range(2, 60)), params=greedy(500)))
    run_until([worker], lambda: len(replay(client, "long")) >= 3)
    assert pool.num_free_blocks < pool.num_blocks

    cancel(client, "long")
    run_until([worker], lambda: is_finished(client, "long"), timeout=2)

    events = replay(client, "long")
    assert_numbered(events)
    assert events[-1].finish_reason == "cancelled"
    assert len(tokens_of(events)) < 500
    assert pool.num_free_blocks == pool.num_blocks and pool.stats().used == 0
    assert backlog(client) == 0 and worker.flights == {}


def test_cancel_before_the_worker_reads_it_and_without_a_nudge(make_worker, client):
    """The key is durable: checked when a request is claimed, and swept every heartbeat."""
    worker = make_worker()
    cancel(client, "early")
    submit(client, Request(id="early", prompt_ids=[5, 6, 7], params=greedy(500)))
    submit(client, Request(id="quiet", prompt_ids=[5, 6, 7], params=greedy(500)))
    run_until([worker], lambda: len(replay(client, "quiet")) >= 2)
    cancel(client, "quiet", publish=False)
    run_until([worker], lambda: is_finished(client, "quiet"), timeout=5)

    early = replay(client, "early")
    assert [type(event) for event in early] == [DoneEvent] and early[0].finish_reason == "cancelled"
    assert replay(client, "quiet")[-1].finish_reason == "cancelled"


def test_deadline_expires_only_requests_not_started_by_then(make_worker, client, model):
    worker = paced(make_worker(engine_options={"max_num_seqs": 1}))  # one at a time: the others wait
    submit(client, Request(id="late", prompt_ids=[5, 6], params=greedy(5), deadline=time.time() - 1))
    submit(client, Request(id="running", prompt_ids=[5, 6, 7], params=greedy(100)))
    run_until([worker], lambda: len(replay(client, "running")) >= 1)
    submit(client, Request(id="waits", prompt_ids=[8, 9], params=greedy(5), deadline=time.time() + 0.2))
    submit(client, Request(id="patient", prompt_ids=[8, 9], params=greedy(5), deadline=time.time() + 600))
    run_until([worker], lambda: backlog(client) == 0)

    assert replay(client, "late")[-1].finish_reason == "deadline"
    waits = replay(client, "waits")
    assert waits[-1].finish_reason == "deadline" and tokens_of(waits) == []
    assert replay(client, "running")[-1].finish_reason == "length"
    patient = replay(client, "patient")
    assert patient[-1].finish_reason == "length"
    assert tokens_of(patient) == offline(model, [[8, 9]], [greedy(5)])[0]


def test_every_kind_of_bad_entry_is_dead_lettered_and_the_worker_keeps_serving(make_worker, client, model):
    worker = make_worker()
    pack = msgspec.msgpack.encode
    bad = {  # name: (entry fields, the id an error event goes to, or None)
        "garbage bytes": ({FIELD: b"\xc1\xc1\xc1 not msgpack"}, None),
        "not a map": ({FIELD: pack([1, 2, 3])}, None),
        "no request field": ({b"other": b"1"}, None),
        "bad id": ({FIELD: pack({"id": "spaces are not allowed", "prompt_ids": [5, 6]})}, None),
        "wrong types": ({FIELD: pack({"id": "wrong-types", "prompt_ids": "5 6"})}, "wrong-types"),
        "unknown lane": ({FIELD: pack({"id": "unknown-lane", "prompt_ids": [5, 6], "lane": "turbo"})},
                         "unknown-lane"),
        "params out of range": ({FIELD: pack({"id": "bad-params", "prompt_ids": [5, 6],
                                              "params": {"temperature": -1.0}})}, "bad-params"),
        "over-long prompt": ({FIELD: encode(Request(id="too-long", prompt_ids=[5] * 1000, params=greedy(100)))},
                             "too-long"),
        "token id outside the vocabulary": ({FIELD: encode(Request(id="bad-token", prompt_ids=[5, 99_999]))},
                                            "bad-token"),
        "text prompt for a model without tokenizer": ({FIELD: encode(Request(id="no-tokenizer", prompt="hi"))},
                                                      "no-tokenizer"),
    }
    entry_ids = {name: client.xadd(KEYS.requests("normal"), fields).decode() for name, (fields, _) in bad.items()}
    submit(client, Request(id="good", prompt_ids=[5, 6, 7], params=greedy(6)))
    run_until([worker], lambda: backlog(client) == 0)

    dead = {fields[b"entry_id"].decode(): fields for _, fields in client.xrange(KEYS.dead_letters)}
    assert len(dead) == len(bad)
    for name, (fields, request_id) in bad.items():
        letter = dead[entry_ids[name]]
        assert letter[b"reason"] and letter[b"stream"] == KEYS.requests("normal").encode(), name
        assert letter[b"entry"] == fields.get(FIELD, msgspec.msgpack.encode(fields)), name
        assert letter[b"id"] == (request_id or "").encode(), name
        if request_id is not None:
            [event] = replay(client, request_id)
            code = "too_long" if request_id == "too-long" else "invalid_request"
            assert isinstance(event, ErrorEvent) and event.seq == 0 and event.code == code, name
            assert event.message == letter[b"reason"].decode(), name
    assert replay(client, "too-long")[0].message.startswith("prompt is 1000 tokens")
    assert tokens_of(replay(client, "good")) == offline(model, [[5, 6, 7]], [greedy(6)])[0]
    assert worker.metrics.dead_letters._value.get() == len(bad)


def test_a_request_delivered_too_often_is_dead_lettered_with_an_error_event(make_worker, client):
    entry_id = submit(client, Request(id="poison", prompt_ids=[5, 6], params=greedy(4)))
    stream = KEYS.requests("normal")
    ensure_group(client, stream)
    client.xreadgroup(GROUP, "crashed", {stream: ">"})
    for _ in range(2):  # two more crashed owners: 3 deliveries so far, the reclaim makes 4
        client.xclaim(stream, GROUP, "crashed", 0, [entry_id])
    client.xclaim(stream, GROUP, "crashed", 0, [entry_id], idle=10**7, justid=True)
    worker = make_worker(max_deliveries=3)
    run_until([worker], lambda: backlog(client) == 0)

    [event] = replay(client, "poison")
    assert isinstance(event, ErrorEvent) and event.code == "dead_letter" and event.attempt == 1
    [(_, letter)] = client.xrange(KEYS.dead_letters)
    assert letter[b"reason"] == b"gave up after 4 deliveries" and letter[b"id"] == b"poison"
    assert worker.metrics.reclaimed._value.get() == 1


def test_a_stalled_worker_loses_its_requests_to_a_reclaim_and_cannot_write_any_more(make_worker, client, model):
    """w1 stalls mid-generation (a GC pause, a swapped-out VM); w2 reclaims its entries, fences
    it off and resumes each from the replay stream; w1 wakes, its writes are refused, and it
    drops the requests without acking them."""
    stalled = make_worker("w1", reclaim_idle_ms=600)
    rescuer = make_worker("w2", reclaim_idle_ms=600)
    prompts = prompts_of(3, seed=1)
    for i, prompt in enumerate(prompts):
        submit(client, Request(id=f"r{i}", prompt_ids=prompt, params=greedy(40)))
    for _ in range(10):
        stalled.poll()  # read + prefill, then one token per turn
    assert [len(replay(client, f"r{i}")) for i in range(3)] == [10, 10, 10]

    time.sleep(0.7)  # past the reclaim threshold without a refresh
    for _ in range(5):
        rescuer.poll()  # the first turn reclaims
    assert set(rescuer.flights) == {"default/r0", "default/r1", "default/r2"}
    before = [replay(client, f"r{i}") for i in range(3)]

    stalled.next_housekeeping = float("inf")  # it wakes straight into a step: the fence must stop it
    stalled.poll()
    assert stalled.flights == {} and [replay(client, f"r{i}") for i in range(3)] == before
    assert client.xpending(KEYS.requests("normal"), GROUP)["pending"] == 3, "the stalled worker acked nothing"

    run_until([rescuer], lambda: backlog(client) == 0)
    expected = offline(model, prompts, [greedy(40)] * 3)
    for i in range(3):
        events = replay(client, f"r{i}")
        assert_numbered(events)
        assert tokens_of(events) == expected[i]
        assert [event.attempt for event in events] == [1] * 10 + [2] * (len(events) - 10)
        assert events[-1].usage.completion_tokens == 40
    assert rescuer.metrics.reclaimed._value.get() == 3


def test_a_reclaimed_request_that_had_finished_is_only_acked(make_worker, client):
    """The owner wrote the final event and died before its ack: nothing is generated again."""
    entry_id = submit(client, Request(id="done", prompt_ids=[5, 6], params=greedy(3)))
    stream = KEYS.requests("normal")
    ensure_group(client, stream)
    client.xreadgroup(GROUP, "crashed", {stream: ">"})
    client.xclaim(stream, GROUP, "crashed", 0, [entry_id], idle=10**7, justid=True)
    client.xadd(KEYS.replay("done"), {FIELD: encode(ErrorEvent(seq=0, attempt=1, code="internal", message="x"))})
    worker = make_worker()
    run_until([worker], lambda: backlog(client) == 0)
    assert len(replay(client, "done")) == 1 and worker.flights == {}


def test_drain_finishes_what_it_can_and_hands_the_rest_back(make_worker, client, model):
    draining = paced(make_worker("w1", drain_timeout=0.3))
    submit(client, Request(id="short", prompt_ids=[5, 6, 7], params=greedy(5)))
    submit(client, Request(id="long", prompt_ids=[5, 6, 8], params=greedy(300)))
    draining.poll()
    draining.stop()
    run_until([draining], lambda: draining.done, timeout=5)
    assert replay(client, "short")[-1].finish_reason == "length"
    assert not is_finished(client, "long") and draining.flights == {}
    [pending] = client.xpending_range(KEYS.requests("normal"), GROUP, "-", "+", 10)
    assert pending["consumer"] == draining.consumer.encode() and pending["time_since_delivered"] > 10**9

    successor = make_worker("w2")  # reclaims after 60 s of idleness: only a hand-back is taken at once
    run_until([successor], lambda: backlog(client) == 0, timeout=20)
    events = replay(client, "long")
    assert_numbered(events)
    assert tokens_of(events) == offline(model, [[5, 6, 8]], [greedy(300)])[0]
    assert events[-1].attempt == 2


def test_after_a_redis_error_the_worker_drops_what_it_held_and_resumes_it_by_reclaim(make_worker, client, model,
                                                                                    monkeypatch):
    worker = make_worker(reclaim_idle_ms=600)
    prompts = prompts_of(4, seed=4)
    for i, prompt in enumerate(prompts):
        submit(client, Request(id=f"r{i}", prompt_ids=prompt, params=greedy(30)))
    flush, calls = worker.outbox.flush, []

    def failing_flush(flights):
        calls.append(1)
        if len(calls) == 10:  # the connection drops after the 9th step's write
            raise redis.ConnectionError("connection reset")
        return flush(flights)

    monkeypatch.setattr(worker.outbox, "flush", failing_flush)
    runner = threading.Thread(target=worker.run)
    runner.start()
    try:
        deadline = time.monotonic() + 20
        while backlog(client) and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        worker.stop()
        runner.join(timeout=10)
    assert not runner.is_alive() and backlog(client) == 0
    for i, tokens in enumerate(offline(model, prompts, [greedy(30)] * 4)):
        events = replay(client, f"r{i}")
        assert_numbered(events)
        assert tokens_of(events) == tokens
        assert {event.attempt for event in events} == {1, 2}


def test_a_live_worker_keeps_its_entries_from_being_reclaimed(make_worker, client):
    busy = paced(make_worker("w1", reclaim_idle_ms=600))
    idle = make_worker("w2", reclaim_idle_ms=600)
    submit(client, Request(id="long", prompt_ids=[5, 6, 7], params=greedy(1000)))
    started = time.monotonic()
    while time.monotonic() - started < 1.2:  # twice the reclaim threshold, refreshed every 0.2 s
        busy.poll()
    idle.housekeeping()
    assert idle.flights == {} and idle.metrics.reclaimed._value.get() == 0
    [entry] = client.xpending_range(KEYS.requests("normal"), GROUP, "-", "+", 10)
    assert entry["times_delivered"] == 1 and entry["time_since_delivered"] < 600, "refreshed, not re-delivered"
    assert {event.attempt for event in replay(client, "long")} == {1} and not is_finished(client, "long")


def test_a_poison_request_is_dead_lettered_with_an_error_event_and_the_rest_are_served(make_worker, client, model):
    worker = make_worker()
    execute = worker.engine.runner.execute

    def breaks_on_poison(plan):
        if any(seq.request_id == "default/poison" for seq in plan.scheduled):
            raise RuntimeError("this input breaks the model")
        return execute(plan)

    worker.engine.runner.execute = breaks_on_poison
    prompts = prompts_of(4, seed=7)
    for i, prompt in enumerate(prompts):
        submit(client, Request(id=f"ok{i}", prompt_ids=prompt, params=greedy(8)))
    submit(client, Request(id="poison", prompt_ids=[3, 4, 5], params=greedy(8)))
    run_until([worker], lambda: backlog(client) == 0, timeout=30)
    [event] = replay(client, "poison")
    assert isinstance(event, ErrorEvent) and event.code == "internal"
    assert "failed engine steps: RuntimeError: this input breaks the model" in event.message
    [(_, letter)] = client.xrange(KEYS.dead_letters)
    assert b"this input breaks the model" in letter[b"reason"]
    for i, tokens in enumerate(offline(model, prompts, [greedy(8)] * 4)):
        events = replay(client, f"ok{i}")
        assert_numbered(events)
        assert tokens_of(events) == tokens


def test_a_turn_that_fails_costs_the_held_requests_not_the_worker(make_worker, client, monkeypatch):
    worker = make_worker()
    submit(client, Request(id="held", prompt_ids=[5, 6, 7], params=greedy(50)))
    worker.poll()
    assert "default/held" in worker.flights
    monkeypatch.setattr("worker.service.TURN_RETRY_S", 0)
    monkeypatch.setattr(worker.outbox, "flush", lambda flights: 1 / 0)
    worker.turn()  # does not raise
    assert worker.flights == {}  # dropped: the engine lets go of it at its next step
    assert client.xpending(KEYS.requests("normal"), GROUP)["pending"] == 1  # still ours, to take back
    monkeypatch.undo()
    submit(client, Request(id="next", prompt_ids=[8, 9], params=greedy(3)))
    run_until([worker], lambda: is_finished(client, "next") and is_finished(client, "held"))


def test_a_redis_blip_costs_a_recompute_never_a_delivery(make_worker, client, model, monkeypatch):
    """Turns failing with Redis errors drop what the worker holds; the first housekeeping that
    reaches Redis again takes its own entries back (delivery counts untouched) and resumes
    each from its replay stream: nothing is lost, repeated or dead-lettered, even with
    max_deliveries 1 and no reclaim for a minute."""
    worker = make_worker(max_deliveries=1, reclaim_idle_ms=60_000)
    prompts = prompts_of(3, seed=4)
    for i, prompt in enumerate(prompts):
        submit(client, Request(id=f"b{i}", prompt_ids=prompt, params=greedy(40)))
    run_until([worker], lambda: all(len(replay(client, f"b{i}")) >= 3 for i in range(3)))
    monkeypatch.setattr("worker.service.TURN_RETRY_S", 0.01)
    flush = worker.outbox.flush
    failures = iter([True] * 3)

    def blip(flights):
        if next(failures, False):
            raise redis.ConnectionError("Connection reset by peer")
        return flush(flights)

    monkeypatch.setattr(worker.outbox, "flush", blip)
    deadline = time.monotonic() + 20
    while backlog(client):
        assert time.monotonic() < deadline, "not resumed"
        worker.turn()  # as Worker.run does: a failed turn is survived

    assert client.xlen(KEYS.dead_letters) == 0
    for i, tokens in enumerate(offline(model, prompts, [greedy(40)] * 3)):
        events = replay(client, f"b{i}")
        assert_numbered(events)
        assert tokens_of(events) == tokens and events[-1].attempt > 1, f"b{i}"  # resumed, from the tokens written


def test_a_request_whose_keys_are_damaged_is_dead_lettered_its_consumers_told_and_the_rest_served(
        make_worker, client, redis_url):
    """The replay stream a request would resume from: trimmed, undecodable, or not a stream
    at all. None can take the worker down; each consumer ends with the reason."""
    damage = {
        "trimmed": lambda: client.xadd(KEYS.replay("trimmed"), {FIELD: encode(ErrorEvent(1, 1, "internal", "x"))}),
        "undecodable": lambda: client.xadd(KEYS.replay("undecodable"), {FIELD: b"\xc1 garbage"}),
        "not-a-stream": lambda: client.set(KEYS.replay("not-a-stream"), b"oops"),
    }
    producer = Producer(redis_url, poll_interval=0.1)
    for request_id, spoil in damage.items():
        producer.submit(prompt_ids=[5, 6], params=greedy(3), request_id=request_id)
        spoil()
    producer.submit(prompt_ids=[5, 6, 7], params=greedy(3), request_id="good")
    worker = make_worker()
    run_until([worker], lambda: backlog(client) == 0)

    reasons = {fields[b"id"].decode(): fields[b"reason"].decode() for _, fields in client.xrange(KEYS.dead_letters)}
    assert reasons == {"trimmed": "replay stream is missing events (trimmed or expired)",
                       "undecodable": "replay stream holds an undecodable event",
                       "not-a-stream": reasons["not-a-stream"]} and "WRONGTYPE" in reasons["not-a-stream"]
    for request_id, reason in reasons.items():
        with pytest.raises(EventsLost, match=f"request {request_id} was dead-lettered: "):
            producer.result(request_id, timeout=5)
    assert producer.result("good", timeout=5).finish_reason == "length"


@pytest.mark.parametrize("ids", [[-1], [2**40], [5] * 4])
def test_resumed_tokens_a_model_cannot_take_end_that_request_alone(make_worker, client, model, redis_url, ids):
    """Token ids in a replay stream are input too (anyone with write access can put them there):
    outside the vocabulary, or more than max_tokens of them, used to fail every turn forever."""
    producer = Producer(redis_url)
    producer.submit(prompt_ids=[5, 6], params=greedy(3), request_id="spoiled")
    client.xadd(KEYS.replay("spoiled"), {FIELD: encode(TokenEvent(0, 1, ids, ""))})
    producer.submit(prompt_ids=[5, 6, 7], params=greedy(3), request_id="good")
    worker = make_worker()
    with structlog.testing.capture_logs() as logs:
        run_until([worker], lambda: backlog(client) == 0 and not worker.flights)

    *_, error = replay(client, "spoiled")
    assert isinstance(error, ErrorEvent) and error.code == "invalid_request" and "resumed token ids" in error.message
    assert tokens_of(replay(client, "good")) == offline(model, [[5, 6, 7]], [greedy(3)])[0]
    assert not [entry for entry in logs if entry["event"] == "worker.turn_failed"]


def test_a_request_the_engine_cannot_start_ends_alone_with_an_internal_error(make_worker, client, model,
                                                                               monkeypatch):
    worker = make_worker()
    add_request = worker.engine.add_request

    def fails_for_one(request_id, **options):
        if request_id == "default/unlucky":
            raise RuntimeError("an engine bug")
        return add_request(request_id, **options)

    monkeypatch.setattr(worker.engine, "add_request", fails_for_one)
    submit(client, Request(id="unlucky", prompt_ids=[5, 6], params=greedy(3)))
    submit(client, Request(id="good", prompt_ids=[5, 6, 7], params=greedy(3)))
    with structlog.testing.capture_logs() as logs:
        run_until([worker], lambda: backlog(client) == 0 and not worker.flights)

    [error] = replay(client, "unlucky")
    assert error.code == "internal" and "an engine bug" in error.message
    assert tokens_of(replay(client, "good")) == offline(model, [[5, 6, 7]], [greedy(3)])[0]
    assert not [entry for entry in logs if entry["event"] == "worker.turn_failed"]
    assert [entry["event"] for entry in logs if entry.get("request_id") == "unlucky"][:1] == ["request.unservable"]


def test_a_step_longer_than_the_reclaim_threshold_keeps_its_claims_and_heartbeat(make_worker, client):
    busy = make_worker("w1", heartbeat_interval=0.2, reclaim_idle_ms=600)
    idle = make_worker("w2", heartbeat_interval=0.2, reclaim_idle_ms=600)
    submit(client, Request(id="slow", prompt_ids=[5, 6, 7], params=greedy(5)))
    busy.poll()
    step = busy.engine.step

    def long_step():
        time.sleep(1.5)  # a long prefill on a slow CPU: 2.5 reclaim thresholds
        return step()

    busy.engine.step = long_step
    stepping = threading.Thread(target=busy.poll)
    stepping.start()
    time.sleep(1.2)
    idle.housekeeping()  # would reclaim an entry idle past 600 ms
    assert idle.flights == {} and client.exists(KEYS.worker("w1"))
    [entry] = client.xpending_range(KEYS.requests("normal"), GROUP, "-", "+", 10)
    assert entry["consumer"] == busy.consumer.encode() and entry["time_since_delivered"] < 600
    stepping.join()
    busy.engine.step = step
    run_until([busy], lambda: is_finished(client, "slow"))
    assert {event.attempt for event in replay(client, "slow")} == {1}


def test_dead_consumers_are_deleted_and_old_dead_letters_trimmed(make_worker, client):
    stream = KEYS.requests("normal")
    worker = make_worker("w1", reclaim_idle_ms=600)
    client.xadd(stream, {FIELD: encode(Request(id="held", prompt_ids=[5]))})
    client.xreadgroup(GROUP, "crashed-holding.0", {stream: ">"})  # dead, but holds an entry: kept
    client.xgroup_createconsumer(stream, GROUP, "crashed-empty.0")  # dead, holds nothing: deleted
    client.xgroup_createconsumer(stream, GROUP, "alive-empty.0")  # holds nothing, but beats: kept
    client.set(KEYS.worker("alive-empty"), json.dumps({"consumer": "alive-empty.0"}))
    client.xgroup_createconsumer(stream, GROUP, "restarted.old")  # its worker beats as a newer consumer: deleted
    client.set(KEYS.worker("restarted"), json.dumps({"consumer": "restarted.new"}))
    old = int(time.time() * 1000) - 3600_000
    for i in range(300):  # an hour old, then fresh ones
        client.xadd(KEYS.dead_letters, {"reason": "old"}, id=f"{old}-{i}")
    client.xadd(KEYS.dead_letters, {"reason": "new"})
    time.sleep(0.7)

    assert sorted(worker.claims.sweep(dead_letter_ttl_s=60)) == ["crashed-empty.0", "restarted.old"]
    names = {consumer["name"] for consumer in client.xinfo_consumers(stream, GROUP)}
    assert {b"crashed-holding.0", b"alive-empty.0"} <= names and not {b"crashed-empty.0", b"restarted.old"} & names
    reasons = [fields[b"reason"] for _, fields in client.xrange(KEYS.dead_letters)]
    assert b"new" in reasons and reasons.count(b"old") < 300  # trimmed (approximately: whole nodes)
