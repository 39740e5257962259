"""Owning stream entries across workers: claim, refresh, reclaim and hand back.

- claim (every entry, fresh or reclaimed): one script on the request's keys (one hash tag, so
  one slot) moves its attempt key on, which fences off any earlier owner (see outbox.py), and
  reads its replay stream in the same atomic step, so the earlier owner's last accepted write
  is in what we read: the tokens already emitted and the next seq. The attempt key holds
  "<attempt> <stream> <entry id>": the attempt counts up for that entry, and the key never
  expires while the entry is pending (the ack gives it the replay TTL), so an attempt never
  repeats for an entry while any writer may hold an old one. Ownership is bound to the entry:
  while the key names another entry, a claim changes nothing and answers attempt 0 (the id is
  taken: a second entry carrying it neither fences the first one's owner off nor writes into
  its stream); once the key has expired, the id is free for a new entry at attempt 1. The
  script also marks the id taken if its submission key is gone (it waited longer than the
  producer's claim TTL), so that consumers and a second submit find it while it runs.
- reject: a request whose keys are damaged (its replay stream cannot be resumed from) is
  dead-lettered without an event, since none could be numbered; its submission key says
  "rejected" with the reason instead, which ends its consumers' streams.
- refresh (every heartbeat): one script per lane stream XCLAIMs, with JUSTID (idle time reset,
  delivery count untouched), each of our in-flight entries that the group still counts as
  ours; an entry another worker took, or whose attempt key moved on, is reported lost instead,
  and never taken back from its new owner. One pending under nobody (its stream or group was
  deleted and made again) is kept: no one else holds it, and should it be delivered again, the
  new holder's claim moves the attempt key on, which the next refresh (or write) finds.
- take back: entries the group counts as ours that we no longer hold (we dropped them when a
  turn failed, a Redis blip say) are owned again at once, with XPENDING + XCLAIM ... JUSTID,
  which leaves their delivery counts alone: a blip costs a recompute, never a delivery. Our
  consumer name is new with every process start (heartbeat.new_consumer), so this only ever
  takes back what this process was given.
- inherit (at start): entries held by this worker's earlier lives (consumers of the same
  worker name: it was restarted, under compose with the same hostname) died with them, so
  they are taken at once, each counted as a delivery.
- reclaim: XAUTOCLAIM entries idle past the threshold (a dead worker's), carrying the cursor
  between calls; their delivery counts come from XPENDING. So a delivery count says how many
  holders were given the request, each past the first because the one before it died.
- sweep: consumers of the group with no heartbeat naming them and no entries are deleted, and
  dead letters older than their retention trimmed.
- hand back (shutdown): the refresh's script with IDLE <large>, so that the next reclaim of any
  live worker takes them at once (Redis before 8.8 has no XNACK).
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass

import msgspec
import redis

from producer.connect import UNREACHABLE
from producer.protocol import FIELD, GROUP, TERMINAL, Event, Keys, Lane, Submission, TokenEvent, decode_event, encode
from worker.entries import Entry
from worker.flight import Flight
from worker.heartbeat import beating, worker_of
from worker.scripts import Batch, Script
from worker.tenants import LaneStreams

HAND_BACK_IDLE_MS = 2**31  # about 25 days: past any reclaim threshold

CLAIM = """
-- KEYS: attempt key, replay stream, cancel key, submission key.
-- ARGV: owner ("<stream> <entry id>"), the submission to set if the key is gone, its TTL.
-- -> {attempt (0: another entry owns the id), the replay stream, whether cancelled}
local current = redis.call('GET', KEYS[1])
local attempt = 1
if current then
  local space = string.find(current, ' ', 1, true)
  if not space or string.sub(current, space + 1) ~= ARGV[1] then
    return {0, redis.call('XRANGE', KEYS[2], '-', '+'), redis.call('EXISTS', KEYS[3])}
  end
  attempt = (tonumber(string.sub(current, 1, space - 1)) or 0) + 1
