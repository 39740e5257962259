"""Engine outputs -> events numbered per request, one MULTI per flush, and the fence that
refuses the writes of a superseded attempt; on a real redis-server and on fakeredis alike."""

import pytest
import redis
import structlog

from producer.protocol import DoneEvent, Timings, TokenEvent, TokenLogprob, TopLogprob, Usage, decode_event
from worker.engine.outputs import RequestOutput
from worker.flight import Flight
from worker.entries import Entry
from worker.outbox import Outbox

from .conftest import KEYS, replay


@pytest.fixture
def outbox(any_client):
    return Outbox(any_client, replay_maxlen=1000, replay_ttl=60)


def owned(any_client, request_id: str, attempt: int = 1, next_seq: int = 0) -> Flight:
    """A flight whose claim holds the request's attempt key (as claims.py leaves it)."""
    flight = Flight(request_id, KEYS, Entry(KEYS.requests("normal"), "1-0", {}), attempt, next_seq,
                    log=structlog.get_logger().bind(request_id=request_id))
    any_client.set(KEYS.attempt(request_id), flight.fence)
    return flight


def token(request_id: str, token_id: int) -> RequestOutput:
    return RequestOutput(request_id, [token_id])


def test_outputs_become_events_numbered_from_where_the_request_stands(outbox, any_client):
    flight = owned(any_client, "a", attempt=2, next_seq=5)  # resumed: the numbering continues
    logprobs = [TokenLogprob(-0.5, "x", [TopLogprob(7, -0.5, "x"), TopLogprob(3, -1.25, "y")])]
    outbox.add_output(flight, RequestOutput("a", [7], text="x", logprobs=logprobs))
    outbox.add_output(flight, RequestOutput("a", [8], finish_reason="length", usage=Usage(3, 2),
                                            timings=Timings(queued=0.1, ttft=0.2, total=0.3)))
    assert replay(any_client, "a") == [] and flight.finished
    assert outbox.flush([flight]) == [(flight, True)]
    assert replay(any_client, "a") == [
        TokenEvent(seq=5, attempt=2, ids=[7], text="x", logprobs=logprobs),
        TokenEvent(seq=6, attempt=2, ids=[8], text=""),
        DoneEvent(seq=7, attempt=2, finish_reason="length", usage=Usage(3, 2),
                  timings=Timings(queued=0.1, ttft=0.2, total=0.3)),
    ]
    assert flight.pending == [] and flight.next_seq == 8
    assert 0 < any_client.ttl(KEYS.replay("a")) <= 60
    assert any_client.ttl(KEYS.attempt("a")) == -1, "the fence lasts while the entry is pending: the ack ends it"


def command_calls(client) -> dict[str, int]:
    stats = client.info("commandstats")
    return {name: stats.get(f"cmdstat_{name}", {}).get("calls", 0) for name in ("multi", "exec", "evalsha")}


def test_one_pipeline_carries_the_events_of_every_request(redis_url):
    """Real server only: it counts commands with INFO commandstats, which fakeredis lacks. One round
    trip, not a transaction: each request's script is atomic on its own (and on a cluster the
    requests' keys are on several nodes, which no MULTI spans)."""
    client = redis.Redis.from_url(redis_url)
    outbox = Outbox(client, replay_maxlen=1000, replay_ttl=60)
    pipelines, pipeline = [], client.pipeline
    client.pipeline = lambda *args, **kwargs: pipelines.append(kwargs) or pipeline(*args, **kwargs)
    flights = [owned(client, f"r{i}") for i in range(5)]
    idle = owned(client, "idle")
    listener = client.pubsub()
    listener.psubscribe(KEYS.tokens("*"))
    listener.get_message(timeout=1)
    for i, flight in enumerate(flights):
        outbox.add_output(flight, token(flight.request_id, i))
    before = command_calls(client)
    assert outbox.flush(flights + [idle]) == [(flight, True) for flight in flights]
    after = command_calls(client)
    assert {name: after[name] - before[name] for name in after} == {"multi": 0, "exec": 0, "evalsha": 5}
    assert pipelines == [{"transaction": False}]
    published = [listener.get_message(timeout=1) for _ in flights]
    assert [(m["channel"].decode(), decode_event(m["data"])) for m in published] == [
        (KEYS.tokens(f"r{i}"), TokenEvent(seq=0, attempt=1, ids=[i], text="")) for i in range(5)]


def test_the_writes_of_a_superseded_attempt_are_refused(outbox, any_client):
    flight = owned(any_client, "a")
    outbox.add_output(flight, token("a", 1))
    assert outbox.flush([flight]) == [(flight, True)]
    any_client.set(KEYS.attempt("a"), f"2 {flight.entry.owner}")  # another worker claimed the request
    outbox.add_output(flight, token("a", 2))
    assert outbox.flush([flight]) == [(flight, False)]
    assert [event.ids for event in replay(any_client, "a")] == [[1]] and flight.pending == []
    any_client.set(KEYS.attempt("a"), f"1 {KEYS.requests('normal')} 2-0")  # attempt 1 of another entry of the id
    outbox.add_output(flight, token("a", 3))
    assert outbox.flush([flight]) == [(flight, False)]
    any_client.delete(KEYS.attempt("a"))  # gone: refused too
    outbox.add_output(flight, token("a", 4))
    assert outbox.flush([flight]) == [(flight, False)]


def test_a_lost_script_cache_is_reloaded(outbox, any_client):
    flight = owned(any_client, "a")
    any_client.script_flush()
    outbox.add_output(flight, token("a", 1))
    assert outbox.flush([flight]) == [(flight, True)]
    assert len(replay(any_client, "a")) == 1


def test_the_submission_key_lives_as_long_as_the_events_and_expires_with_them(outbox, any_client):
    """While a request runs, a write only ever extends its submission key's TTL (a producer's
    claim TTL may be longer than the replay's); the terminal write gives both the replay TTL."""
    flight = owned(any_client, "a")
    any_client.set(KEYS.submitted("a"), b"queued", ex=3600)
    outbox.add_output(flight, token("a", 1))
    outbox.flush([flight])
    assert any_client.ttl(KEYS.submitted("a")) > 60  # not shortened mid-run
    any_client.expire(KEYS.submitted("a"), 5)
    outbox.add_output(flight, token("a", 2))
    outbox.flush([flight])
    assert 55 <= any_client.ttl(KEYS.submitted("a")) <= 60  # extended to the replay's
    any_client.expire(KEYS.submitted("a"), 3600)
    outbox.add_output(flight, RequestOutput("a", [3], finish_reason="length", usage=Usage(1, 3),
                                            timings=Timings(0.1, 0.2, 0.3)))
    outbox.flush([flight])
    assert 55 <= any_client.ttl(KEYS.submitted("a")) <= 60 and 55 <= any_client.ttl(KEYS.replay("a")) <= 60
