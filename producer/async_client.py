"""AsyncProducer: the Producer's API on redis.asyncio, for asyncio services.

The API is producer/shell.py's and the flows producer/core.py's, as for Producer: only the
awaits differ. Every method returns an awaitable (`stream`, an async iterator). Its streams
share one subscribed connection, and their replay reads go out together (producer/multiplex.py):
one AsyncProducer follows thousands of streams at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import redis
import redis.asyncio

from producer.client import flow_error
from producer.core import Call, Deliver, Flow, Operation, Pause, Steps, Subscribe
from producer.multiplex import CallBatcher, ChannelListener, SharedSubscription
from producer.connect import REDIS_FAILURES, connect_async, refresh_slot_map_async
from producer.protocol import Event
from producer.shell import MAX_CONNECTIONS, ProducerShell, as_is


class AsyncProducer(ProducerShell):
    """See ProducerShell for the API; every method returns an awaitable of its value."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # Shared by every stream and call, and by the copies `as_tenant` makes.
        self._subscription = SharedSubscription(self._listener, sharded=self.cluster)
        self._batcher = CallBatcher(self.redis)

    def _connect(self, url: str, subscribing: bool = False) -> redis.asyncio.Redis | redis.asyncio.RedisCluster:
        # The shared subscription's connections go without health checks (producer/multiplex.py).
        return connect_async(url, cluster=self.cluster, password=self._password, max_connections=MAX_CONNECTIONS,
                             health_checks=not subscribing)

    async def aclose(self) -> None:
        await self._subscription.aclose()
        await self.redis.aclose()
        await self._listener.aclose()

    async def __aenter__(self) -> AsyncProducer:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def _run(self, flow: Flow, then: Callable[[Any], Any] = as_is):
        steps = Steps(flow)
        async for _ in self._drive(steps, None):
            raise AssertionError("this flow delivers no events")
        return then(steps.value)

    async def _stream(self, flow: Flow) -> AsyncIterator[Event]:
        listener = self._subscription.listener()
        try:
            async for event in self._drive(Steps(flow), listener):
                yield event
        finally:
            await listener.aclose()

    async def _collect(self, flow: Flow, then: Callable[[list], Any]):
        return then([event async for event in self._stream(flow)])

    async def _drive(self, steps: Steps, pubsub: ChannelListener | None) -> AsyncIterator[Event]:
        operation = steps.next()
        while operation is not None:
            if isinstance(operation, Deliver):
                for event in operation.events:
                    yield event
                operation = steps.next()
                continue
            try:
                reply = await self._perform(operation, pubsub)
            except REDIS_FAILURES as error:
                if self.cluster and not isinstance(operation, Call):  # redis-py follows MOVED for commands only
                    await refresh_slot_map_async(self._listener)
                operation = steps.next(error=flow_error(error))
            else:
                operation = steps.next(reply)

    async def _perform(self, operation: Operation, pubsub: ChannelListener | None):
        if isinstance(operation, Call):
            return await self._batcher.execute(operation)
        if isinstance(operation, Subscribe):
            return await pubsub.subscribe(operation.channel, operation.fresh)
        if isinstance(operation, Pause):
            return await asyncio.sleep(operation.seconds)
        return await pubsub.get_message(ignore_subscribe_messages=not operation.subscribe_messages,
                                        timeout=operation.timeout)
