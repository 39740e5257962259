"""What the producer does, once, for both clients: submit, cancel, stats, stream and the pinned
prefixes as sans-IO flows. A flow is a generator that yields what it needs done (`Call`: one pipelined
round trip of Redis commands; `Subscribe` / `Listen`: pub/sub; `Pause`; `Deliver`: events for
the consumer) and is sent the reply; Redis errors are thrown into it, a lost connection as
`Disconnected`. producer/client.py runs the flows on redis-py, producer/async_client.py on
redis.asyncio: only the awaits differ.

A stream rides out a lost connection (a Redis restart): it retries, backing off (`Reconnect`),
until its timeout, or for RECONNECT_PATIENCE_S without one, then raises Disconnected; a server
that takes that long to confirm its subscription counts as lost too. Submit, cancel and
stats raise Disconnected at once. Submit retries by itself for SUBMIT_PATIENCE_S, knowing its
own claim by a token, so it never enqueues twice; after it gives up, submitting the same
request id again is the safe retry (it waits for a claim left mid-way to lapse, then takes it).

How a stream misses nothing: SUBSCRIBE to the request's channel and wait for the server's
confirmation, and only then read the replay stream from the start: every event written after
the confirmation is announced on the channel, every one before it is in the replay stream (the
worker writes both in one script). Then, at each message on the channel, and whenever the
channel is quiet for `poll_interval` (a publish lost in a reconnect), read the replay stream
again from the last entry read. Events are taken from the replay stream only, which only the
request's current owner can write (the fence, worker/outbox.py): a message on the channel is a
nudge whose content is never read, so a PUBLISH by anyone else (who may publish there) can
neither forge an event nor end the stream.

How a stream always ends: each replay read also reads the request's submission key
(`Keys.submitted`, see `Submission`), and `SubmissionWatch` turns what the two say into an end:
a terminal event; or, promptly, UnknownRequest (never submitted, never enqueued, expired) or
EventsLost (its events are gone, or a worker dead-lettered it because they were damaged).
The submission key lives while the request waits and, once a worker has finished it,
exactly as long as its replay stream (the worker sets both TTLs in one script).
"""

from __future__ import annotations

import math
import time
import uuid
import zlib
from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any

import msgspec

from producer import protocol
from producer.errors import (Disconnected, EventsLost, NotPermitted, ProtocolViolation, QueueFull,
                             UnknownRequest)
from producer.protocol import (ENQUEUE_TTL_S, FIELD, GROUP, LANES, MAX_SHARDS, Event, Keys, Request, Submission,
                               TenantSettings, decode_event, decode_request, decode_settings, decode_submission,
                               encode)
from producer.sequencer import EventSequencer
from producer.stats import LaneStats, QueueStats, parse_heartbeat
from producer.submission import choose_lane, encoded

RECONNECT_PATIENCE_S = 60.0
SUBMIT_PATIENCE_S = 10.0
SETTINGS_REFRESH_S = 5.0  # how long a producer keeps its tenant's settings before reading them again
ENQUEUE_POLL_S = 0.2  # how often a submit of an id that another submit is enqueueing looks again
# A flow's wait before it tries a lost connection again, doubling while it stays lost.
RECONNECT_RETRY_S, MAX_RECONNECT_RETRY_S = 0.1, 2.0


@dataclass(frozen=True)
class Command:
    name: str  # a redis-py client method
    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)


def command(name: str, *args, **kwargs) -> Command:
    return Command(name, args, kwargs)


@dataclass(frozen=True)
class Call:
    """One round trip: the commands as one pipeline; the reply is their results in order,
    errors in place (as exceptions) when `raise_on_error` is False. `replicated`: on a cluster, the
    round trip also waits until the node of the first command's key has sent the writes to a
    replica (WAIT, up to REPLICATION_WAIT_MS), so that a failover cannot lose them once a write on
    another node depends on them."""

    commands: tuple[Command, ...]
    transaction: bool = False
    raise_on_error: bool = True
    replicated: bool = False


@dataclass(frozen=True)
class Subscribe:
    channel: str
    fresh: bool = False  # on a new connection: the one it went on did not confirm within a reply's time


@dataclass(frozen=True)
class Listen:
    """The next pub/sub message within `timeout` s, or None; a lost connection, or the server
    ending the subscription (on a cluster, when the channel's slot moves to another node), is
    thrown in as Disconnected (the stream subscribes again, and the replay read that follows
    recovers what was published meanwhile)."""

    timeout: float
    subscribe_messages: bool = False  # True only while waiting for the subscription's confirmation


