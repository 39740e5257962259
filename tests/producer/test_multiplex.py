"""An AsyncProducer's streams share one subscribed connection (one per node on a cluster), and
their replay reads go out together (producer/multiplex.py): many streams at once, each still
exactly once and in order, through dropped connections."""

import asyncio
import time

import redis

from producer import AsyncProducer
from producer.connect import connect_async
from producer.multiplex import READ_WAIT_S, SharedSubscription
from producer.protocol import Keys, encode
from tests.producer.fake_worker import FakeWorker, done, token

KEYS = Keys("sb")
STREAMS = 60


async def _seqs(producer: AsyncProducer, request_id: str) -> list[int]:
    return [event.seq async for event in producer.stream(request_id, timeout=20)]


def _pubsub_clients(url: str) -> int:
    return len(redis.Redis.from_url(url).client_list(_type="pubsub"))


def test_many_streams_share_one_subscribed_connection_and_a_burst_of_nudges_is_one_round_trip(redis_url):
    worker = FakeWorker(redis_url)
    ids = [f"r{n}" for n in range(STREAMS)]

    async def scenario():
        async with AsyncProducer(redis_url, poll_interval=30) as producer:  # no rescue by polling
            for request_id in ids:
                await producer.submit("x", request_id=request_id)
            pipelines = []
            pipeline = producer._batcher.client.pipeline
            producer._batcher.client.pipeline = lambda *a, **k: pipelines.append(k) or pipeline(*a, **k)
            following = [asyncio.ensure_future(_seqs(producer, request_id)) for request_id in ids]
            while sum(len(listeners) for listeners in producer._subscription.listeners.values()) < STREAMS:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.3)  # every first replay read done
            connections = await asyncio.to_thread(_pubsub_clients, redis_url)
            before = len(pipelines)
            for step in range(3):  # a worker's step: one event of every request, in one round trip
                await asyncio.to_thread(_emit_all, worker, ids, token(step, "w "))
                await asyncio.sleep(0.2)
            per_step = (len(pipelines) - before) / 3
            await asyncio.to_thread(_emit_all, worker, ids, done(3))
            results = await asyncio.gather(*following)
            await asyncio.sleep(0.1)
            return connections, per_step, results, await producer.redis.pubsub_numsub(*map(KEYS.tokens, ids))

    connections, per_step, results, subscribers = asyncio.run(scenario())
    assert connections == 1
    assert results == [[0, 1, 2, 3]] * STREAMS
    assert per_step <= 3, f"{per_step} round trips per step for {STREAMS} streams"
    assert all(count == 0 for _, count in subscribers), "a finished stream left its channel subscribed"


def _emit_all(worker: FakeWorker, ids: list[str], event) -> None:
    pipe = worker.redis.pipeline(transaction=False)
    for request_id in ids:
        data = encode(event)
        pipe.xadd(KEYS.replay(request_id), {b"m": data})
        pipe.publish(KEYS.tokens(request_id), data)
    pipe.execute()


def test_every_stream_survives_every_connection_being_killed(redis_url):
    """The shared subscribed connection and the batched reads' connections, all dropped at once
    (what a Redis restart does to its clients): each stream still gets every event once."""
    worker = FakeWorker(redis_url)
    ids = [f"k{n}" for n in range(10)]

    async def scenario():
        async with AsyncProducer(redis_url, poll_interval=30) as producer:
            for request_id in ids:
                await producer.submit("x", request_id=request_id)
                worker.emit(request_id, token(0, "a "))
            following = [asyncio.ensure_future(_seqs(producer, request_id)) for request_id in ids]
            await asyncio.sleep(0.3)
            admin = redis.Redis.from_url(redis_url)
            await asyncio.to_thread(admin.client_kill_filter, _type="pubsub")
            await asyncio.to_thread(admin.client_kill_filter, _type="normal", skipme=True)
            for request_id in ids:  # published while the reader reconnects
                worker.emit(request_id, token(1, "b "), token(2, "c "))
            await asyncio.sleep(0.5)
            for request_id in ids:
                worker.emit(request_id, done(3))
            return await asyncio.gather(*following)

    assert asyncio.run(scenario()) == [[0, 1, 2, 3]] * len(ids)


def test_two_streams_of_one_request_each_get_a_confirmation_and_every_event(redis_url):
    """The second follower of a channel joins a subscription that is already confirmed: it must
    still wait for a confirmation of its own before its first replay read (no gap)."""
    worker = FakeWorker(redis_url)

    async def scenario():
        async with AsyncProducer(redis_url, poll_interval=30) as producer:
            await producer.submit("x", request_id="twice")
            first = asyncio.ensure_future(_seqs(producer, "twice"))
            await asyncio.sleep(0.2)
            worker.emit("twice", token(0, "a "))
            second = asyncio.ensure_future(_seqs(producer, "twice"))
            await asyncio.sleep(0.2)
            worker.emit("twice", token(1, "b "), done(2))
            return await asyncio.gather(first, second)

    assert asyncio.run(scenario()) == [[0, 1, 2], [0, 1, 2]]


def test_on_a_cluster_a_subscription_is_confirmed_while_its_nodes_reader_waits(cluster_url):
    """A channel on every master keeps each node's reader waiting for a message; streams then come
    and go one after another beside them (a gateway's steady state). Each must be confirmed at once,
    not after the waiting read gives up (redis-py locks a node's connection through a read with a
    timeout: one second a subscription, for every stream that starts or ends)."""
    cycles = 30

    async def scenario() -> float:
        client = connect_async(cluster_url, cluster=True, health_checks=False)
        shared = SharedSubscription(client, sharded=True)
        try:
            waiting = [shared.listener() for _ in range(12)]  # 12 hash tags: every master holds some
            for index, listener in enumerate(waiting):
                await _confirmed(listener, f"waiting-{{{index}}}")
            assert len(shared.readers) == 3
            started = time.monotonic()
            for index in range(cycles):
                coming = shared.listener()
                await _confirmed(coming, f"coming-{{{index}}}")
                await coming.aclose()
            return time.monotonic() - started
        finally:
            await shared.aclose()
            await client.aclose()

    took = asyncio.run(scenario())
    assert took < cycles * READ_WAIT_S / 4, f"{cycles} subscriptions took {took:.1f} s"


async def _confirmed(listener, channel: str) -> None:
    await listener.subscribe(channel)
    while (message := await listener.get_message(timeout=10)) is not None:
        if message["type"] == "ssubscribe":
            return
    raise AssertionError(f"no confirmation of {channel} within 10 s")
