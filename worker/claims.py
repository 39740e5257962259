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
- reclaim: XAUTOCLAIM entries idle past the threshold (a dead worker's), carrying the cursor
  between calls; their delivery counts come from XPENDING.
- hand back (shutdown): XCLAIM ... IDLE <large> JUSTID, so that the next reclaim of any live
  worker takes them at once (Redis before 8.8 has no XNACK).
"""

from __future__ import annotations

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
        self._xclaim(kept)
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

    def hand_back(self, flights: list[Flight]) -> None:
        self._xclaim(flights, idle=HAND_BACK_IDLE_MS)

    def _xclaim(self, flights: list[Flight], idle: int | None = None) -> None:
        by_stream: dict[str, list[str]] = defaultdict(list)
        for flight in flights:
            by_stream[flight.entry.stream].append(flight.entry.entry_id)
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


def _decode_events(replay: list[tuple[bytes, dict[bytes, bytes]]]) -> list[Event] | None:
    try:
        return [decode_event(fields[FIELD]) for _, fields in replay]
    except (KeyError, msgspec.DecodeError):
        return None