@dataclass(frozen=True)
class Pause:
    seconds: float


@dataclass(frozen=True)
class Deliver:
    events: list[Event]


Operation = Call | Subscribe | Listen | Pause | Deliver
Flow = Generator[Operation, Any, Any]


class Steps:
    """A flow as a client runs it: `next(reply)` or `next(error=...)` after performing an
    operation (and plain `next()` after a Deliver) gives the next one; None once the flow
    has ended, its return value then in `value`."""

    def __init__(self, flow: Flow) -> None:
        self.flow, self.value = flow, None

    def next(self, reply: Any = None, error: Exception | None = None) -> Operation | None:
        try:
            return self.flow.send(reply) if error is None else self.flow.throw(error)
        except StopIteration as end:
            self.value = end.value
            return None


class ProducerCore:
    def __init__(self, keys: Keys, max_backlog: int, claim_ttl: int, poll_interval: float,
                 cluster: bool = False) -> None:
        """`cluster`: on Redis Cluster, where no MULTI spans two hash tags (producer/connect.py)."""
        self.keys, self.max_backlog = keys, max_backlog
        self.claim_ttl, self.poll_interval = claim_ttl, poll_interval
        self.cluster = cluster
        self.tenant_settings = (float("-inf"), TenantSettings())  # (read at, the registry's Keys.settings)

    def submit(self, request: Request) -> Flow:
        """-> (lane, duplicate). Takes the id (SET NX, short-lived, with this call's token),
        checks the backlog, then enqueues and marks the id queued in one MULTI. Refused with
        QueueFull, it frees the id. A MULTI runs whole or not at all, so after a lost connection
        the claim tells whether it ran: the next round finds it queued by us (done), still ours
        (enqueue again) or lapsed (take it again). A request that cannot be encoded is refused
        (InvalidRequest) before anything reaches Redis."""
        entry = encoded(request)
        lane = choose_lane(request)
        settings = yield from self.settings(SUBMIT_PATIENCE_S)
        shards, limit = settings.shards, min(self.max_backlog, settings.max_backlog)
        shard = shard_of(request.id, shards)
        stream = self.keys.requests(lane, shard)
        max_backlog = -(-limit // shards)  # the lane's limit, shared by its shards
        claim, token = self.keys.submitted(request.id), uuid.uuid4().hex
        gives_up_at = time.monotonic() + SUBMIT_PATIENCE_S
        while True:
            earlier, backlog = yield from _patiently(Call((
                command("set", claim, encode(Submission(lane, "enqueuing", by=token)), nx=True, get=True,
                        ex=ENQUEUE_TTL_S),
                command("xlen", stream))), Deadline(None, request.id), patience_s=SUBMIT_PATIENCE_S)
            held = None if earlier is None else _submission(earlier, claim)
            if held is not None and held.by != token:
                if held.state == "enqueuing":  # another submit of this id, mid-way: it enqueues, or its claim lapses
                    yield Pause(ENQUEUE_POLL_S)
                    continue
                return held.lane, True
            if held is not None and held.state == "queued":
                return lane, False  # our enqueue went through; only its reply was lost
            if backlog >= max_backlog:
                yield Call((command("delete", claim),))
                raise QueueFull(lane, backlog * shards, limit)
            try:
                yield from self._enqueue(stream, entry, claim, Submission(lane, by=token),
                                         self.keys.enqueued(lane, shard))
                return lane, False
            except Disconnected:
                if time.monotonic() >= gives_up_at:
                    raise

    def _enqueue(self, stream: str, entry: bytes, claim: str, queued: Submission, nudge: str) -> Flow:
        """The entry, and the id marked queued: one MULTI on one node. On a cluster the stream and the
        id's keys are in two slots, so the entry goes first (on a replica too, before the mark: a
        failover of the stream's node must not leave an id marked queued without its entry), then
        the mark, then a nudge for idle workers (they cannot block on streams of several nodes;
        `nudge`: the stream's channel, Keys.enqueued): a
        submit cut short after the entry enqueues it again, and the worker refuses the second entry
        as a duplicate of the id (design.md, rule 2)."""
        if not self.cluster:
            yield Call((command("xadd", stream, {FIELD: entry}),
                        command("set", claim, encode(queued), xx=True, ex=self.claim_ttl)), transaction=True)
            return
        yield Call((command("xadd", stream, {FIELD: entry}),), replicated=True)
        yield Call((command("set", claim, encode(queued), xx=True, ex=self.claim_ttl),))
        yield Call((command("spublish", nudge, b""),))

    def settings(self, patience_s: float) -> Flow:
        """-> the tenant's TenantSettings (Keys.settings), read again once SETTINGS_REFRESH_S old,
        trying again for `patience_s` while the connection is lost. Missing or unreadable (a tenant
        not registered, or a user from before settings) they are the defaults: one shard, shard 0
        always served, and the producer's own backlog limit."""
        read_at, settings = self.tenant_settings
        if time.monotonic() - read_at >= SETTINGS_REFRESH_S:
            [value] = yield from _patiently(Call((command("get", self.keys.settings),), raise_on_error=False),
                                            Deadline(None, "settings"), patience_s)
            settings = _settings(value)
            self.tenant_settings = (time.monotonic(), settings)
        return settings

    def cancel(self, request_id: str) -> Flow:
        """A durable flag (checked by the worker every step) plus a nudge on the channel: one MULTI,
        or on a cluster the flag first (the nudge only says when to look)."""
        flag = command("set", self.keys.cancelled(request_id), b"1", ex=self.claim_ttl)
        nudge = command("publish", self.keys.cancel_channel, request_id)
        if self.cluster:
            yield Call((flag,))
            yield Call((nudge,))
        else:
            yield Call((flag, nudge), transaction=True)

    def stats(self) -> Flow:
        """-> QueueStats: each lane's backlog and pending entries over the tenant's shards."""
        shards = (yield from self.settings(patience_s=0)).shards  # one try: an unreachable Redis is said at once
        lanes = {}
        for lane in LANES:
            streams = [self.keys.requests(lane, shard) for shard in range(shards)]
            replies = yield Call(tuple(command(name, stream, *([GROUP] if name == "xpending" else []))
                                       for stream in streams for name in ("xlen", "xpending")), raise_on_error=False)
            lanes[lane] = LaneStats(backlog=sum(_reply(backlog) for backlog in replies[::2]),
                                    pending=sum(0 if isinstance(pending, Exception) else pending["pending"]
                                                for pending in replies[1::2]))
        try:
            workers = yield from self.workers()
            [dead_letters] = yield Call((command("xlen", self.keys.dead_letters),))
        except NotPermitted:  # a tenant's user sees its own lanes only
            workers = dead_letters = None
        return QueueStats(lanes, workers, dead_letters=dead_letters)

    def workers(self) -> Flow:
        """-> the live workers (their heartbeats): shared keys, which an operator or a gateway reads."""
        # SCAN, not KEYS: never block the server for the sake of a dashboard.
        names, cursor = [], 0
        while True:
            [(cursor, batch)] = yield Call((command("scan", cursor, match=self.keys.workers_pattern, count=100),))
            names += batch
            if not (any(cursor.values()) if isinstance(cursor, dict) else cursor):  # a cluster's: per node
                break
        names = sorted({name for name in names if _is_utf8(name)})  # not one of ours: skipped, the rest shown
        kinds = (yield Call(tuple(command("type", name) for name in names))) if names else []
        heartbeats = [(name, kind) for name, kind in zip(names, kinds) if kind in (b"hash", b"string")]
        values = (yield Call(tuple(command("hgetall" if kind == b"hash" else "get", name)
                                   for name, kind in heartbeats))) if heartbeats else []
        return [parse_heartbeat(name.decode(), value) for (name, _), value in zip(heartbeats, values)
                if value]  # an empty value: the heartbeat expired between the two reads

    def pin(self, prefix: Request) -> Flow:
        """Publish a prefix for every worker to keep pinned, named by the request's id (Keys.pins);
        a name pinned again gets the new prefix."""
        entry = encoded(prefix)
        yield Call((command("hset", self.keys.pins, prefix.id, entry),))

    def unpin(self, name: str) -> Flow:
        """-> whether a prefix of that name was published."""
        [removed] = yield Call((command("hdel", self.keys.pins, name),))
        return bool(removed)

    def pins(self) -> Flow:
        """-> name -> the published prefix (a Request), by name."""
        [published] = yield Call((command("hgetall", self.keys.pins),))
        return {name.decode(): _pinned(value, name.decode()) for name, value in sorted(published.items())}

    def stream(self, request_id: str, timeout: float | None) -> Flow:
        """Every event of the request in seq order, each once, ending with the terminal one.
        Raises TimeoutError if it has not ended within `timeout` s, UnknownRequest or
        EventsLost as `SubmissionWatch` says."""
        clock = Deadline(timeout, request_id)
        sequencer = EventSequencer(request_id)
        keys = self.keys
        replay, channel, claim, cursor = keys.replay(request_id), keys.tokens(request_id), keys.submitted(request_id), "-"
        yield from self._subscribe(channel, clock)
        watch, listening = SubmissionWatch(request_id), Reconnect(clock)
        while True:
            entries, replay_exists, submission = yield from self._read(request_id, cursor, clock)
            # First: a request dead-lettered for its damaged replay stream ends here, whatever it holds.
            watch.check(_readable(submission, claim), bool(replay_exists), events_seen=cursor != "-")
            if _readable(entries, replay):
                cursor = entries[-1][0].decode()
                ready = sequencer.push_replayed([_decoded(fields.get(FIELD), replay) for _, fields in entries])
                if ready:
                    yield Deliver(ready)
                if sequencer.finished:
                    return
            # Wait for a nudge, a quiet spell or a lost subscription: each sends us back to the replay.
            try:
                message = yield Listen(clock.wait(self.poll_interval))
                while message is not None:  # the nudges queued meanwhile: one replay read covers them all
                    message = yield Listen(0)
            except Disconnected as error:
                # A new connection, or on a cluster another node (a failover, the channel's slot
                # moved): subscribed again, confirmed, and only then the replay read (no gap).
                yield from listening.lost(error)
                yield from self._subscribe(channel, clock)
            else:
                listening.reached()

    def events(self, request_id: str) -> Flow:
        """-> the request's events so far, in seq order, each once (what `stream` would have
        delivered by now), without waiting. Raises UnknownRequest or EventsLost as `stream` does."""
        replay, claim = self.keys.replay(request_id), self.keys.submitted(request_id)
        entries, replay_exists, submission = yield from self._read(request_id, "-", Deadline(None, request_id))
        SubmissionWatch(request_id).check(_readable(submission, claim), bool(replay_exists), events_seen=False)
        return EventSequencer(request_id).push_replayed([_decoded(fields.get(FIELD), replay)
                                                         for _, fields in _readable(entries, replay)])

    def _read(self, request_id: str, cursor: str, clock: Deadline) -> Flow:
        """-> (the replay stream's entries after `cursor`, whether it exists, the submission key),
        read in one round trip, with errors as values (raise_on_error=False)."""
        replay = self.keys.replay(request_id)
        return (yield from _patiently(Call((
            command("xrange", replay, min=cursor if cursor == "-" else f"({cursor}"),
            command("exists", replay), command("get", self.keys.submitted(request_id))), raise_on_error=False), clock))

    def _subscribe(self, channel: str, clock: Deadline) -> Flow:
        """SUBSCRIBE, and wait for the server's confirmation: through lost connections (each
        SUBSCRIBE again, backing off), for at most RECONNECT_PATIENCE_S (or the clock's time). A
        confirmation later than a reply may be (REPLY_TIMEOUT_S) means a silent connection (a
        half-open one, that nothing else would notice): SUBSCRIBE again, on a new one."""
        reconnect, confirm_by = Reconnect(clock), time.monotonic() + RECONNECT_PATIENCE_S
        subscribed = fresh = False
        while True:
            try:
                if not subscribed:
                    reply_by = math.inf  # a SUBSCRIBE that fails is no silence
                    yield Subscribe(channel, fresh)
                    subscribed, reply_by = True, time.monotonic() + protocol.REPLY_TIMEOUT_S
                if _is_subscribe((yield Listen(clock.wait(self.poll_interval), subscribe_messages=True))):
                    return
                if time.monotonic() >= reply_by:
                    raise Disconnected(f"redis did not confirm the subscription to {channel} "
                                       f"within {protocol.REPLY_TIMEOUT_S:g} s")
            except Disconnected as error:
                subscribed, fresh = False, time.monotonic() >= reply_by
                yield from reconnect.lost(error)
                continue
            if clock.end is None and time.monotonic() >= confirm_by:
                raise Disconnected(f"redis did not confirm the subscription to {channel} "
                                   f"within {RECONNECT_PATIENCE_S:.0f} s")


class SubmissionWatch:
    """Whether a stream that has not ended yet can still end with events; raises if not.
    Fed, at each replay read, the submission key's value and whether the replay stream
    exists; remembers having seen the id still being enqueued."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.seen_enqueuing = False

    def check(self, submission: bytes | None, replay_exists: bool, events_seen: bool) -> None:
        state = _submission(submission, self.request_id) if submission is not None else None
        if state is not None and state.state == "rejected":
            raise EventsLost(f"request {self.request_id} was dead-lettered: {state.reason}")
        if state is not None:
            self.seen_enqueuing = self.seen_enqueuing or state.state == "enqueuing"
            return  # waiting, enqueuing, or running: events will come
        if replay_exists:
            return  # running (or finished), and its submission key outlived by a long run
        if events_seen:
            raise EventsLost(f"the events of request {self.request_id} are gone from Redis before it finished "
                             "(expired, or lost with Redis's data)")
        if self.seen_enqueuing:
            raise UnknownRequest(f"request {self.request_id!r} was never enqueued: "
                                 "its producer stopped between taking the id and enqueueing it")
        raise UnknownRequest(f"no request {self.request_id!r}: never submitted, or expired")


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


class Reconnect:
    """A flow's waits while its connection is lost: RECONNECT_RETRY_S between tries, doubling up
    to MAX_RECONNECT_RETRY_S; it gives up, raising the error, once the connection has been lost
    for `patience_s`, or when the clock's time is up (TimeoutError) if it has an end."""

    def __init__(self, clock: Deadline, patience_s: float | None = None) -> None:
        self.clock = clock
        self.patience_s = RECONNECT_PATIENCE_S if patience_s is None else patience_s
        self.delay, self.gives_up_at = RECONNECT_RETRY_S, None

    def lost(self, error: Disconnected) -> Flow:
        """After a try that failed: raise `error` if patience ran out, else pause before the next."""
        if self.clock.end is None:
            self.gives_up_at = self.gives_up_at or time.monotonic() + self.patience_s
            if time.monotonic() >= self.gives_up_at:
                raise error
        yield Pause(self.clock.wait(self.delay))
        self.delay = min(MAX_RECONNECT_RETRY_S, self.delay * 2)

    def reached(self) -> None:
        """A try went through: the next loss starts afresh."""
        self.delay, self.gives_up_at = RECONNECT_RETRY_S, None


def _patiently(operation: Call | Subscribe, clock: Deadline, patience_s: float | None = None) -> Flow:
    """The reply of an operation that is safe to repeat, trying again while the connection is lost
    (see Reconnect)."""
    reconnect = Reconnect(clock, patience_s)
    while True:
        try:
            return (yield operation)
        except Disconnected as error:
            yield from reconnect.lost(error)


def shard_of(request_id: str, shards: int) -> int:
    """The intake shard of a request: by its id's hash, the same in every producer."""
    return zlib.crc32(request_id.encode()) % shards


def _settings(value) -> TenantSettings:
    try:
        settings = decode_settings(value)
    except (TypeError, msgspec.DecodeError):  # missing, or an error in its place (NOPERM)
        return TenantSettings()
    return settings if 1 <= settings.shards <= MAX_SHARDS and settings.max_backlog >= 1 else TenantSettings()


def _reply(value):
    if isinstance(value, Exception):
        raise value
    return value


def _readable(value, key: str):
    """A reply read with raise_on_error=False; an error there means the key holds something else."""
    if isinstance(value, Exception):
        raise ProtocolViolation(f"{key} is unreadable: {value}")
    return value


def _is_utf8(name: bytes) -> bool:
    try:
        name.decode()
    except UnicodeDecodeError:
        return False
    return True


def _is_subscribe(message: dict | None) -> bool:
    return message is not None and message["type"] in ("subscribe", "ssubscribe")


def _submission(data: bytes, where: str) -> Submission:
    try:
        return decode_submission(data)
    except msgspec.DecodeError as error:
        raise ProtocolViolation(f"undecodable submission of {where}: {error}") from None


def _pinned(data: bytes, name: str) -> Request:
    try:
        return decode_request(data)
    except msgspec.DecodeError as error:
        raise ProtocolViolation(f"undecodable pin {name!r}: {error}") from None


def _decoded(data: bytes | None, where: str) -> Event:
    try:
        return decode_event(data)
    except (msgspec.DecodeError, TypeError) as error:
        raise ProtocolViolation(f"undecodable event on {where}: {error}") from None
