"""A request this worker owns, from claim to ack: its stream entry, its attempt, how far
its events got, and what the metrics need to know about it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from structlog.typing import BindableLogger

from producer.protocol import Keys
from worker.engine.sequence import Sequence
from worker.entries import Entry


def engine_id(tenant: str, request_id: str) -> str:
    """A request's name in the engine and in the worker's tables: ids are unique per tenant only."""
    return f"{tenant}/{request_id}"


@dataclass(eq=False)
class Flight:
    request_id: str
    keys: Keys  # its tenant's: the tenant of the stream its entry came from
    entry: Entry
    attempt: int  # this worker's attempt of the entry; writes of any other are refused (fencing)
    next_seq: int  # seq of the next event; continues an earlier attempt's numbering
    log: BindableLogger  # a structlog logger with tenant and request_id bound
    resumed: bool = False  # an earlier attempt already emitted tokens
    deadline: float | None = None  # unix seconds; watched only until the request starts
    sequence: Sequence | None = None  # the engine's; None for a request refused before the engine
    received: float = field(default_factory=time.monotonic)
    last_token: float | None = None
    pending: list[bytes] = field(default_factory=list)  # encoded events not yet written
    finished: bool = False  # its terminal event is pending or written
    dead_letter: str | None = None  # reason, recorded in the dead-letter stream at the ack

    @property
    def name(self) -> str:
        return engine_id(self.keys.tenant, self.request_id)

    @property
    def fence(self) -> str:
        """The attempt key's value while this flight owns the request (claims.py)."""
        return f"{self.attempt} {self.entry.owner}"

    @property
    def started(self) -> bool:
        return self.resumed or (self.sequence is not None and self.sequence.first_scheduled_time is not None)
