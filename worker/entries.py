"""What a lane stream's entry carries: the entry as read or reclaimed, what it decodes to (a request,
or why not, with its id when one can be read), and a request's prompt as the engine takes it.
Decoding is strict (msgspec, typed): a bad entry never crashes a worker."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from producer.protocol import FIELD, MAX_ENTRY_BYTES, REQUEST_ID, Request, decode_request


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


def read_entries(reply) -> list[Entry]:
    """An XREADGROUP's reply (as redis-py parses it) -> its entries."""
    return [Entry(stream.decode(), entry_id.decode(), fields)
            for stream, messages in reply or [] for entry_id, fields in messages]


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
