"""AsyncProducer: the same behaviour as Producer on redis.asyncio (each test runs its own
event loop with asyncio.run, so no asyncio test plugin is needed)."""

import asyncio
import time

import pytest
import redis

from producer import AsyncProducer, QueueFull, UnknownRequest
from producer.protocol import Keys
from tests.producer.fake_worker import FakeWorker, done, running, token

KEYS = Keys("sb")


def test_stream_in_order_once_across_replay_duplicates_and_a_gap(redis_url):
    worker = FakeWorker(redis_url)

    async def scenario():
        async with AsyncProducer(redis_url, poll_interval=30) as producer:  # no rescue by polling
            handle = await producer.submit("a b", request_id="r1", params={"max_tokens": 16})
            assert (handle.lane, (await producer.submit("a b", request_id="r1")).duplicate) == ("fast", True)
            worker.emit("r1", token(0, "a "), token(1, "b "))  # before anyone listens
            stream = handle.stream(timeout=10)
            assert (await anext(stream)).seq == 0
            worker.emit("r1", token(1, "b "))  # duplicate
            worker.emit("r1", token(2, "c "), publish=False)  # lost publish: a gap
            worker.emit("r1", token(3, "d "), done(4))
            started = time.monotonic()
            rest = [event.seq async for event in stream]
            assert time.monotonic() - started < 3  # not rescued by the stream's timeout either
            return rest

    assert asyncio.run(scenario()) == [1, 2, 3, 4]
    assert [taken.request.id for taken in worker.take()] == ["r1"]  # enqueued once


def test_results_through_a_working_worker_and_late_consumers(redis_url):
    async def scenario():
        async with AsyncProducer(redis_url) as producer:
            handles = [await producer.submit(f"hello number {n}", params={"max_tokens": 16}) for n in range(8)]
            results = await asyncio.gather(*(handle.result(timeout=20) for handle in handles))
            again = await producer.result(handles[0].id, timeout=5)  # after the end
            return results, again

    with running(redis_url):
        results, again = asyncio.run(scenario())
    assert [r.text for r in results] == [f"hello number {n} " for n in range(8)]
    assert again == results[0] and again.usage.completion_tokens == 3


def test_errors_cancel_and_stats(redis_url):
    listener = redis.Redis.from_url(redis_url).pubsub()
    listener.subscribe(KEYS.cancel_channel)
    listener.get_message(timeout=5)

    async def scenario():
        async with AsyncProducer(redis_url, max_backlog=1) as producer:
            await producer.submit("x", request_id="one")
            with pytest.raises(QueueFull, match="normal lane is full"):
                await producer.submit("y", request_id="two")
            with pytest.raises(ValueError, match="invalid request: lane: invalid enum value"):
                await producer.submit("y", lane="express")
            with pytest.raises(UnknownRequest):
                await producer.result("two", timeout=5)  # refused, so never submitted
            await producer.cancel("one")
            return await producer.stats()

    FakeWorker(redis_url).heartbeat()
    stats = asyncio.run(scenario())
    assert listener.get_message(timeout=5)["data"] == b"one"
    assert redis.Redis.from_url(redis_url).exists(KEYS.cancelled("one"))
    assert (stats.lanes["normal"].backlog, stats.lanes["fast"].backlog, stats.dead_letters) == (1, 0, 0)
    assert [w.name for w in stats.workers] == ["fake"]
