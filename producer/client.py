"""Producer: submit requests to the lane streams, follow their events, cancel them.

How a stream misses nothing: SUBSCRIBE to the request's channel first and wait for the
server's confirmation, and only then read the replay stream from the start: every event
published after the confirmation reaches us live, every one before it is in the replay
stream (the worker writes both in one MULTI). Then
follow the channel, letting EventSequencer drop what was seen and hold back what came
early; on a gap, and whenever the channel is quiet for `poll_interval` (a publish lost in
a reconnect), read the replay stream again from the last entry read.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import msgspec
import redis

from producer.completion import Completion
from producer.errors import ProtocolViolation, QueueFull, UnknownRequest
from producer.protocol import (FIELD, GROUP, LANES, Event, Keys, Lane, Message, Request, SamplingParams,
                               decode_event, encode)
from producer.sequencer import EventSequencer
from producer.stats import LaneStats, QueueStats, parse_heartbeat
from producer.submission import build_request, checked_id, choose_lane

DEFAULT_URL = "redis://localhost:6379/0"


class Producer:
    def __init__(self, url: str = DEFAULT_URL, *, prefix: str = "sb", max_backlog: int = 10_000,
                 replay_ttl: float = 3600, poll_interval: float = 1.0) -> None:
        """`max_backlog`: per lane, entries waiting or in flight before submit refuses.
        `replay_ttl`: seconds an id stays claimed and a cancel flag lives; keep it at
        least the worker's replay-stream TTL. `poll_interval`: how long the channel may
        stay quiet before a stream re-reads the replay stream."""
        self.keys = Keys(prefix)
        self.max_backlog = max_backlog
        self.replay_ttl = int(replay_ttl)
        self.poll_interval = poll_interval
        self.redis = redis.Redis.from_url(url)
        # A subscriber waits on its socket for as long as a stream lasts: no socket
        # timeout there (redis-py 8 defaults to 5 s and raises).
        self._listener = redis.Redis.from_url(url, socket_timeout=None)
        self._grouped: set[str] = set()

    def close(self) -> None:
        self.redis.close()
        self._listener.close()

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def submit(self, prompt: str | Request | None = None, *, messages: list[Message] | list[dict] | None = None,
               prompt_ids: list[int] | None = None, params: SamplingParams | dict | None = None,
               lane: Lane | None = None, request_id: str | None = None, deadline: float | None = None) -> Handle:
        """Validate, pick the lane, enqueue. `prompt` may also be a ready Request.
        Raises InvalidRequest (a ValueError) or QueueFull; submitting an id again
        returns a handle to the request already enqueued and enqueues nothing."""
        request = build_request(prompt, messages=messages, prompt_ids=prompt_ids, params=params,
                                lane=lane, request_id=request_id, deadline=deadline)
        lane = choose_lane(request)
        stream = self.keys.requests(lane)
        self._ensure_group(stream)
        claim = self.keys.submitted(request.id)
        pipe = self.redis.pipeline(transaction=False)
        pipe.set(claim, lane, nx=True, get=True, ex=self.replay_ttl)
        pipe.xlen(stream)
        earlier_lane, backlog = pipe.execute()
        if earlier_lane is not None:
            return Handle(self, request.id, earlier_lane.decode(), duplicate=True)
        try:
            if backlog >= self.max_backlog:
                raise QueueFull(lane, backlog, self.max_backlog)
            self.redis.xadd(stream, {FIELD: encode(request)})
        except BaseException:
            self.redis.delete(claim)  # not enqueued: the id is free to submit again
            raise
        return Handle(self, request.id, lane)

    def cancel(self, request_id: str) -> None:
        """A durable flag (checked by the worker every step) plus a nudge on the channel."""
        checked_id(request_id)
        pipe = self.redis.pipeline(transaction=True)
        pipe.set(self.keys.cancelled(request_id), b"1", ex=self.replay_ttl)
        pipe.publish(self.keys.cancel_channel, request_id)
        pipe.execute()

    def stream(self, request_id: str, timeout: float | None = None) -> Iterator[Event]:
        return Handle(self, checked_id(request_id)).stream(timeout)

    def result(self, request_id: str, timeout: float | None = None) -> Completion:
        return Handle(self, checked_id(request_id)).result(timeout)

    def stats(self) -> QueueStats:
        lanes = {}
        for lane in LANES:
            stream = self.keys.requests(lane)
            try:
                pending = self.redis.xpending(stream, GROUP)["pending"]
            except redis.ResponseError:  # no stream or no group yet: nothing pending
                pending = 0
            lanes[lane] = LaneStats(backlog=self.redis.xlen(stream), pending=pending)
        # SCAN, not KEYS: never block the server for the sake of a dashboard.
        names = sorted(self.redis.scan_iter(match=self.keys.workers_pattern, count=100))
        pipe = self.redis.pipeline(transaction=False)
        for name in names:
            pipe.type(name)
        heartbeats = [(name, kind) for name, kind in zip(names, pipe.execute() if names else [])
                      if kind in (b"hash", b"string")]
        for name, kind in heartbeats:
            if kind == b"hash":
                pipe.hgetall(name)
            else:
                pipe.get(name)
        values = pipe.execute() if heartbeats else []
        workers = [parse_heartbeat(name.decode(), value) for (name, _), value in zip(heartbeats, values)
                   if value]  # an empty value: the heartbeat expired between the two reads
        return QueueStats(lanes, workers, dead_letters=self.redis.xlen(self.keys.dead_letters))

    def _ensure_group(self, stream: str) -> None:
        """Create the workers' group (either side may be first) so that requests enqueued
        before any worker started are delivered too (group created at id 0)."""
        if stream not in self._grouped:
            try:
                self.redis.xgroup_create(stream, GROUP, id="0", mkstream=True)
            except redis.ResponseError as error:
                if "BUSYGROUP" not in str(error):
                    raise
            self._grouped.add(stream)


class Handle:
    """One request: follow its events, wait for its result, cancel it."""

    def __init__(self, producer: Producer, request_id: str, lane: Lane | None = None,
                 duplicate: bool = False) -> None:
        self.producer = producer
        self.id = request_id
        self.lane = lane  # the lane stream it was enqueued on (None: not known here)
        self.duplicate = duplicate  # True: an earlier submit of this id is the request

    def __repr__(self) -> str:
        return f"Handle(id={self.id!r}, lane={self.lane!r}, duplicate={self.duplicate})"

    def cancel(self) -> None:
        self.producer.cancel(self.id)

    def result(self, timeout: float | None = None) -> Completion:
        """Wait for the end. Raises TimeoutError after `timeout` seconds."""
        return Completion.from_events(self.id, list(self.stream(timeout)))

    def stream(self, timeout: float | None = None) -> Iterator[Event]:
        """Every event of the request in seq order, each once, ending with the terminal
        one. Raises TimeoutError if the request has not ended within `timeout` seconds,
        UnknownRequest for an id never submitted (or expired)."""
        producer, keys = self.producer, self.producer.keys
        clock = Deadline(timeout, self.id)
        sequencer = EventSequencer(self.id)
        replay, channel, cursor = keys.replay(self.id), keys.tokens(self.id), "-"
        pubsub = producer._listener.pubsub()
        try:
            pubsub.subscribe(channel)
            while not is_subscribe(pubsub.get_message(timeout=clock.wait(producer.poll_interval))):
                pass
            while True:
                entries = producer.redis.xrange(replay, min=cursor if cursor == "-" else f"({cursor}")
                if cursor == "-" and not entries and not producer.redis.exists(keys.submitted(self.id)):
                    raise UnknownRequest(f"no request {self.id!r}: never submitted, or expired")
                if entries:
                    cursor = entries[-1][0].decode()
                replayed = [decode_event_from(fields.get(FIELD), replay) for _, fields in entries]
                yield from sequencer.push_replayed(replayed)
                if sequencer.finished:
                    return
                # Follow the channel until a gap or a quiet spell sends us back to the replay.
                while (message := _next_message(pubsub, clock.wait(producer.poll_interval))) is not None:
                    yield from sequencer.push(decode_event_from(message["data"], channel))
                    if sequencer.finished:
                        return
                    if sequencer.has_gap:
                        break
        finally:
            pubsub.close()


class Deadline:
    """The time a stream may take, handed out as waits of at most one poll interval."""

    def __init__(self, timeout: float | None, request_id: str) -> None:
        self.timeout, self.request_id = timeout, request_id
        self.end = None if timeout is None else time.monotonic() + timeout

    def wait(self, interval: float) -> float:
        """How long the next wait may be; raises TimeoutError once the time is up."""
        if self.end is None:
            return interval
        left = self.end - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"request {self.request_id} did not finish within {self.timeout} s")
        return min(interval, left)


def _next_message(pubsub, wait: float) -> dict | None:
    """The next event message, or None after a quiet `wait`. A dropped connection gives
    None too: redis-py has reconnected and resubscribed by then, and the replay read that
    None leads to recovers what was published meanwhile."""
    try:
        return pubsub.get_message(ignore_subscribe_messages=True, timeout=wait)
    except redis.ConnectionError:
        return None


def is_subscribe(message: dict | None) -> bool:
    return message is not None and message["type"] == "subscribe"


def decode_event_from(data: bytes | None, where: str) -> Event:
    try:
        return decode_event(data)
    except (msgspec.DecodeError, TypeError) as error:
        raise ProtocolViolation(f"undecodable event on {where}: {error}") from None
