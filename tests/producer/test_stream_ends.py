"""A consumer always ends: with the request's events, or promptly with a clear error. Each case
runs through both clients, which drive the one flow of producer/core.py."""

import asyncio
import threading
import time

import pytest

from producer import AsyncProducer, EventsLost, Producer, UnknownRequest
from producer import core as producer_core
from producer.core import Steps
from producer.protocol import Keys, Request, Submission, encode
from tests.producer.fake_worker import FakeWorker, done, token

KEYS = Keys("sb")
QUICK = {"poll_interval": 0.1}  # how soon a quiet stream looks at the keys again


def result_of(client: str, url: str, request_id: str, timeout: float = 10):
    """The request's result through the sync or the async client, and how long it took."""
    started = time.monotonic()
    if client == "sync":
        with Producer(url, **QUICK) as producer:
            return producer.result(request_id, timeout=timeout), time.monotonic() - started

    async def result():
        async with AsyncProducer(url, **QUICK) as producer:
            return await producer.result(request_id, timeout=timeout)

    return asyncio.run(result()), time.monotonic() - started


def raised_by(client: str, url: str, request_id: str, error: type[Exception]) -> tuple[str, float]:
    started = time.monotonic()
    with pytest.raises(error) as raised:
        result_of(client, url, request_id)
    return str(raised.value), time.monotonic() - started


CLIENTS = pytest.mark.parametrize("client", ["sync", "async"])


@CLIENTS
def test_an_id_never_submitted_ends_at_once(client, redis_url):
    message, took = raised_by(client, redis_url, "nobody", UnknownRequest)
    assert "never submitted, or expired" in message and took < 2


@CLIENTS
def test_a_producer_that_dies_between_taking_the_id_and_enqueueing_frees_it_and_ends_its_consumers(
        client, redis_url, monkeypatch):
    monkeypatch.setattr(producer_core, "ENQUEUE_TTL_S", 1)
    with Producer(redis_url) as dying:
        steps = Steps(dying.core.submit(Request(id="orphan", prompt="x")))
        operation = steps.next()
        while "enqueuing" not in repr(operation):  # up to the SET NX that takes the id
            operation = steps.next(dying._perform(operation, None))
        dying._perform(operation, None)  # the id is taken ... and the producer dies before the XADD
    assert dying.redis.xlen(KEYS.requests("fast")) == 0
    message, took = raised_by(client, redis_url, "orphan", UnknownRequest)
    assert "was never enqueued: its producer stopped" in message and took < 4
    with Producer(redis_url) as retry:  # the id is free again
        assert not retry.submit("x", request_id="orphan").duplicate


@CLIENTS
def test_a_request_whose_events_expire_before_it_finishes_ends_with_events_lost(client, redis_url):
    worker = FakeWorker(redis_url)
    with Producer(redis_url) as producer:
        producer.submit("a b", request_id="stalled")
    worker.emit("stalled", token(0, "a "))
    # Its worker stalls past the replay TTL: the keys expire while a consumer follows.
    expiry = threading.Timer(0.5, worker.redis.delete, [KEYS.replay("stalled"), KEYS.submitted("stalled")])
    expiry.start()
    message, took = raised_by(client, redis_url, "stalled", EventsLost)
    assert message == "the events of request stalled expired before it finished" and took < 3


@CLIENTS
def test_a_request_dead_lettered_without_an_event_ends_its_consumers(client, redis_url):
    """A worker that finds the replay stream it would resume from damaged cannot number an
    error event, so it marks the submission rejected: a consumer following it ends."""
    worker = FakeWorker(redis_url)
    with Producer(redis_url) as producer:
        producer.submit("a b", request_id="damaged")
    worker.emit("damaged", token(0, "a "), token(1, "b "))

    def damage_and_reject():
        worker.redis.xtrim(KEYS.replay("damaged"), maxlen=1)  # seq 0 is gone
        worker.redis.set(KEYS.submitted("damaged"),
                         encode(Submission("fast", "rejected", "replay stream is missing events")), ex=60)

    threading.Timer(0.5, damage_and_reject).start()
    message, took = raised_by(client, redis_url, "damaged", EventsLost)
    assert message == "request damaged was dead-lettered: replay stream is missing events" and took < 3


@CLIENTS
def test_a_queued_request_is_waited_for_and_a_finished_one_read_to_the_end(client, redis_url):
    worker = FakeWorker(redis_url)
    with Producer(redis_url) as producer:
        producer.submit("one two", request_id="queued")
    with pytest.raises(TimeoutError):  # nothing wrong with it: it waits for a worker
        result_of(client, redis_url, "queued", timeout=0.5)
    worker.emit("queued", token(0, "one "), token(1, "two "), done(2, completion_tokens=2))
    completion, _ = result_of(client, redis_url, "queued")
    assert completion.text == "one two " and completion.finish_reason == "stop"
