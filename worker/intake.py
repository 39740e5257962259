"""Lane streams -> requests: the consumer group, a read that takes only what the engine can
admit soon, strict decoding, acks and dead letters.

Backpressure rule: read nothing while free KV blocks are under the scheduler's watermark
(a full pool admits nobody), otherwise read until `intake_ahead` requests wait in the
engine. Everything beyond stays in Redis, where idle workers' blocking reads pick it up.
Every entry read is taken into the engine at once: nothing is held in Redis's pending list
that the worker does not keep fresh (claims.py), or a peer would reclaim it from a live worker.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgspec

from producer.connect import is_cluster
from producer.protocol import (FIELD, GROUP, LANES, MAX_ENTRY_BYTES, REQUEST_ID, Keys, Request, decode_request,
                               ensure_group)
from worker.engine.engine import Engine
from worker.fair_intake import IntakeShares
from worker.subscription import Subscription
from worker.tenants import LaneStreams

DEAD_LETTERS_MAXLEN = 100_000  # approximate: a flood of garbage must not grow Redis without bound
DEAD_LETTER_ENTRY_BYTES = 4096  # of each dead entry, kept for whoever looks into why it died


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
    if len(data) > MAX_ENTRY_BYTES:  # refused unread: its id, if usable, is found without decoding the rest
        return Rejected(f"invalid request: {len(data)} bytes, more than {MAX_ENTRY_BYTES}", usable_id(data))
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
    def __init__(self, client, blocking, keys: Keys, streams: LaneStreams, consumer: str, replay_ttl: int) -> None:
        """`blocking` is a connection whose reply timeout allows for the BLOCK reads' wait (on one
        node; on a cluster, where no read blocks, the client itself)."""
        self.client, self.blocking, self.keys, self.consumer = client, blocking, keys, consumer
        self.streams, self.replay_ttl = streams, replay_ttl
        self.cluster = is_cluster(client)
        self.enqueued = Subscription(client)  # on a cluster: the producers' nudges (Keys.enqueued)
        self.shares = {lane: IntakeShares() for lane in LANES}  # between tenants, per lane (fair_intake.py)

    def set_weights(self, weights: dict[str, float]) -> None:
        """The tenants' weights for the intake's shares (none: equal shares)."""
        for shares in self.shares.values():
            shares.weights = dict(weights)

    def ensure_groups(self, names: Iterable[str] | None = None) -> None:
        """The workers' group on these lane streams (by default every one served)."""
        for name in self.streams.names if names is None else names:
            ensure_group(self.client, name)
        if self.cluster:
            self.enqueued.add([stream.keys.enqueued for stream in self.streams.by_name.values()])

    def read(self, room: int, block_ms: int | None = None) -> list[Entry]:
        """About `room` new entries per lane, fast lanes first, each tenant asked for its weighted
        share (fair_intake.py): one XREADGROUP per stream, all in one pipeline (on a cluster a
        round trip per node, since an XREADGROUP reads one slot's streams). With `block_ms` (only
        when the engine is idle: the wait would stall running requests) on one node, one read of
        every stream that waits that long for the first entry, taking up to a share of each; on a
        cluster, where no read blocks across nodes, an idle worker that finds nothing waits up to
        block_ms for a producer's enqueue nudge and reads again at once if one came: so it polls at
        most 1000 / block_ms times a second (once with the defaults) while nothing comes."""
        if room <= 0:
            return []
        if block_ms is not None and not self.cluster:
            names = self.streams.names
            return self._entries(self.blocking.xreadgroup(GROUP, self.consumer, dict.fromkeys(names, ">"),
                                                          count=_share(room, len(names)), block=block_ms))
        entries = self._read_shares(room)
        if not entries and block_ms is not None and self.enqueued.messages(timeout=block_ms / 1000):
            return self._read_shares(room)
        return entries

    def _read_shares(self, room: int) -> list[Entry]:
        pipe = self.client.pipeline(transaction=False)
        asked = []  # (lane, the tenants' counts, each read's tenant) in the pipeline's order
        for lane in LANES:
            streams = self.streams.of_lane(lane)
            counts = self.shares[lane].counts(list(streams), room)
            readers = []
            for tenant, names in streams.items():
                for name in names:  # its shards share its count
                    pipe.xreadgroup(GROUP, self.consumer, {name: ">"}, count=_share(counts[tenant], len(names)))
                    readers.append(tenant)
            asked.append((lane, counts, readers))
        replies = iter(pipe.execute())
        entries: list[Entry] = []
        for lane, counts, readers in asked:
            got = Counter()
            for tenant in readers:
                read = self._entries(next(replies))
                got[tenant] += len(read)
                entries += read
            self.shares[lane].took(counts, got)
        return entries

    @staticmethod
    def _entries(reply) -> list[Entry]:
        return [Entry(stream.decode(), entry_id.decode(), fields)
                for stream, messages in reply or [] for entry_id, fields in messages]

    def ack(self, entries: Iterable[Entry], dead_letters: Iterable[tuple[Entry, str, str | None]] = (),
            fences: Iterable[str] = ()) -> None:
        """Done with these entries and with the dead letters (entry, reason, request id), which
        are recorded first: XACK and XDEL each, so that a lane stream's length is its backlog.
        `fences`: the attempt keys of the requests among them that this worker claimed (kept while
        their entries were pending), which now get the replay stream's TTL. One MULTI: a dead
        letter is never lost to an ack cut short, nor recorded twice. On a cluster, where these keys
        are on several nodes, the dead letters go first, in a round trip of their own: one cut short
        after them is recorded again when its entry is reclaimed, never lost."""
        pipe = self.client.pipeline(transaction=not self.cluster)
        entries = list(entries)
        dead_letters = list(dead_letters)
        for entry, reason, request_id in dead_letters:
            payload = entry.payload
            pipe.xadd(self.keys.dead_letters, {"tenant": self.streams[entry.stream].tenant, "id": request_id or "",
                                               "reason": reason[:DEAD_LETTER_ENTRY_BYTES],
                                               "entry": payload[:DEAD_LETTER_ENTRY_BYTES],
                                               "entry_bytes": len(payload), "stream": entry.stream,
                                               "entry_id": entry.entry_id},
                      maxlen=DEAD_LETTERS_MAXLEN, approximate=True)
            entries.append(entry)
        if self.cluster and dead_letters:
            pipe.execute()
        for entry in entries:
            pipe.xack(entry.stream, GROUP, entry.entry_id)
            pipe.xdel(entry.stream, entry.entry_id)
        for fence in fences:
            pipe.expire(fence, self.replay_ttl)
        pipe.execute()


def _share(room: int, streams: int) -> int:
    """COUNT for each of `streams` read at once, so that together they bring about `room`."""
    return max(1, -(-room // max(streams, 1)))
