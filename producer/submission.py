"""From `submit()`'s arguments to a validated Request and its lane: everything the
producer decides before it touches Redis, kept pure."""

from __future__ import annotations

import math
import re
import time
from typing import Any

import msgspec

from producer.errors import InvalidRequest
from producer.protocol import (MAX_ENTRY_BYTES, Lane, Message, Request, SamplingParams, check_request_id,
                               decode_request, encode, pick_lane)

# The producer has no tokenizer, so it estimates. BPE tokenizers average about 4 bytes of
# English per token; dividing by 3 over-estimates, so a prompt near the fast lane's limit
# goes to the normal lane rather than crowding the fast one. The estimate only picks the
# stream a request waits in: the worker applies the rule again with real token counts.
BYTES_PER_TOKEN = 3
MESSAGE_OVERHEAD_TOKENS = 8  # role markers and separators a chat template adds per message

_MSGSPEC_PATH = re.compile(r"(.*) - at `\$\.?(.*)`", re.DOTALL)
INT_MIN, INT_MAX = -2**63, 2**64 - 1  # what a msgpack integer holds


def build_request(
    prompt: str | Request | None = None,
    *,
    messages: list[Message] | list[dict] | None = None,
    prompt_ids: list[int] | None = None,
    params: SamplingParams | dict | None = None,
    lane: Lane | None = None,
    request_id: str | None = None,
    deadline: float | None = None,
) -> Request:
    """Validate strictly (types, ranges, id, lane) and return the Request to enqueue.
    Raises InvalidRequest with a message that names the offending field."""
    if isinstance(prompt, Request):
        given = [name for name, value in (("messages", messages), ("prompt_ids", prompt_ids),
                 ("params", params), ("lane", lane), ("request_id", request_id),
                 ("deadline", deadline)) if value is not None]
        if given:
            raise InvalidRequest(f"invalid request: pass a ready Request alone, not with {given}")
        data = encoded(prompt)
        request = _strict(lambda: decode_request(data))
    else:
        fields: dict[str, Any] = {"prompt": prompt, "messages": messages, "prompt_ids": prompt_ids,
                                  "params": params, "lane": lane, "id": request_id,
                                  "deadline": deadline}
        built = _strict(lambda: msgspec.convert(
            {name: value for name, value in fields.items() if value is not None}, Request))
        data = encoded(built)  # what validates but cannot go on the wire is refused here too
        request = _strict(lambda: decode_request(data))  # and what the worker's decoding would refuse
    if request.prompt == "" or request.messages == [] or request.prompt_ids == []:
        raise InvalidRequest("invalid request: the prompt is empty")
    if request.deadline is not None and request.deadline <= time.time():
        raise InvalidRequest(f"invalid request: deadline {request.deadline} is in the past "
                             "(it is unix seconds, e.g. time.time() + 30)")
    return request


def encoded(request: Request) -> bytes:
    """The request as it goes on the wire. Refuses with InvalidRequest, naming the field, what
    passes validation but cannot be encoded: an integer beyond msgpack's 64 bits, text that is
    not UTF-8 (a lone surrogate, as non-UTF-8 bytes decode with surrogateescape), and a request
    larger than MAX_ENTRY_BYTES."""
    try:
        data = encode(request)
    except (OverflowError, UnicodeEncodeError, msgspec.EncodeError) as error:
        found = _unencodable(msgspec.to_builtins(request), "")
        raise InvalidRequest(f"invalid request: {found or error}") from None
    if len(data) > MAX_ENTRY_BYTES:
        raise InvalidRequest(f"invalid request: {len(data)} bytes encoded, more than {MAX_ENTRY_BYTES}")
    return data


def _unencodable(value: Any, path: str) -> str | None:
    """Where in the request's builtins (`msgspec.to_builtins`) the encoder fails, and why."""
    if isinstance(value, int) and not isinstance(value, bool):
        if INT_MIN <= value <= INT_MAX:
            return None
        shown = str(value) if value.bit_length() <= 128 else f"{'-' if value < 0 else ''}2**{value.bit_length() - 1}+"
        return f"{path}: {shown} is out of range (integers must be within [-2**63, 2**64 - 1])"
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError as error:
            return (f"{path}: not valid UTF-8 text: {error.reason} "
                    f"(at position {error.start}: {value[error.start:min(error.end, error.start + 8)]!r})")
        return None
    if isinstance(value, dict):
        items = ((f"{path}.{key}" if path else str(key), item) for key, item in value.items())
    elif isinstance(value, (list, tuple)):
        items = ((f"{path}[{i}]", item) for i, item in enumerate(value))
    else:
        return None
    return next((found for where, item in items if (found := _unencodable(item, where))), None)


def estimate_prompt_tokens(request: Request) -> int:
    """Exact for prompt_ids; an over-estimate for text (see BYTES_PER_TOKEN)."""
    if request.prompt_ids is not None:
        return len(request.prompt_ids)
    if request.prompt is not None:
        return math.ceil(len(request.prompt.encode()) / BYTES_PER_TOKEN)
    return sum(MESSAGE_OVERHEAD_TOKENS + math.ceil(len(m.content.encode()) / BYTES_PER_TOKEN)
               for m in request.messages)


def choose_lane(request: Request) -> Lane:
    """The lane stream to enqueue on. The request keeps the caller's own choice (or
    None), so the worker's rule can still decide with real token counts."""
    return pick_lane(estimate_prompt_tokens(request), request.params.max_tokens, request.lane)


def checked_id(request_id: str) -> str:
    """An id given to stream / result / cancel: it ends up inside key names."""
    try:
        return check_request_id(request_id)
    except ValueError as error:
        raise InvalidRequest(str(error)) from None


def _strict(build) -> Request:
    try:
        return build()
    except (msgspec.ValidationError, ValueError, TypeError) as error:
        raise InvalidRequest("invalid request: " + _readable(error)) from None


def _readable(error: Exception) -> str:
    """msgspec says "Expected `int`, got `str` - at `$.params.max_tokens`"; we say
    "params.max_tokens: expected `int`, got `str`"."""
    text = str(error)
    match = _MSGSPEC_PATH.fullmatch(text)
    if match is None:
        return text
    message, path = match.groups()
    return f"{path}: {message[:1].lower()}{message[1:]}" if path else message
