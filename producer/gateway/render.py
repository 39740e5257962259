"""streambatch events as OpenAI's objects: chat completions and their chunks, text completions,
and the Responses API's response object and its numbered stream events.

A Responses stream is a pure function of the request's events: event k of the same response has
the same sequence number on every gateway replica, before and after a restart, so
`starting_after=N` resumes exactly after N wherever it is asked.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec

from producer.completion import Completion
from producer.protocol import DoneEvent, ErrorEvent, Event, TokenEvent, TokenLogprob, Usage

# Our finish reasons as OpenAI's (the rest end in an error: see `failure`).
FINISH_REASONS = {"stop": "stop", "length": "length", "cancelled": "stop"}


class Failure(msgspec.Struct, frozen=True):
    """How a request that ended without its text fails over HTTP (OpenAI's error shape)."""

    status: int
    message: str
    type: str
    code: str


def failure(event: DoneEvent | ErrorEvent) -> Failure | None:
    """-> the HTTP failure of a request that ended with this terminal event (None: it did not fail)."""
    if isinstance(event, ErrorEvent):
        code, message = event.code, event.message
    elif event.finish_reason == "deadline":
        return Failure(504, "the request's deadline passed before a worker started it", "timeout", "deadline")
    elif event.finish_reason != "error":
        return None
    else:
        code, _, message = (event.error or "internal: the request failed").partition(": ")
    if code in ("invalid_request", "too_long"):
        return Failure(400, message, "invalid_request_error", "context_length_exceeded" if code == "too_long" else code)
    if code == "queue_full":
        return Failure(429, message, "rate_limit_error", code)
    return Failure(500, message, "server_error", code)


def error_body(message: str, type: str, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _usage(usage: Usage | None) -> dict | None:
    if usage is None:
        return None
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.prompt_tokens + usage.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens}}


