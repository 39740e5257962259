"""AsyncProducer: the Producer's API on redis.asyncio, for asyncio services.

The same flows as Producer (producer/core.py) run here: only the awaits differ."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import redis
import redis.asyncio

from producer.client import DEFAULT_URL, MAX_CONNECTIONS, flow_error, queued
from producer.completion import Completion
from producer.core import Call, Deliver, Flow, Operation, Pause, ProducerCore, Steps, Subscribe
from producer.protocol import Event, Keys, Lane, Message, Request, SamplingParams, connection_options
from producer.stats import QueueStats
from producer.submission import build_request, checked_id


class AsyncProducer:
    def __init__(self, url: str = DEFAULT_URL, *, prefix: str = "sb", max_backlog: int = 10_000,
                 claim_ttl: float = 3600, poll_interval: float = 1.0) -> None:
        """See Producer."""
        self.core = ProducerCore(Keys(prefix), max_backlog, int(claim_ttl), poll_interval)
        self.keys = self.core.keys
        self.redis = redis.asyncio.Redis.from_url(url, **connection_options(), max_connections=MAX_CONNECTIONS)
        self._listener = redis.asyncio.Redis.from_url(url, **connection_options(),
                                                      max_connections=MAX_CONNECTIONS)  # see Producer

    async def aclose(self) -> None:
        await self.redis.aclose()
        await self._listener.aclose()

    async def __aenter__(self) -> AsyncProducer:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def submit(self, prompt: str | Request | None = None, *,
                     messages: list[Message] | list[dict] | None = None, prompt_ids: list[int] | None = None,
                     params: SamplingParams | dict | None = None, lane: Lane | None = None,
                     request_id: str | None = None, deadline: float | None = None) -> AsyncHandle:
        """See Producer.submit."""
        request = build_request(prompt, messages=messages, prompt_ids=prompt_ids, params=params,
                                lane=lane, request_id=request_id, deadline=deadline)
        lane, duplicate = await self._run(self.core.submit(request))
        return AsyncHandle(self, request.id, lane, duplicate)

    async def cancel(self, request_id: str) -> None:
        await self._run(self.core.cancel(checked_id(request_id)))

    def stream(self, request_id: str, timeout: float | None = None) -> AsyncIterator[Event]:
        return AsyncHandle(self, checked_id(request_id)).stream(timeout)

    async def result(self, request_id: str, timeout: float | None = None) -> Completion:
        return await AsyncHandle(self, checked_id(request_id)).result(timeout)

    async def stats(self) -> QueueStats:
        return await self._run(self.core.stats())

    async def pin(self, name: str, prompt: str | None = None, *, messages: list[Message] | list[dict] | None = None,
                  prompt_ids: list[int] | None = None) -> None:
        """See Producer.pin."""
        await self._run(self.core.pin(build_request(prompt, messages=messages, prompt_ids=prompt_ids,
                                                    request_id=name)))

    async def unpin(self, name: str) -> bool:
        return await self._run(self.core.unpin(checked_id(name)))

    async def pins(self) -> dict[str, Request]:
        return await self._run(self.core.pins())

    async def _run(self, flow: Flow):
        steps = Steps(flow)
        async for _ in self._drive(steps, None):
            raise AssertionError("this flow delivers no events")
        return steps.value

    async def _drive(self, steps: Steps, pubsub) -> AsyncIterator[Event]:
        operation = steps.next()
        while operation is not None:
            if isinstance(operation, Deliver):
                for event in operation.events:
                    yield event
                operation = steps.next()
                continue
            try:
                reply = await self._perform(operation, pubsub)
            except redis.RedisError as error:
                operation = steps.next(error=flow_error(error))
            else:
                operation = steps.next(reply)

    async def _perform(self, operation: Operation, pubsub):
        if isinstance(operation, Call):
            return await queued(self.redis, operation).execute(raise_on_error=operation.raise_on_error)
        if isinstance(operation, Subscribe):
            return await pubsub.subscribe(operation.channel)
        if isinstance(operation, Pause):
            return await asyncio.sleep(operation.seconds)
        try:
            return await pubsub.get_message(ignore_subscribe_messages=not operation.subscribe_messages,
                                            timeout=operation.timeout)
        except redis.ConnectionError:
            return None  # see producer.core.Listen


class AsyncHandle:
    def __init__(self, producer: AsyncProducer, request_id: str, lane: Lane | None = None,
                 duplicate: bool = False) -> None:
        self.producer = producer
        self.id = request_id
        self.lane = lane
        self.duplicate = duplicate

    def __repr__(self) -> str:
        return f"AsyncHandle(id={self.id!r}, lane={self.lane!r}, duplicate={self.duplicate})"

    async def cancel(self) -> None:
        await self.producer.cancel(self.id)

    async def result(self, timeout: float | None = None) -> Completion:
        return Completion.from_events(self.id, [event async for event in self.stream(timeout)])

    async def stream(self, timeout: float | None = None) -> AsyncIterator[Event]:
        pubsub = self.producer._listener.pubsub()
        try:
            async for event in self.producer._drive(Steps(self.producer.core.stream(self.id, timeout)), pubsub):
                yield event
        finally:
            await pubsub.aclose()
