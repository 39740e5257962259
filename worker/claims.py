"""Owning stream entries across workers: claim, refresh, reclaim and hand back.

- claim (every entry, fresh or reclaimed): INCR the request's attempt key, which fences off
  any earlier owner (see outbox.py), THEN read its replay stream, so the earlier owner's
  last accepted write is in what we read: the tokens already emitted and the next seq. It
  also marks the id taken if its submission key is gone (it waited longer than the producer's
  claim TTL), so that consumers and a second submit find it while it runs.
- reject: a request whose keys are damaged (its replay stream cannot be resumed from) is
  dead-lettered without an event, since none could be numbered; its submission key says
  "rejected" with the reason instead, which ends its consumers' streams.
- refresh (every heartbeat): XCLAIM our in-flight entries to ourselves with min-idle 0 and
  JUSTID, which resets their idle time without raising the delivery count. An entry whose
  attempt key moved on belongs to another worker now and is reported lost instead.
- take back: entries the group counts as ours that we no longer hold (we dropped them when a
  turn failed, a Redis blip say) are owned again at once, with XPENDING + XCLAIM ... JUSTID,
  which leaves their delivery counts alone: a blip costs a recompute, never a delivery.
- reclaim: XAUTOCLAIM entries idle past the threshold (a dead worker's), carrying the cursor
  between calls; their delivery counts come from XPENDING. So a delivery count says how many
  workers were given the request, each past the first because its holder looked dead.
- sweep: consumers of the group with no heartbeat and no entries are deleted (names are
  host-pid, so every restart adds one), and dead letters older than their retention trimmed.
- hand back (shutdown): XCLAIM ... IDLE <large> JUSTID, so that the next reclaim of any live
  worker takes them at once (Redis before 8.8 has no XNACK).
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass

import msgspec
import redis

from producer.protocol import (FIELD, GROUP, LANES, TERMINAL, Event, Keys, Lane, Submission, TokenEvent, decode_event,
                               encode)
from worker.flight import Flight
from worker.intake import Entry

HAND_BACK_IDLE_MS = 2**31  # about 25 days: past any reclaim threshold


@dataclass(frozen=True)
class Claim:
    attempt: int
    events: list[Event] | None  # what earlier attempts wrote; None when unreadable
    cancelled: bool
    damage: str | None = None  # a Redis error on one of the request's keys

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
    def terminal(self) -> bool:
        return bool(self.events) and isinstance(self.events[-1], TERMINAL)

    @property
    def emitted_token_ids(self) -> list[int]:
        return [token for event in self.events or () if isinstance(event, TokenEvent) for token in event.ids]


class Claims:
    def __init__(self, client: redis.Redis, keys: Keys, consumer: str, attempt_ttl: int,
                 reclaim_idle_ms: int) -> None:
        self.client, self.keys, self.consumer = client, keys, consumer
        self.attempt_ttl, self.reclaim_idle_ms = attempt_ttl, reclaim_idle_ms
        self.cursors = {keys.requests(lane): "0-0" for lane in LANES}  # fast lane first

    def claim(self, lanes: dict[str, Lane]) -> list[Claim]:
        """Claim each request (id -> the lane it came from), in order."""
        pipe = self.client.pipeline(transaction=False)
        for request_id, lane in lanes.items():
            pipe.incr(self.keys.attempt(request_id))
            pipe.expire(self.keys.attempt(request_id), self.attempt_ttl)
            pipe.xrange(self.keys.replay(request_id))
            pipe.exists(self.keys.cancelled(request_id))
            pipe.set(self.keys.submitted(request_id), encode(Submission(lane)), nx=True, ex=self.attempt_ttl)
        replies = pipe.execute(raise_on_error=False)  # one request's damaged keys must not fail the rest
        claims = []
        for at in range(0, len(replies), 5):  # 5 replies per request
            attempt, _, replay, cancelled, _ = replies[at:at + 5]
            damage = next((reply for reply in replies[at:at + 5] if isinstance(reply, Exception)), None)
            if damage is not None:
                claims.append(Claim(0, None, False, damage=str(damage)))
            else:
                claims.append(Claim(attempt, _decode_events(replay), bool(cancelled)))
        return claims

    def reject(self, request_id: str, lane: Lane, reason: str) -> None:
        self.client.set(self.keys.submitted(request_id), encode(Submission(lane, "rejected", reason)),
                        ex=self.attempt_ttl)

    def refresh(self, flights: list[Flight]) -> list[Flight]:
        """Keep our entries from looking idle; -> the flights another worker has claimed."""
        if not flights:
            return []
        pipe = self.client.pipeline(transaction=False)
        for flight in flights:
            pipe.getex(self.keys.attempt(flight.request_id), ex=self.attempt_ttl)
        kept, lost = [], []
        for flight, attempt in zip(flights, pipe.execute()):
            (kept if attempt is not None and int(attempt) == flight.attempt else lost).append(flight)
        self._xclaim([flight.entry for flight in kept])
        return lost

    def reclaim(self, room: int) -> list[Entry]:
        """Up to `room` entries left idle past the threshold (by a dead worker), fast lane first."""
        claimed: list[Entry] = []
        for stream, cursor in self.cursors.items():
            if len(claimed) >= room:
                break
            self.cursors[stream], messages, *_ = self.client.xautoclaim(
                stream, GROUP, self.consumer, self.reclaim_idle_ms, start_id=cursor, count=room - len(claimed))
            messages = [(entry_id, fields) for entry_id, fields in messages if fields is not None]  # XDELed
            pipe = self.client.pipeline(transaction=False)
            for entry_id, _ in messages:
                pipe.xpending_range(stream, GROUP, min=entry_id, max=entry_id, count=1)
            for (entry_id, fields), pending in zip(messages, pipe.execute()):
                deliveries = pending[0]["times_delivered"] if pending else 1
                claimed.append(Entry(stream, entry_id.decode(), fields, deliveries))
        return claimed

    def take_back(self, held: set[tuple[str, str]], room: int) -> list[Entry]:
        """Up to `room` of our own pending entries that are not in `held` ((stream, entry id))."""
        taken: list[Entry] = []
        for stream in self.cursors:
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
        for stream in self.cursors:
            idle = [consumer["name"] for consumer in self.client.xinfo_consumers(stream, GROUP)
                    if consumer["pending"] == 0 and consumer["idle"] > self.reclaim_idle_ms]
            alive = self.client.pipeline(transaction=False)
            for name in idle:
                alive.exists(self.keys.worker(_text(name)))
            for name, beating in zip(idle, alive.execute() if idle else []):
                if not beating and _text(name) != self.consumer:
                    self.client.xgroup_delconsumer(stream, GROUP, name)
                    deleted.append(_text(name))
        oldest_kept_ms = int(time.time() * 1000) - dead_letter_ttl_s * 1000
        self.client.xtrim(self.keys.dead_letters, minid=f"{oldest_kept_ms}-0", approximate=True)
        return deleted

    def hand_back(self, entries: list[Entry]) -> None:
        self._xclaim(entries, idle=HAND_BACK_IDLE_MS)

    def _xclaim(self, entries: list[Entry], idle: int | None = None) -> None:
        by_stream: dict[str, list[str]] = defaultdict(list)
        for entry in entries:
            by_stream[entry.stream].append(entry.entry_id)
        pipe = self.client.pipeline(transaction=False)
        for stream, entry_ids in by_stream.items():
            pipe.xclaim(stream, GROUP, self.consumer, 0, entry_ids, idle=idle, justid=True)
        pipe.execute()

    def retire(self) -> None:
        """Leave the group on a clean exit; a consumer still holding entries stays, since
        deleting it would drop them from the pending list."""
        for stream in self.cursors:
            if not self.client.xpending_range(stream, GROUP, "-", "+", 1, consumername=self.consumer):
                self.client.xgroup_delconsumer(stream, GROUP, self.consumer)


def _text(name: str | bytes) -> str:
    return name.decode() if isinstance(name, bytes) else name


def _decode_events(replay: list[tuple[bytes, dict[bytes, bytes]]]) -> list[Event] | None:
    try:
        return [decode_event(fields[FIELD]) for _, fields in replay]
    except (KeyError, msgspec.DecodeError):
        return None
