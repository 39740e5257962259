"""Lane streams -> requests to start: one pass of read, decode, claim, and ack or dead-letter
(`take`, or `admit` for entries reclaimed by housekeeping), behind one call; the consumer group,
a read that takes only what the engine can admit soon, acks and dead letters.

Backpressure rule: read nothing while free KV blocks are under the scheduler's watermark
(a full pool admits nobody), otherwise read until `intake_ahead` requests wait in the
engine. Everything beyond stays in Redis, where idle workers' blocking reads pick it up.
Every entry read is claimed at once and in the engine by the end of the step it came during
(step_intake.py): nothing is held in Redis's pending list that the worker does not keep fresh
(claims.py), or a peer would reclaim it from a live worker.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Container, Iterable, Mapping
from dataclasses import dataclass, field

from producer.connect import is_cluster
from producer.protocol import GROUP, LANES, ErrorEvent, Keys, Lane, Request, ensure_group
from worker.claims import Claim, Claims
from worker.engine.engine import Engine
from worker.entries import Entry, Rejected, decode_entry, read_entries
from worker.fair_intake import IntakeShares
from worker.flight import engine_id
from worker.metrics import Metrics
from worker.nudges import Nudges
from worker.tenants import LaneStreams

DEAD_LETTERS_MAXLEN = 100_000  # approximate: a flood of garbage must not grow Redis without bound
DEAD_LETTER_ENTRY_BYTES = 4096  # of each dead entry, kept for whoever looks into why it died


def intake_room(engine: Engine, ahead: int) -> int:
    """How many requests to take now (the backpressure rule above)."""
    pool, scheduler = engine.pool, engine.scheduler
    if scheduler.running and pool.num_free_blocks < scheduler.config.watermark * pool.num_blocks:
        return 0
    return max(0, ahead - scheduler.num_waiting)


def waiting_tenants(engine: Engine) -> dict[Lane, set[str]]:
    """The tenants with a request waiting in the engine, by lane: the others are probed even when
    the room is spent (IntakeShares.counts)."""
    return {lane: set(queue.tenants()) for lane, queue in engine.scheduler.waiting.items()}


@dataclass(frozen=True)
class Admission:
    """A request to start: the entry that carried it, what that decoded to (a Rejected one starts
    only to end with its error event), and its claim."""

    name: str  # the engine's id (flight.engine_id)
    request_id: str
    entry: Entry
    request: Request | Rejected
    claim: Claim
    claimed: float = field(default_factory=time.monotonic)  # when its claim answered


class Intake:
    def __init__(self, client, blocking, keys: Keys, streams: LaneStreams, consumer: str, replay_ttl: int,
                 claims: Claims, metrics: Metrics, log) -> None:
        """`blocking` is a connection whose reply timeout allows for the BLOCK reads' wait (on one
        node; on a cluster the client itself, the step's blocking reads having connections of their
        own: cluster_reads.py)."""
        self.client, self.blocking, self.keys, self.consumer = client, blocking, keys, consumer
        self.streams, self.replay_ttl = streams, replay_ttl
        self.claims, self.metrics, self.log = claims, metrics, log
        self.cluster = is_cluster(client)
        self.nudges = Nudges(client) if self.cluster else None  # the producers' enqueue nudges (nudges.py)
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
            self.nudges.set_channels([stream.keys.enqueued(stream.lane, stream.shard)
                                      for stream in self.streams.by_name.values()])

    def take(self, room: int, block_ms: int | None, held: Mapping[str, Entry],
             in_engine: Container[str], waiting: Mapping[Lane, Container[str]] | None = None,
             blocked: Container[str] = ()) -> list[Admission]:
        """One pass: read (`read`), then `admit` what came."""
        return self.admit(self.read(room, block_ms, waiting, blocked), held, in_engine)

    def admit(self, entries: list[Entry], held: Mapping[str, Entry], in_engine: Container[str]) -> list[Admission]:
        """-> the requests among `entries` to start, claimed; each one's tenant is its stream's. The
        rest is settled here: an entry with no usable id, or a second one for an id in progress or
        owned by another entry, is dead-lettered; a repeat of a finished request is acked (its
        result stands); one whose keys cannot be resumed from is dead-lettered with its consumers
        told why. Left alone (pending, for a later reclaim): our own entry reclaimed by ourselves
        after a slow turn (`held`: the entry of each request held, by engine id), and one whose
        dropped attempt has yet to leave the engine (`in_engine`, by engine id)."""
        accepted: dict[str, tuple[str, Entry, Request | Rejected]] = {}  # by engine id
        dead: list[tuple[Entry, str, str | None]] = []
        for entry in entries:
            request = decode_entry(entry)
            request_id = request.id if isinstance(request, Request) else request.request_id
            if request_id is None:
                dead.append((entry, request.reason, None))
                continue
            name = engine_id(self.streams[entry.stream].tenant, request_id)
            ours = held.get(name)
            if ours is not None and (ours.stream, ours.entry_id) == (entry.stream, entry.entry_id):
                continue  # our own entry, reclaimed by ourselves after a slow turn: still ours
            elif ours is not None or name in accepted:
                dead.append((entry, "duplicate: a request with this id is in progress", request_id))
            elif name in in_engine:
                continue  # a dropped attempt has yet to leave the engine: left pending for a later reclaim
            else:
                accepted[name] = (request_id, entry, request)
        if dead:
            self.dead_letter(dead)
        admitted = []
        claims = self.claims.claim([(request_id, entry) for request_id, entry, _ in accepted.values()])
        for (name, (request_id, entry, request)), claim in zip(accepted.items(), claims):
            stream = self.streams[entry.stream]
            fence = stream.keys.attempt(request_id)
            if claim.taken and claim.terminal is not None:  # a repeat of a finished request: its result stands
                self.ack([entry])
            elif claim.taken:  # another entry owns the id: refused here, the owner untouched
                self.dead_letter([(entry, "duplicate: this id belongs to another entry of the tenant", request_id)])
            elif claim.problem:
                self.claims.reject(stream.keys, request_id, stream.lane, claim.problem)  # ends its consumers' streams
                self.dead_letter([(entry, claim.problem, request_id)], fences=[fence])
            elif isinstance(claim.terminal, ErrorEvent):  # refused on an earlier attempt, whose ack was lost
                self.dead_letter([(entry, claim.terminal.message, request_id)], fences=[fence])
            elif claim.terminal is not None:  # finished on an earlier attempt, whose ack was lost
                self.ack([entry], fences=[fence])
            else:
                admitted.append(Admission(name, request_id, entry, request, claim))
        return admitted

    def dead_letter(self, dead: list[tuple[Entry, str, str | None]], fences: Iterable[str] = ()) -> None:
        """Dead-letter entries that get no event here (no usable id, no way to number one, their id
        another entry's, or their error event written already); `fences`: the attempt keys of the
        requests among them that this worker claimed."""
        for entry, reason, request_id in dead:
            self.log.warning("entry.rejected", tenant=self.streams[entry.stream].tenant, entry_id=entry.entry_id,
                             request_id=request_id, reason=reason)
        self.ack((), dead, fences)
        self.metrics.dead_letters.inc(len(dead))

    def read(self, room: int, block_ms: int | None = None,
             waiting: Mapping[Lane, Container[str]] | None = None, blocked: Container[str] = ()) -> list[Entry]:
        """About `room` new entries per lane, fast lanes first, each tenant asked for its weighted
        share (fair_intake.py); with no room, one entry of each tenant with nothing `waiting` in
        the engine in that lane (none: no read), so that a quiet tenant's request reaches the
        scheduler's fair order while a flood's fill the engine's queue: one XREADGROUP per stream
        read, all in one pipeline (on a cluster a
        round trip per node, since an XREADGROUP reads one slot's streams). With `block_ms` (only
        when the engine is idle: the wait would stall running requests) on one node, one read of
        every stream that waits that long for the first entry, taking up to a share of each; on a
        cluster, where no read blocks across nodes, an idle worker that finds nothing waits up to
        block_ms for a producer's enqueue nudge (nudges.py) and reads again at once if one came: so
        it polls at most 1000 / block_ms times a second (once with the defaults) while nothing comes.
        `blocked`: streams that a blocking read of this worker waits on (step_intake.py), left
        unread: Redis hands a new entry to a blocked reader, so such a stream has none to give (the
        pass counts it as read and found empty)."""
        if self.nudges is not None and block_ms is None:
            self.nudges.stop()  # work to do: no nudges while there is
        if room <= 0:
            return self._read_shares(0, waiting, blocked) if waiting is not None else []
        if block_ms is not None and not self.cluster:
            names = self.streams.names
            return read_entries(self.blocking.xreadgroup(GROUP, self.consumer, dict.fromkeys(names, ">"),
                                                          count=read_count(room, len(names)), block=block_ms))
        entries = self._read_shares(room, blocked=blocked)
        if entries or block_ms is None:
            return entries
        if self.nudges.follow():  # subscribed just now: what came before it is found by reading again
            entries = self._read_shares(room)
        if not entries and self.nudges.wait(block_ms / 1000):
            entries = self._read_shares(room)
        return entries

    def _read_shares(self, room: int, waiting: Mapping[Lane, Container[str]] | None = None,
                     blocked: Container[str] = ()) -> list[Entry]:
        pipe = self.client.pipeline(transaction=False)
        asked = []  # (lane, the tenants' counts, each read's tenant) in the pipeline's order
        for lane in LANES:
            streams = self.streams.of_lane(lane)
            counts = self.shares[lane].counts(list(streams), room, waiting[lane] if waiting is not None else ())
            readers = []
            for tenant, names in streams.items():
                if tenant not in counts:
                    continue
                for name in names:  # its shards share its count
                    if name in blocked:
                        continue
                    pipe.xreadgroup(GROUP, self.consumer, {name: ">"}, count=read_count(counts[tenant], len(names)))
                    readers.append(tenant)
            asked.append((lane, counts, readers))
        if not any(readers for _, _, readers in asked):
            return []
        replies = iter(pipe.execute())
        entries: list[Entry] = []
        for lane, counts, readers in asked:
            got = Counter()
            for tenant in readers:
                read = read_entries(next(replies))
                got[tenant] += len(read)
                entries += read
            self.shares[lane].took(counts, got)
        return entries

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


def read_count(room: int, streams: int) -> int:
    """COUNT for each of `streams` read at once, so that together they bring about `room`."""
    return max(1, -(-room // max(streams, 1)))
