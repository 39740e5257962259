"""From `submit()`'s arguments to a validated Request and its lane: everything the
producer decides before it touches Redis, kept pure."""

from __future__ import annotations

import math
import re
import time
from typing import Any

import msgspec

from producer.errors import InvalidRequest
from producer.protocol import (Lane, Message, Request, SamplingParams, check_request_id, decode_request, encode,
                               pick_lane)

# The producer has no tokenizer, so it estimates. BPE tokenizers average about 4 bytes of
# English per token; dividing by 3 over-estimates, so a prompt near the fast lane's limit
# goes to the normal lane rather than crowding the fast one. The estimate only picks the
# stream a request waits in: the worker applies the rule again with real token counts.
BYTES_PER_TOKEN = 3
MESSAGE_OVERHEAD_TOKENS = 8  # role markers and separators a chat template adds per message

_MSGSPEC_PATH = re.compile(r"(.*) - at `\$\.?(.*)`", re.DOTALL)


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
        request = _strict(lambda: decode_request(encode(prompt)))
    else:
        fields: dict[str, Any] = {"prompt": prompt, "messages": messages, "prompt_ids": prompt_ids,
                                  "params": params, "lane": lane, "id": request_id,
                                  "deadline": deadline}
        request = _strict(lambda: msgspec.convert(
            {name: value for name, value in fields.items() if value is not None}, Request))
    if request.prompt == "" or request.messages == [] or request.prompt_ids == []:
        raise InvalidRequest("invalid request: the prompt is empty")
    if request.deadline is not None and request.deadline <= time.time():
        raise InvalidRequest(f"invalid request: deadline {request.deadline} is in the past "
                             "(it is unix seconds, e.g. time.time() + 30)")
    return request


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