def _token(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def chat_logprobs(logprobs: Iterable[TokenLogprob] | None) -> dict | None:
    if logprobs is None:
        return None
    return {"content": [_token(entry.text, entry.logprob) | {"top_logprobs": [_token(top.text, top.logprob)
                                                                               for top in entry.top]}
                        for entry in logprobs], "refusal": None}


def completion_logprobs(logprobs: list[TokenLogprob] | None, offset: int = 0) -> dict | None:
    if logprobs is None:
        return None
    offsets, at = [], offset
    for entry in logprobs:
        offsets.append(at)
        at += len(entry.text)
    return {"tokens": [entry.text for entry in logprobs], "token_logprobs": [entry.logprob for entry in logprobs],
            "top_logprobs": [{top.text: top.logprob for top in entry.top} for entry in logprobs],
            "text_offset": offsets}


class Heading(msgspec.Struct, frozen=True):
    """What every object of one completion repeats: its id, model, creation time, and the service
    tier that stands for the lane it went to (shapes.service_tier)."""

    id: str
    model: str
    created: int
    service_tier: str

    def of(self, object: str) -> dict:
        return {"id": self.id, "object": object, "created": self.created, "model": self.model,
                "service_tier": self.service_tier}


# --- Chat Completions ----------------------------------------------------------------------
def chat_completion(heading: Heading, completion: Completion) -> dict:
    return heading.of("chat.completion") | {
        "choices": [{"index": 0, "message": {"role": "assistant", "content": completion.text, "refusal": None},
                     "logprobs": chat_logprobs(completion.logprobs),
                     "finish_reason": FINISH_REASONS[completion.finish_reason]}],
        "usage": _usage(completion.usage)}


class _ChunkStream:
    """The chunks of a streamed completion, as its events come (`push`): one per token event (its
    text may be empty: part of a character), so a client times every token; an ErrorEvent or a
    deadline becomes OpenAI's in-stream error object, after which nothing follows. A subclass says
    what a chunk holds."""

    object: str

    def __init__(self, heading: Heading, include_usage: bool) -> None:
        self.base = heading.of(self.object)
        self.include_usage = include_usage

    def _chunk(self, choice: dict) -> dict:
        return self.base | {"choices": [{"index": 0} | choice]} | ({"usage": None} if self.include_usage else {})

    def opening(self) -> list[dict]:
        return []

    def push(self, event: Event) -> list[dict]:
        if isinstance(event, TokenEvent):
            return [self._chunk(self._token(event))]
        fault = failure(event)
        if fault is not None:
            return [error_body(fault.message, fault.type, fault.code)]
        chunks = [self._chunk(self._last(FINISH_REASONS[event.finish_reason]))]
        if self.include_usage:
            chunks.append(self.base | {"choices": [], "usage": _usage(event.usage)})
        return chunks

    def _token(self, event: TokenEvent) -> dict:
        raise NotImplementedError

    def _last(self, finish_reason: str) -> dict:
        raise NotImplementedError


class ChatStream(_ChunkStream):
    object = "chat.completion.chunk"

    def opening(self) -> list[dict]:
        return [self._chunk({"delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None})]

    def _token(self, event: TokenEvent) -> dict:
        return {"delta": {"content": event.text}, "logprobs": chat_logprobs(event.logprobs), "finish_reason": None}

    def _last(self, finish_reason: str) -> dict:
        return {"delta": {}, "logprobs": None, "finish_reason": finish_reason}


# --- Completions ---------------------------------------------------------------------------
def text_completion(heading: Heading, completion: Completion) -> dict:
    return heading.of("text_completion") | {
        "choices": [{"index": 0, "text": completion.text, "logprobs": completion_logprobs(completion.logprobs),
                     "finish_reason": FINISH_REASONS[completion.finish_reason]}],
        "usage": _usage(completion.usage)}


class CompletionStream(_ChunkStream):
    object = "text_completion"

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.offset = 0  # characters sent: where the next token's text starts

    def _token(self, event: TokenEvent) -> dict:
        choice = {"text": event.text, "logprobs": completion_logprobs(event.logprobs, self.offset),
                  "finish_reason": None}
        self.offset += len(event.text)
        return choice

    def _last(self, finish_reason: str) -> dict:
        return {"text": "", "logprobs": None, "finish_reason": finish_reason}


# --- Responses -----------------------------------------------------------------------------
class ResponseRecord(msgspec.Struct, frozen=True, omit_defaults=True):
    """What the gateway keeps of a Responses request beside its events (Keys.response): what the
    response object repeats back, and whether it runs on without a connection."""

    model: str
    created_at: int
    background: bool = False
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    metadata: dict[str, str] = {}
    service_tier: str = "default"


def _response_usage(usage: Usage | None) -> dict | None:
    if usage is None:
        return None
    return {"input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


def _status(events: list[Event]) -> tuple[str, dict | None, dict | None]:
    """-> (status, incomplete_details, error) of a response whose events are these (so far)."""
    if not events:
        return "queued", None, None
    last = events[-1]
    if isinstance(last, TokenEvent):
        return "in_progress", None, None
    if isinstance(last, DoneEvent):
        if last.finish_reason == "stop":
            return "completed", None, None
        if last.finish_reason == "length":
            return "incomplete", {"reason": "max_output_tokens"}, None
        if last.finish_reason == "cancelled":
            return "cancelled", None, None
    fault = failure(last)
    return "failed", None, {"code": fault.code, "message": fault.message}


def message_id(response_id: str) -> str:
    return "msg_" + response_id.removeprefix("resp_")


def _output_text(events: list[Event]) -> str:
    return "".join(event.text for event in events if isinstance(event, TokenEvent))


def _logprobs(events: list[Event]) -> list[dict]:
    return [_token(entry.text, entry.logprob) | {"top_logprobs": [_token(top.text, top.logprob) for top in entry.top]}
            for event in events if isinstance(event, TokenEvent) for entry in event.logprobs or ()]


def _part(events: list[Event]) -> dict:
    return {"type": "output_text", "text": _output_text(events), "annotations": [], "logprobs": _logprobs(events)}


def _item(response_id: str, events: list[Event], status: str) -> dict:
    item_status = {"completed": "completed", "in_progress": "in_progress", "queued": "in_progress"}.get(
        status, "incomplete")
    return {"id": message_id(response_id), "type": "message", "role": "assistant", "status": item_status,
            "content": [_part(events)] if events else []}


def response_object(response_id: str, record: ResponseRecord, events: list[Event]) -> dict:
    """The response as it stands after `events` (all of them, or those so far)."""
    status, incomplete, error = _status(events)
    done = events[-1] if events and isinstance(events[-1], DoneEvent) else None
    return {"id": response_id, "object": "response", "created_at": record.created_at, "status": status,
            "background": record.background, "model": record.model,
            "output": [_item(response_id, events, status)] if any(isinstance(e, TokenEvent) for e in events) else [],
            "usage": _response_usage(done.usage if done else None), "error": error,
            "incomplete_details": incomplete, "instructions": record.instructions,
            "max_output_tokens": record.max_output_tokens, "temperature": record.temperature,
            "top_p": record.top_p, "metadata": record.metadata, "parallel_tool_calls": False,
            "tool_choice": "none", "tools": [], "text": {"format": {"type": "text"}},
            "service_tier": record.service_tier}


class ResponseStream:
    """The Responses stream events, numbered, as the request's events come: the same events give
    the same numbers, so a resumed stream skips exactly what its client saw."""

    def __init__(self, response_id: str, record: ResponseRecord) -> None:
        self.response_id, self.record = response_id, record
        self.seen: list[Event] = []
        self.next_number = 0
        self.where = {"item_id": message_id(response_id), "output_index": 0, "content_index": 0}

    def _numbered(self, event: dict[str, Any]) -> dict[str, Any]:
        self.next_number += 1
        return event | {"sequence_number": self.next_number - 1}

    def opening(self) -> list[dict]:
        started = response_object(self.response_id, self.record, []) | {"status": "in_progress"}
        item = {"type": "message", "id": self.where["item_id"], "role": "assistant", "status": "in_progress",
                "content": []}
        return [self._numbered({"type": "response.created", "response": started}),
                self._numbered({"type": "response.in_progress", "response": started}),
                self._numbered({"type": "response.output_item.added", "output_index": 0, "item": item}),
                self._numbered({"type": "response.content_part.added", **self.where,
                                "part": {"type": "output_text", "text": "", "annotations": [], "logprobs": []}})]

    def push(self, event: Event) -> list[dict]:
        self.seen.append(event)
        if isinstance(event, TokenEvent):
            return [self._numbered({"type": "response.output_text.delta", **self.where, "delta": event.text,
                                    "logprobs": _logprobs([event])})]
        final = response_object(self.response_id, self.record, self.seen)
        part = _part(self.seen)
        ending = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(
            final["status"], "response.failed")
        return [self._numbered({"type": "response.output_text.done", **self.where, "text": part["text"],
                                "logprobs": part["logprobs"]}),
                self._numbered({"type": "response.content_part.done", **self.where, "part": part}),
                self._numbered({"type": "response.output_item.done", "output_index": 0,
                                "item": _item(self.response_id, self.seen, final["status"]) | {"content": [part]}}),
                self._numbered({"type": ending, "response": final})]
