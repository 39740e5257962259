"""What the producer raises. Callers catch `ProducerError` for all of them; a refused
request is also a `ValueError`, so code that validates input catches it the usual way."""

from __future__ import annotations


class ProducerError(Exception):
    """Base of every error the producer raises on purpose."""


class InvalidRequest(ProducerError, ValueError):
    """The request was refused before anything reached Redis."""


class QueueFull(ProducerError):
    """The lane's backlog is at its limit: retry later, or add workers."""

    def __init__(self, lane: str, backlog: int, limit: int) -> None:
        super().__init__(f"the {lane} lane is full: {backlog} requests waiting or running "
                         f"(limit {limit}); retry later or add workers")
        self.lane, self.backlog, self.limit = lane, backlog, limit


class UnknownRequest(ProducerError, LookupError):
    """No request with this id was submitted, or its keys have expired."""


class EventsLost(ProducerError):
    """Events of a request are gone from its replay stream (trimmed or expired), so the
    stream cannot be delivered complete and in order."""


class Disconnected(ProducerError, ConnectionError):
    """Redis could not be reached (a stream gives up after trying for a while)."""


class NotPermitted(ProducerError, PermissionError):
    """This Redis user may not do that (NOPERM): the ACL roles give a tenant's producer its own
    keys only (README, Security)."""


class ProtocolViolation(ProducerError):
    """Something on Redis does not decode as the wire contract says."""
