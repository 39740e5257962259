"""A consumer always ends: with the request's events, or promptly with a clear error. Each case
runs through both clients, which drive the one flow of producer/core.py."""

import asyncio
import threading
import time

import pytest

from producer import AsyncProducer, Disconnected, EventsLost, Producer, UnknownRequest
from producer import core as producer_core
from producer.core import Steps
from producer.protocol import Keys, Request, Submission, encode
from tests.conftest import private_redis
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
    assert message == ("the events of request stalled are gone from Redis before it finished "
                       "(expired, or lost with Redis's data)") and took < 3


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


def run_submit(producer: Producer, request: Request, fail_after) -> tuple:
    """Drive a submit flow, throwing Disconnected in place of the reply of each operation that
    `fail_after(operation)` picks (which still reaches Redis, as when only its reply is lost)."""
    steps = Steps(producer.core.submit(request))
    operation = steps.next()
    while operation is not None:
        reply = producer._perform(operation, None)
        operation = steps.next(error=Disconnected("reply lost")) if fail_after(operation) else steps.next(reply)
    return steps.value


def test_a_submit_whose_replies_are_lost_enqueues_exactly_once(redis_url):
    lost = {"set": 1, "xadd": 1}  # the claim's reply, then the MULTI's: both ran on the server

    def fail_after(operation) -> bool:
        name = operation.commands[0].name if hasattr(operation, "commands") else ""
        if lost.get(name):
            lost[name] -= 1
            return True
        return False

    with Producer(redis_url) as producer:
        assert run_submit(producer, Request(id="lossy", prompt="x"), fail_after) == ("normal", False)
        assert producer.redis.xlen(KEYS.requests("normal")) == 1
        assert producer.submit("x", request_id="lossy").duplicate  # taken, and queued


def test_a_second_submit_of_an_id_left_mid_way_waits_for_the_claim_to_lapse_and_takes_it(redis_url, monkeypatch):
    monkeypatch.setattr(producer_core, "ENQUEUE_TTL_S", 1)
    with Producer(redis_url) as producer:
        dying = Steps(producer.core.submit(Request(id="retried", prompt="x")))
        operation = dying.next()
        while "enqueuing" not in repr(operation):
            operation = dying.next(producer._perform(operation, None))
        producer._perform(operation, None)  # took the id, never enqueued
        started = time.monotonic()
        handle = producer.submit("x", request_id="retried")  # the caller's retry
        assert not handle.duplicate and 0.5 < time.monotonic() - started < 3
        assert producer.redis.xlen(KEYS.requests(handle.lane)) == 1


@pytest.fixture
def own_redis(tmp_path):
    """A redis-server of this test's own, to pause and kill: -> (url, process)."""
    with private_redis(tmp_path) as server:
        yield server


@pytest.mark.parametrize("client", ["sync", "async"])
def test_a_server_that_pauses_then_dies_before_confirming_the_subscription_ends_the_stream_without_spinning(
        own_redis, monkeypatch, client):
    """The stream used to wait for SUBSCRIBE's reply by polling a dead connection: 800,000 polls and
    47 s of CPU in 70 s, never giving up. Now it backs off, and gives up after its patience."""
    import redis

    monkeypatch.setattr(producer_core, "RECONNECT_PATIENCE_S", 2.0)
    url, server = own_redis
    admin = redis.Redis.from_url(url)
    producer = (Producer if client == "sync" else AsyncProducer)(url, **QUICK)
    listens, perform = [], producer._perform

    def counted(operation, pubsub):
        if isinstance(operation, producer_core.Listen):
            listens.append(time.monotonic())
        return perform(operation, pubsub)

    producer._perform = counted
    pool, paused = producer._listener.connection_pool, threading.Event()
    connect = pool.get_connection

    def pause_once_connected(connection):  # SUBSCRIBE goes out next, and its reply is held back
        admin.client_pause(60_000, all=True)
        paused.set()
        return connection

    if client == "sync":
        pool.get_connection = lambda *args, **kwargs: pause_once_connected(connect(*args, **kwargs))
    else:
        async def connect_then_pause(*args, **kwargs):
            return pause_once_connected(await connect(*args, **kwargs))
        pool.get_connection = connect_then_pause
    outcome = []

    def consume():
        async def drain():
            return [event async for event in producer.stream("r")]

        try:
            list(producer.stream("r")) if client == "sync" else asyncio.run(drain())
        except Exception as error:
            outcome.append(error)

    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    assert paused.wait(10)
    time.sleep(0.5)
    assert listens, "waiting for the confirmation"
    server.kill()
    killed_at = time.monotonic()
    consumer.join(timeout=15)
    assert not consumer.is_alive(), f"still waiting after {len(listens)} polls"
    [error] = outcome
    assert isinstance(error, Disconnected)
    assert len([at for at in listens if at > killed_at]) < 20, "polled a dead connection without backing off"


def test_a_subscription_left_unconfirmed_for_a_replys_time_is_made_again_on_a_new_connection(monkeypatch):
    """A silent connection (half-open: nothing comes back, nothing fails) takes a SUBSCRIBE and never
    confirms it: past REPLY_TIMEOUT_S the stream subscribes again, asking for a new connection, and a
    SUBSCRIBE that itself fails asks for none (the connection is down already, not silent)."""
    monkeypatch.setattr("producer.protocol.REPLY_TIMEOUT_S", 0.05)
    core = producer_core.ProducerCore(KEYS, max_backlog=10, claim_ttl=60, poll_interval=0.01)
    steps = Steps(core.stream("quiet", timeout=30))
    operation = steps.next()
    assert operation == producer_core.Subscribe(KEYS.tokens("quiet"), fresh=False)
    started = time.monotonic()
    while isinstance(operation := steps.next(), producer_core.Listen):
        time.sleep(operation.timeout)  # the silent connection: nothing heard
    assert isinstance(operation, producer_core.Pause) and time.monotonic() - started >= 0.05
    assert steps.next() == producer_core.Subscribe(KEYS.tokens("quiet"), fresh=True)
    assert isinstance(steps.next(error=Disconnected("refused")), producer_core.Pause)
    assert steps.next() == producer_core.Subscribe(KEYS.tokens("quiet"), fresh=False)
