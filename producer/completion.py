"""The outcome of one request, folded from its events (what `Handle.result()` returns)."""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from producer.protocol import (DoneEvent, ErrorEvent, Event, FinishReason, Timings, TokenEvent, TokenLogprob,
                               Usage)


class Completion(msgspec.Struct):
    id: str
    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    usage: Usage | None = None  # None when the request ended with an ErrorEvent
    timings: Timings | None = None
    error: str | None = None  # "code: message" when finish_reason is "error"
    logprobs: list[TokenLogprob] | None = None  # one per token id, when the request asked for them
    attempts: int = 1  # deliveries it took (> 1: resumed after a worker died)

    @property
    def ok(self) -> bool:
        return self.finish_reason != "error"

    @classmethod
    def from_events(cls, request_id: str, events: Iterable[Event]) -> Completion:
        """Fold the in-order events of one request; the last must be terminal."""
        texts: list[str] = []
        token_ids: list[int] = []
        logprobs: list[TokenLogprob] = []
        attempts = 1
        for event in events:
            attempts = max(attempts, event.attempt)
            if isinstance(event, TokenEvent):
                texts.append(event.text)
                token_ids.extend(event.ids)
                logprobs.extend(event.logprobs or ())
            elif isinstance(event, DoneEvent):
                return cls(request_id, "".join(texts), token_ids, event.finish_reason, event.usage,
                           event.timings, event.error, logprobs or None, attempts)
            elif isinstance(event, ErrorEvent):
                return cls(request_id, "".join(texts), token_ids, "error",
                           error=f"{event.code}: {event.message}", logprobs=logprobs or None,
                           attempts=attempts)
        raise ValueError(f"the events of request {request_id} end without a terminal event")
