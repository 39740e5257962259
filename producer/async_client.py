"""AsyncProducer: the Producer's API on redis.asyncio, for asyncio services.

Same Redis traffic and the same stream algorithm as producer/client.py (read its
docstring); the decisions themselves (validation, lane, ordering, folding, heartbeat
parsing) live in the pure modules both share, so only the awaits differ here."""

from __future__ import annotations

from collections.abc import AsyncIterator

import redis
import redis.asyncio

from producer.client import DEFAULT_URL, Deadline, decode_event_from, is_subscribe
from producer.completion import Completion
from producer.errors import QueueFull, UnknownRequest
from producer.protocol import FIELD, GROUP, LANES, Event, Keys, Lane, Message, Request, SamplingParams, encode
from producer.sequencer import EventSequencer
from producer.stats import LaneStats, QueueStats, parse_heartbeat
from producer.submission import build_request, checked_id, choose_lane


class AsyncProducer:
    def __init__(self, url: str = DEFAULT_URL, *, prefix: str = "sb", max_backlog: int = 10_000,
                 replay_ttl: float = 3600, poll_interval: float = 1.0) -> None:
        self.keys = Keys(prefix)
        self.max_backlog = max_backlog
        self.replay_ttl = int(replay_ttl)
        self.poll_interval = poll_interval
        self.redis = redis.asyncio.Redis.from_url(url)
        self._listener = redis.asyncio.Redis.from_url(url, socket_timeout=None)  # see Producer
        self._grouped: set[str] = set()

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
        lane = choose_lane(request)
        stream = self.keys.requests(lane)
        await self._ensure_group(stream)
        claim = self.keys.submitted(request.id)
        pipe = self.redis.pipeline(transaction=False)
        pipe.set(claim, lane, nx=True, get=True, ex=self.replay_ttl)
        pipe.xlen(stream)
        earlier_lane, backlog = await pipe.execute()
        if earlier_lane is not None:
            return AsyncHandle(self, request.id, earlier_lane.decode(), duplicate=True)
        try:
            if backlog >= self.max_backlog:
                raise QueueFull(lane, backlog, self.max_backlog)
            await self.redis.xadd(stream, {FIELD: encode(request)})
        except BaseException:
            await self.redis.delete(claim)
            raise
        return AsyncHandle(self, request.id, lane)

    async def cancel(self, request_id: str) -> None:
        checked_id(request_id)
        pipe = self.redis.pipeline(transaction=True)
        pipe.set(self.keys.cancelled(request_id), b"1", ex=self.replay_ttl)
        pipe.publish(self.keys.cancel_channel, request_id)
        await pipe.execute()

    def stream(self, request_id: str, timeout: float | None = None) -> AsyncIterator[Event]:
        return AsyncHandle(self, checked_id(request_id)).stream(timeout)

    async def result(self, request_id: str, timeout: float | None = None) -> Completion:
        return await AsyncHandle(self, checked_id(request_id)).result(timeout)

    async def stats(self) -> QueueStats:
        lanes = {}
        for lane in LANES:
            stream = self.keys.requests(lane)
            try:
                pending = (await self.redis.xpending(stream, GROUP))["pending"]
            except redis.ResponseError:
                pending = 0
            lanes[lane] = LaneStats(backlog=await self.redis.xlen(stream), pending=pending)
        workers = []
        async for name in self.redis.scan_iter(match=self.keys.workers_pattern, count=100):
            kind = await self.redis.type(name)
            if kind in (b"hash", b"string"):
                value = await (self.redis.hgetall(name) if kind == b"hash" else self.redis.get(name))
                if value:  # empty: expired between the two reads
                    workers.append(parse_heartbeat(name.decode(), value))
        workers.sort(key=lambda worker: worker.name)
        return QueueStats(lanes, workers, dead_letters=await self.redis.xlen(self.keys.dead_letters))

    async def _ensure_group(self, stream: str) -> None:
        if stream not in self._grouped:
            try:
                await self.redis.xgroup_create(stream, GROUP, id="0", mkstream=True)
            except redis.ResponseError as error:
                if "BUSYGROUP" not in str(error):
                    raise
            self._grouped.add(stream)


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
        producer, keys = self.producer, self.producer.keys
        clock = Deadline(timeout, self.id)
        sequencer = EventSequencer(self.id)
        replay, channel, cursor = keys.replay(self.id), keys.tokens(self.id), "-"
        pubsub = producer._listener.pubsub()
        try:
            await pubsub.subscribe(channel)
            while not is_subscribe(await pubsub.get_message(timeout=clock.wait(producer.poll_interval))):
                pass
            while True:
                entries = await producer.redis.xrange(replay, min=cursor if cursor == "-" else f"({cursor}")
                if cursor == "-" and not entries and not await producer.redis.exists(keys.submitted(self.id)):
                    raise UnknownRequest(f"no request {self.id!r}: never submitted, or expired")
                if entries:
                    cursor = entries[-1][0].decode()
                replayed = [decode_event_from(fields.get(FIELD), replay) for _, fields in entries]
                for event in sequencer.push_replayed(replayed):
                    yield event
                if sequencer.finished:
                    return
                while (message := await _next_message(pubsub, clock.wait(producer.poll_interval))) is not None:
                    for event in sequencer.push(decode_event_from(message["data"], channel)):
                        yield event
                    if sequencer.finished:
                        return
                    if sequencer.has_gap:
                        break
        finally:
            await pubsub.aclose()


async def _next_message(pubsub, wait: float) -> dict | None:
    """As in producer/client.py: a dropped connection reads as a quiet spell."""
    try:
        return await pubsub.get_message(ignore_subscribe_messages=True, timeout=wait)
    except redis.ConnectionError:
        return None
