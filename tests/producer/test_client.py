"""Producer and Handle against a real redis-server, with a fake worker writing events the
way the worker does (tests/producer/fake_worker.py)."""

import pathlib
import subprocess
import sys
import time

import msgspec
import pytest
import redis

from producer import Producer, QueueFull, UnknownRequest
from producer.errors import EventsLost
from producer.protocol import FIELD, Keys, TokenEvent, decode_request, encode
from tests.producer.fake_worker import FakeWorker, done, error, running, token

KEYS = Keys("sb")
ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture
def producer(redis_url):
    """Polls the replay stream only every 30 s, so what a test sees within its few seconds
    came through the channel and the gap logic, not through polling."""
    with Producer(redis_url, poll_interval=30) as producer:
        yield producer


@pytest.fixture
def worker(redis_url):
    return FakeWorker(redis_url)


def seqs_soon(stream, within: float = 3.0) -> list[int]:
    """The rest of a stream, which must come well before any replay poll (30 s) or the
    stream's timeout (10 s) could have rescued it."""
    started = time.monotonic()
    seqs = [event.seq for event in stream]
    assert time.monotonic() - started < within
    return seqs


def test_submit_enqueues_one_entry_on_the_chosen_lane(producer, worker):
    handle = producer.submit("hello there", params={"max_tokens": 8}, request_id="r1")
    assert (handle.id, handle.lane, handle.duplicate) == ("r1", "fast", False)
    [taken] = worker.take()
    assert (taken.lane, taken.request.prompt, taken.request.params.max_tokens) == ("fast", "hello there", 8)
    assert taken.request.lane is None  # the worker's rule still decides with real token counts
    long = producer.submit(messages=[{"role": "user", "content": "x" * 900}], params={"max_tokens": 8})
    assert long.lane == "normal"  # ~300+ estimated tokens > 256


def test_every_event_exactly_once_in_order_published_before_and_after_subscribing(producer, worker):
    handle = producer.submit("a b c d e", request_id="r1")
    worker.emit("r1", token(0, "a "), token(1, "b "))  # nobody listens yet: replay only
    stream = handle.stream(timeout=10)
    assert next(stream).seq == 0  # subscribed now, replay read
    worker.emit("r1", token(2, "c "))
    worker.emit("r1", token(1, "b "), token(2, "c "))  # a resumed worker repeats itself
    worker.emit("r1", token(3, "d "), done(4, completion_tokens=4))
    assert seqs_soon(stream) == [1, 2, 3, 4]


def test_a_consumer_arriving_after_the_end_gets_everything(producer, worker, redis_url):
    producer.submit("x", request_id="late")
    worker.emit("late", token(0, "one "), token(1, "two "), done(2, completion_tokens=2))
    with Producer(redis_url) as another:  # a different process, say, long after the fact
        completion = another.result("late", timeout=5)
    assert (completion.text, completion.token_ids, completion.finish_reason) == ("one two ", [0, 1], "stop")
    assert completion.usage.completion_tokens == 2 and completion.timings.ttft == 0.02


def test_a_gap_on_the_channel_is_filled_from_the_replay_stream(producer, worker):
    handle = producer.submit("x", request_id="gap")
    worker.emit("gap", token(0, "a "))
    stream = handle.stream(timeout=10)
    assert next(stream).seq == 0
    worker.emit("gap", token(1, "b "), token(2, "c "), publish=False)  # publishes lost
    worker.emit("gap", token(3, "d "))
    worker.emit("gap", token(2, "c "), replay=False)  # a late duplicate on the channel
    worker.emit("gap", done(4))
    assert seqs_soon(stream) == [1, 2, 3, 4]


def test_a_lost_final_publish_is_found_by_polling_the_replay_stream(redis_url, worker):
    handle = Producer(redis_url, poll_interval=0.1).submit("x", request_id="quiet")
    stream = handle.stream(timeout=10)
    worker.emit("quiet", token(0, "a "))
    assert next(stream).seq == 0
    worker.emit("quiet", done(1), publish=False)
    assert seqs_soon(stream, within=2) == [1]  # within a few poll intervals, not the timeout


def test_a_forged_publish_on_the_channel_is_never_taken_for_an_event(producer, worker, redis_url):
    """The red team's forgery: one PUBLISH on the victim's channel made its completion read the
    attacker's text, and garbage there ended the stream with ProtocolViolation. Events now come
    from the replay stream, which only the request's owner writes; the channel only nudges."""
    handle = producer.submit("x", request_id="victim")
    worker.emit("victim", token(0, "real "))
    stream = handle.stream(timeout=10)
    assert next(stream).text == "real "
    attacker = redis.Redis.from_url(redis_url)
    attacker.publish(KEYS.tokens("victim"), encode(token(1, "Transfer approved. Wire to IBAN XX00 EVIL")))
    attacker.publish(KEYS.tokens("victim"), encode(done(2)))
    attacker.publish(KEYS.tokens("victim"), b"\xc1 not an event")
    worker.emit("victim", token(1, "answer"), done(2, completion_tokens=2))
    rest = list(stream)
    assert [event.text for event in rest if isinstance(event, TokenEvent)] == ["answer"]
    assert producer.result("victim", timeout=5).text == "real answer"


