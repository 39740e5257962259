"""Events of one request in order, each exactly once, from reads of its replay stream.

A consumer reads the replay stream again and again (producer/core.py); a read may repeat what
an earlier one delivered, and a stream that lost events (trimmed, expired) has a hole that no
later read fills. The sequencer releases events strictly by `seq`, each once, and says when a
hole shows. It is pure, so the subtle half of streaming is tested without Redis.
"""

from __future__ import annotations

from producer.errors import EventsLost
from producer.protocol import TERMINAL, Event


class EventSequencer:
    def __init__(self, request_id: str = "?") -> None:
        self.request_id = request_id
        self.next_seq = 0
        self.finished = False  # a terminal event was released: nothing follows it
        self._early: dict[int, Event] = {}  # arrived before the seq they wait for

    @property
    def has_gap(self) -> bool:
        """Events are held back behind a missing seq."""
        return bool(self._early)

    def push(self, event: Event) -> list[Event]:
        """Take one event; return those now due, in seq order."""
        if self.finished or event.seq < self.next_seq:
            return []  # released already (or after the end): a duplicate
        # The first copy of a seq wins; a stale worker's later copy is dropped with it.
        self._early.setdefault(event.seq, event)
        ready = []
        while self.next_seq in self._early:
            released = self._early.pop(self.next_seq)
            ready.append(released)
            self.next_seq += 1
            if isinstance(released, TERMINAL):
                self.finished = True
                self._early.clear()  # what came early, past the end, is never released
        return ready

    def push_replayed(self, events: list[Event]) -> list[Event]:
        """Take the events of one replay-stream read, in stream order.

        A worker appends seq k only after seq k-1 is in the stream (it wrote it, or read
        it when it resumed the request), so a read that still leaves an event held back
        shows a hole in the stream itself: those events were trimmed or expired and no
        later read can bring them back."""
        ready = [released for event in events for released in self.push(event)]
        if any(event.seq in self._early for event in events):
            raise EventsLost(f"events {self.next_seq}..{min(self._early) - 1} of request "
                             f"{self.request_id} are gone from its replay stream "
                             "(trimmed or expired)")
        return ready