end
redis.call('SET', KEYS[1], attempt .. ' ' .. ARGV[1])
redis.call('SET', KEYS[4], ARGV[2], 'NX', 'EX', ARGV[3])
return {attempt, redis.call('XRANGE', KEYS[2], '-', '+'), redis.call('EXISTS', KEYS[3])}
"""

KEEP = """
-- KEYS: a lane stream. ARGV: group, consumer, idle ms ('' to reset it), entry id...
-- XCLAIM ... JUSTID each entry still pending under this consumer; -> the ids pending under another.
local lost = {}
for i = 4, #ARGV do
  local pending = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if pending[1] and pending[1][2] == ARGV[2] then
    if ARGV[3] == '' then
      redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
    else
      redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'IDLE', ARGV[3], 'JUSTID')
    end
  elseif pending[1] then
    lost[#lost + 1] = ARGV[i]
  end
end
return lost
"""


@dataclass(frozen=True)
class Claim:
    attempt: int  # 0: the id belongs to another entry, and nothing was claimed
    events: list[Event] | None  # what earlier attempts wrote; None when unreadable
    cancelled: bool
    damage: str | None = None  # a Redis error on one of the request's keys

    @property
    def taken(self) -> bool:
        """Another entry owns the id (design.md, rule 2)."""
        return self.attempt == 0 and self.damage is None

    @property
    def problem(self) -> str | None:
        """Why the request cannot be resumed from its replay stream, if it cannot."""
        if self.damage is not None:
            return f"its keys are damaged: {self.damage}"
        if self.events is None:
            return "replay stream holds an undecodable event"
        if [event.seq for event in self.events] != list(range(len(self.events))):
            return "replay stream is missing events (trimmed or expired)"
        return None

    @property
    def terminal(self) -> Event | None:
        """The terminal event an earlier attempt wrote, if it finished."""
        last = self.events[-1] if self.events else None
        return last if isinstance(last, TERMINAL) else None

    @property
    def emitted_token_ids(self) -> list[int]:
        return [token for event in self.events or () if isinstance(event, TokenEvent) for token in event.ids]


class Claims:
    def __init__(self, client: redis.Redis, keys: Keys, streams: LaneStreams, consumer: str, replay_ttl: int,
                 reclaim_idle_ms: int) -> None:
        self.client, self.keys, self.streams, self.consumer = client, keys, streams, consumer
        self.replay_ttl, self.reclaim_idle_ms = replay_ttl, reclaim_idle_ms
        self.cursors: dict[str, str] = {}  # XAUTOCLAIM's, per stream
        self.claim_script = Script(client, CLAIM)
        self.keep_script = Script(client, KEEP)

    def claim(self, requests: list[tuple[str, Entry]]) -> list[Claim]:
        """Claim each request ((id, the entry that carried it)), in order."""
        if not requests:
            return []
        batch = Batch(self.client)
        for request_id, entry in requests:
            keys, lane = self.streams[entry.stream].keys, self.streams[entry.stream].lane
            batch.run(self.claim_script, (keys.attempt(request_id), keys.replay(request_id),
                                          keys.cancelled(request_id), keys.submitted(request_id)),
                      (entry.owner, encode(Submission(lane)), self.replay_ttl))
        claims = []
        for reply in batch.execute(raise_on_error=False):  # one request's damaged keys must not fail the rest
            if isinstance(reply, UNREACHABLE):  # not the keys' fault: the turn fails, the claim is made again
                raise reply
            if isinstance(reply, Exception):
                claims.append(Claim(0, None, False, damage=str(reply)))
            else:
                attempt, replay, cancelled = reply
                claims.append(Claim(attempt, _decode_events(replay), bool(cancelled)))
        return claims

    def reject(self, keys: Keys, request_id: str, lane: Lane, reason: str) -> None:
        self.client.set(keys.submitted(request_id), encode(Submission(lane, "rejected", reason)), ex=self.replay_ttl)

    def refresh(self, flights: list[Flight]) -> list[Flight]:
        """Keep our entries from looking idle; -> the flights another worker holds now."""
        if not flights:
            return []
        batch = Batch(self.client)
        for flight in flights:
            batch.pipe.get(flight.keys.attempt(flight.request_id))
        by_stream = self._queue_keep(batch, [flight.entry for flight in flights])
        replies = batch.execute()
        fences, kept = replies[:len(flights)], replies[len(flights):]
        lost = {(stream, entry_id.decode()) for stream, ids in zip(by_stream, kept) for entry_id in ids}
        return [flight for flight, value in zip(flights, fences)
                if value is None or value.decode(errors="replace") != flight.fence
                or (flight.entry.stream, flight.entry.entry_id) in lost]

    def reclaim(self, room: int) -> list[Entry]:
        """Up to `room` entries left idle past the threshold (by a dead worker), fast lane first."""
        claimed: list[Entry] = []
        for stream in self.streams.names:
            if len(claimed) >= room:
                break
            self.cursors[stream], messages, *_ = self.client.xautoclaim(
                stream, GROUP, self.consumer, self.reclaim_idle_ms, start_id=self.cursors.get(stream, "0-0"),
                count=room - len(claimed))
            claimed += self._counted(stream, messages)
        return claimed

    def inherit(self) -> list[Entry]:
        """Every entry held by an earlier life of this worker (see the module docstring)."""
        inherited: list[Entry] = []
        worker = worker_of(self.consumer)
        for stream in self.streams.names:
            for consumer in self.client.xinfo_consumers(stream, GROUP):
                name = _text(consumer["name"])
                if name == self.consumer or worker_of(name) != worker or not consumer["pending"]:
                    continue
                pending = self.client.xpending_range(stream, GROUP, "-", "+", consumer["pending"], consumername=name)
                pipe = self.client.pipeline(transaction=False)
                for entry in pending:  # min-idle = the idle seen: an entry a peer took meanwhile stays its
                    pipe.xclaim(stream, GROUP, self.consumer, entry["time_since_delivered"], [entry["message_id"]])
                inherited += self._counted(stream, [message for claimed in pipe.execute() for message in claimed])
        return inherited

    def _counted(self, stream: str, messages: list) -> list[Entry]:
        """Entries just claimed with their delivery counts raised, with those counts (XPENDING)."""
        messages = [(entry_id, fields) for entry_id, fields in messages if fields is not None]  # XDELed
        pipe = self.client.pipeline(transaction=False)
        for entry_id, _ in messages:
            pipe.xpending_range(stream, GROUP, min=entry_id, max=entry_id, count=1)
        return [Entry(stream, entry_id.decode(), fields, pending[0]["times_delivered"] if pending else 1)
                for (entry_id, fields), pending in zip(messages, pipe.execute() if messages else [])]

    def take_back(self, held: set[tuple[str, str]], room: int) -> list[Entry]:
        """Up to `room` of our own pending entries that are not in `held` ((stream, entry id))."""
        taken: list[Entry] = []
        for stream in self.streams.names:
            if len(taken) >= room:
                break
            pending = [entry for entry in self.client.xpending_range(stream, GROUP, "-", "+", len(held) + room,
                                                                     consumername=self.consumer)
                       if (stream, entry["message_id"].decode()) not in held][:room - len(taken)]
            if not pending:
                continue
            pipe = self.client.pipeline(transaction=False)
            for entry in pending:  # min-idle = the idle seen: an entry another worker took meanwhile stays its
                pipe.xclaim(stream, GROUP, self.consumer, entry["time_since_delivered"], [entry["message_id"]],
                            justid=True)
                pipe.xrange(stream, entry["message_id"], entry["message_id"])
            replies = pipe.execute()
            for entry, claimed, found in zip(pending, replies[::2], replies[1::2]):
                if claimed and found:  # an entry deleted under us (XDEL) has nothing to serve
                    [(entry_id, fields)] = found
                    taken.append(Entry(stream, entry_id.decode(), fields, entry["times_delivered"]))
        return taken

    def sweep(self, dead_letter_ttl_s: int) -> list[str]:
        """Delete dead consumers, trim old dead letters; -> the consumers deleted."""
        deleted = []
        for stream in self.streams.names:
            idle = [_text(consumer["name"]) for consumer in self.client.xinfo_consumers(stream, GROUP)
                    if consumer["pending"] == 0 and consumer["idle"] > self.reclaim_idle_ms]
            alive = beating(self.client, self.keys, idle) | {self.consumer}
            for name in idle:
                if name not in alive:
                    self.client.xgroup_delconsumer(stream, GROUP, name)
                    deleted.append(name)
        oldest_kept_ms = int(time.time() * 1000) - dead_letter_ttl_s * 1000
        self.client.xtrim(self.keys.dead_letters, minid=f"{oldest_kept_ms}-0", approximate=True)
        return deleted

    def hand_back(self, entries: list[Entry]) -> None:
        if entries:
            batch = Batch(self.client)
            self._queue_keep(batch, entries, idle=HAND_BACK_IDLE_MS)
            batch.execute()

    def _queue_keep(self, batch: Batch, entries: list[Entry], idle: int | None = None) -> list[str]:
        """Queue the KEEP script for these entries, one call per stream; -> the streams, in order."""
        by_stream: dict[str, list[str]] = defaultdict(list)
        for entry in entries:
            by_stream[entry.stream].append(entry.entry_id)
        for stream, entry_ids in by_stream.items():
            batch.run(self.keep_script, (stream,), (GROUP, self.consumer, "" if idle is None else idle, *entry_ids))
        return list(by_stream)

    def retire(self) -> None:
        """Leave the group on a clean exit; a consumer still holding entries stays, since
        deleting it would drop them from the pending list."""
        for stream in self.streams.names:
            if not self.client.xpending_range(stream, GROUP, "-", "+", 1, consumername=self.consumer):
                self.client.xgroup_delconsumer(stream, GROUP, self.consumer)


def _text(name: str | bytes) -> str:
    return name.decode() if isinstance(name, bytes) else name


def _decode_events(replay: list) -> list[Event] | None:
    """The replay stream as the claim script read it: [[entry id, [field, value, ...]], ...]."""
    try:
        return [decode_event(dict(zip(fields[::2], fields[1::2]))[FIELD]) for _, fields in replay]
    except (KeyError, TypeError, msgspec.DecodeError):
        return None