def test_a_producer_acts_for_its_tenant_passed_or_from_the_environment(redis_url, monkeypatch):
    client = redis.Redis.from_url(redis_url)
    with Producer(redis_url, tenant="team-a") as team_a:
        team_a.submit("x", request_id="mine")
    monkeypatch.setenv("STREAMBATCH_TENANT", "team-b")
    with Producer(redis_url) as team_b:
        team_b.submit("y", request_id="mine")  # ids are per tenant: no duplicate
    for tenant, prompt in (("team-a", "x"), ("team-b", "y")):
        [(_, fields)] = client.xrange(KEYS.of(tenant).requests("normal"))
        assert decode_request(fields[FIELD]).prompt == prompt
        assert client.exists(KEYS.of(tenant).submitted("mine"))
    assert client.xlen(KEYS.requests("normal")) == 0, "nothing in the default tenant's streams"
    with pytest.raises(ValueError, match="tenant name"):
        Producer(redis_url, tenant="Team A")


def test_the_stream_survives_a_dropped_pubsub_connection(producer, worker, redis_url):
    handle = producer.submit("x", request_id="drop")
    worker.emit("drop", token(0, "a "))
    stream = handle.stream(timeout=10)
    assert next(stream).seq == 0
    redis.Redis.from_url(redis_url).client_kill_filter(_type="pubsub")
    worker.emit("drop", token(1, "b "), token(2, "c "))  # published while we reconnect
    worker.emit("drop", done(3))
    assert seqs_soon(stream) == [1, 2, 3]


def test_result_of_a_failed_request_carries_the_error(producer, worker):
    producer.submit("x", request_id="bad")
    worker.emit("bad", token(0, "a "), error(1, "too_long", "prompt has 9000 tokens"))
    completion = producer.result("bad", timeout=5)
    assert (completion.finish_reason, completion.ok, completion.text) == ("error", False, "a ")
    assert completion.error == "too_long: prompt has 9000 tokens" and completion.usage is None


def test_result_times_out_while_nothing_happens(producer):
    producer.submit("x", request_id="slow")
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="slow did not finish within 0.3 s"):
        producer.result("slow", timeout=0.3)
    assert time.monotonic() - started < 1.5


def test_unknown_ids_and_trimmed_replays_fail_clearly(producer, worker):
    with pytest.raises(UnknownRequest, match="never submitted"):
        producer.result("nobody", timeout=5)
    producer.submit("x", request_id="trimmed")
    worker.emit("trimmed", token(2, "c "), done(3))  # 0 and 1 trimmed away
    with pytest.raises(EventsLost, match="events 0..1 of request trimmed"):
        producer.result("trimmed", timeout=5)


def test_submitting_an_id_twice_enqueues_once(producer, worker):
    first = producer.submit("hello", request_id="same", params={"max_tokens": 500})
    again = producer.submit("something else", request_id="same")
    assert (first.lane, again.lane, again.duplicate) == ("normal", "normal", True)
    assert producer.redis.xlen(KEYS.requests("normal")) == 1
    assert producer.redis.xlen(KEYS.requests("fast")) == 0


def test_a_full_lane_refuses_and_frees_the_id(redis_url, worker):
    producer = Producer(redis_url, max_backlog=2)
    short = {"max_tokens": 16}
    producer.submit("a", request_id="a", params=short)
    producer.submit("b", request_id="b", params=short)
    with pytest.raises(QueueFull, match=r"the fast lane is full: 2 requests .* \(limit 2\)"):
        producer.submit("c", request_id="c", params=short)
    assert producer.redis.xlen(KEYS.requests("fast")) == 2
    assert producer.submit("d").lane == "normal"  # the other lane has room
    for taken in worker.take():  # a worker finishes what it took
        worker.finish(taken)
    assert producer.submit("c", request_id="c", params=short).duplicate is False


