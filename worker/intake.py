"""Lane streams -> requests: the consumer group, a read that takes only what the engine can
admit soon, strict decoding, acks and dead letters.

Backpressure rule: read nothing while free KV blocks are under the scheduler's watermark
(a full pool admits nobody), otherwise read until `intake_ahead` requests wait in the
engine. Everything beyond stays in Redis, where idle workers' blocking reads pick it up.
Every entry read is taken into the engine at once: nothing is held in Redis's pending list
that the worker does not keep fresh (claims.py), or a peer would reclaim it from a live worker.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgspec
import redis

from producer.protocol import FIELD, GROUP, LANES, REQUEST_ID, Keys, Request, decode_request, ensure_group
from worker.engine.engine import Engine

DEAD_LETTERS_MAXLEN = 100_000  # approximate: a flood of garbage must not grow Redis without bound


@dataclass(frozen=True)
class Entry:
    """One entry of a lane stream, as read or reclaimed."""

    stream: str
    entry_id: str
    fields: dict[bytes, bytes]
    deliveries: int = 1

    @property
    def owner(self) -> str:
        """The entry as the attempt key names its owner (claims.py)."""
        return f"{self.stream} {self.entry_id}"

    @property
    def payload(self) -> bytes:
        """The encoded request; the whole entry, re-encoded, when its one field is missing."""
        return self.fields[FIELD] if FIELD in self.fields else msgspec.msgpack.encode(self.fields)


@dataclass(frozen=True)
class Rejected:
    """An entry that is not a valid request; `request_id` when one could be read from it."""

    reason: str
    request_id: str | None


def decode_entry(entry: Entry) -> Request | Rejected:
    data = entry.fields.get(FIELD)
    if data is None:
        return Rejected(f"entry has no {FIELD.decode()!r} field", None)
    try:
        return decode_request(data)
    except (msgspec.DecodeError, RecursionError) as error:  # ValidationError included: types, ranges, id, lane
        return Rejected(f"invalid request: {error}", usable_id(data))


class _IdOnly(msgspec.Struct):
    """A request's id alone: decoding skips the other fields, whatever is wrong with them."""

    id: Any = None


def usable_id(data: bytes) -> str | None:
    """The id of an entry that failed strict decoding, if it is a map with a well-formed id."""
    try:
        request_id = msgspec.msgpack.decode(data, type=_IdOnly).id
    except (msgspec.DecodeError, RecursionError):  # garbage, or nesting deep enough to exhaust the stack
        return None
    return request_id if isinstance(request_id, str) and REQUEST_ID.fullmatch(request_id) else None


def engine_prompt(request: Request) -> dict[str, Any]:
    """The request's one prompt, as `Engine.add_request` takes it."""
    if request.prompt is not None:
        return {"prompt": request.prompt}
    if request.messages is not None:
        return {"messages": [msgspec.structs.asdict(message) for message in request.messages]}
    return {"prompt_ids": request.prompt_ids}


def intake_room(engine: Engine, ahead: int) -> int:
    """How many requests to take now (the backpressure rule above)."""
    pool, scheduler = engine.pool, engine.scheduler
    if scheduler.running and pool.num_free_blocks < scheduler.config.watermark * pool.num_blocks:
        return 0
    return max(0, ahead - scheduler.num_waiting)


class Intake:
    def __init__(self, client: redis.Redis, blocking: redis.Redis, keys: Keys, consumer: str,
                 replay_ttl: int) -> None:
        """`blocking` is a connection whose reply timeout allows for the BLOCK reads' wait."""
        self.client, self.blocking, self.keys, self.consumer = client, blocking, keys, consumer
        self.replay_ttl = replay_ttl
        self.streams = [keys.requests(lane) for lane in LANES]  # fast lane first

    def ensure_groups(self) -> None:
        for stream in self.streams:
            ensure_group(self.client, stream)

    def read(self, room: int, block_ms: int | None = None) -> list[Entry]:
        """About `room` new entries, fast lane first. With `block_ms`, wait that long for the
        first one (only when the engine is idle: the wait would stall running requests); COUNT
        applies per stream, so that read may take up to `room` of each lane."""
        if room <= 0:
            return []
        if block_ms is not None:
            return self._entries(self.blocking.xreadgroup(GROUP, self.consumer, dict.fromkeys(self.streams, ">"),
                                                          count=room, block=block_ms))
        entries: list[Entry] = []
        for stream in self.streams:
            if len(entries) < room:
                entries += self._entries(self.client.xreadgroup(GROUP, self.consumer, {stream: ">"},
                                                                count=room - len(entries)))
        return entries

    @staticmethod
    def _entries(reply) -> list[Entry]:
        return [Entry(stream.decode(), entry_id.decode(), fields)
                for stream, messages in reply or [] for entry_id, fields in messages]

    def ack(self, entries: Iterable[Entry], dead_letters: Iterable[tuple[Entry, str, str | None]] = (),
            claimed: Iterable[str] = ()) -> None:
        """Done with these entries and with the dead letters (entry, reason, request id), which
        are recorded first: XACK and XDEL each, so that a lane stream's length is its backlog.
        `claimed`: the ids among them that this worker claimed, whose attempt keys (kept while
        their entries were pending) now get the replay stream's TTL. One MULTI: a dead letter
        is never lost to an ack cut short, nor recorded twice."""
        pipe = self.client.pipeline(transaction=True)
        entries = list(entries)
        for entry, reason, request_id in dead_letters:
            pipe.xadd(self.keys.dead_letters, {"id": request_id or "", "reason": reason, "entry": entry.payload,
                                               "stream": entry.stream, "entry_id": entry.entry_id},
                      maxlen=DEAD_LETTERS_MAXLEN, approximate=True)
            entries.append(entry)
        for entry in entries:
            pipe.xack(entry.stream, GROUP, entry.entry_id)
            pipe.xdel(entry.stream, entry.entry_id)
        for request_id in claimed:
            pipe.expire(self.keys.attempt(request_id), self.replay_ttl)
        pipe.execute()