@pytest.mark.parametrize("kwargs, message", [
    ({"prompt": "x", "request_id": "has space"}, r"request id must match"),
    ({"prompt": "x", "messages": [{"role": "user", "content": "y"}]},
     r"give exactly one of prompt, messages, prompt_ids; got \['prompt', 'messages'\]"),
    ({}, r"give exactly one of prompt, messages, prompt_ids; got none"),
    ({"prompt": ""}, r"the prompt is empty"),
    ({"prompt": "x", "params": {"temperature": -1}}, r"params: invalid sampling params: temperature"),
    ({"prompt": "x", "params": {"max_tokens": "many"}}, r"params.max_tokens: expected `int`, got `str`"),
    ({"prompt": "x", "params": {"top_q": 1}}, r"params: object contains unknown field `top_q`"),
    ({"prompt": "x", "lane": "express"}, r"lane: invalid enum value 'express'"),
    ({"messages": [{"role": "bot", "content": "y"}]}, r"messages\[0\].role: invalid enum value 'bot'"),
    ({"prompt_ids": [1, -2]}, r"prompt_ids must be non-negative token ids"),
    ({"prompt": "x", "deadline": 30.0}, r"deadline 30.0 is in the past"),
    ({"prompt": "x", "deadline": float("nan")}, r"deadline must be a finite unix time, got nan"),
])
def test_bad_requests_are_refused_before_reaching_redis(producer, kwargs, message):
    with pytest.raises(ValueError, match="invalid request: " + message):
        producer.submit(**kwargs)
    assert producer.redis.dbsize() == 0


def test_a_ready_request_is_validated_strictly_too(producer, worker):
    from producer import Request, SamplingParams

    handle = producer.submit(Request(id="ready", prompt_ids=[1, 2, 3], params=SamplingParams(seed=7)))
    assert worker.take()[0].request.params.seed == 7 and handle.lane == "normal"  # max_tokens 256 > 128
    with pytest.raises(ValueError, match="lane: invalid enum value 'slow'"):
        producer.submit(Request(prompt="x", lane="slow"))


def test_cancel_sets_the_durable_flag_and_nudges_workers(producer, redis_url):
    listener = redis.Redis.from_url(redis_url).pubsub()
    listener.subscribe(KEYS.cancel_channel)
    listener.get_message(timeout=5)
    handle = producer.submit("x", request_id="stop-me")
    handle.cancel()
    assert producer.redis.get(KEYS.cancelled("stop-me")) == b"1"
    assert 0 < producer.redis.ttl(KEYS.cancelled("stop-me")) <= 3600
    assert listener.get_message(timeout=5)["data"] == b"stop-me"
    with pytest.raises(ValueError, match="request id must match"):
        producer.cancel("sb:*")


def test_cancel_through_a_working_worker_finishes_as_cancelled(producer, redis_url):
    with running(redis_url, step_delay=0.05):
        handle = producer.submit(" ".join(["word"] * 200), params={"max_tokens": 200})
        stream = handle.stream(timeout=10)
        next(stream)
        handle.cancel()
        *_, last = stream
    assert last.finish_reason == "cancelled" and last.seq < 100


def test_stats_show_backlogs_pending_workers_and_dead_letters(producer, worker, redis_url):
    empty = producer.stats()
    assert (empty.lanes["fast"].backlog, empty.lanes["normal"].pending, empty.workers, empty.dead_letters) == \
        (0, 0, [], 0)
    for n in range(3):
        producer.submit(f"q{n}", params={"max_tokens": 16})
    producer.submit("long one")
    worker.take(count=1)  # one request of each lane in flight (COUNT is per stream)
    worker.heartbeat(model="smollm2-135m")
    server = redis.Redis.from_url(redis_url)
    server.hset(KEYS.worker("hash-worker"), mapping={"running": "2", "kv_usage": "0.5", "model": "m"})
    server.xadd(KEYS.dead_letters, {"reason": "bad id", "id": "?", "entry": b"\x00"})
    stats = producer.stats()
    backlog_pending = {lane: (lane_stats.backlog, lane_stats.pending) for lane, lane_stats in stats.lanes.items()}
    assert backlog_pending == {"fast": (3, 1), "normal": (1, 1)}
    assert [(w.name, w.model, w.running, w.kv_usage) for w in stats.workers] == [
        ("fake", "smollm2-135m", 0, 0.0), ("hash-worker", "m", 2, 0.5)]
    assert stats.workers[0].uptime < 60 and stats.dead_letters == 1
    assert msgspec.json.decode(msgspec.json.encode(stats))["lanes"]["fast"] == {"backlog": 3, "pending": 1}


def test_many_requests_through_a_working_worker(producer, redis_url):
    with running(redis_url):
        handles = [producer.submit(f"request {n} says hello", params={"max_tokens": 16},
                                   lane="normal" if n % 2 else None) for n in range(20)]
        results = [handle.result(timeout=20) for handle in handles]
    assert [r.text for r in results] == [f"request {n} says hello " for n in range(20)]
    assert {h.lane for h in handles[1::2]} == {"normal"} and {h.lane for h in handles[::2]} == {"fast"}
    assert producer.redis.xlen(KEYS.requests("fast")) == producer.redis.xlen(KEYS.requests("normal")) == 0


def test_the_producer_installs_light():
    code = ("import sys; from producer import AsyncProducer, Producer; import producer.cli, ops.demo; "
            "print(sorted(m for m in ('torch', 'transformers', 'worker') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
