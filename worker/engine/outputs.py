"""What the engine reports after each step, per request."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from producer.protocol import FinishReason, Timings, TokenLogprob, TopLogprob, Usage
from worker.engine.sequence import Sequence


@dataclass
class RequestOutput:
    """New tokens of one request in one step; the last one of a request has `finished`."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""  # the text delta; never a broken character, never past a stop string
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token, when asked for
    finish_reason: FinishReason | None = None
    error: str | None = None
    poisoned: bool = False  # ended because engine steps with it kept failing (finish reason "error")
    usage: Usage | None = None
    timings: Timings | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def token_logprob(tokenizer: Any, token: int, logprob: float, top: list[tuple[int, float]]) -> TokenLogprob:
    """The sampler's logprobs of one token, with each token's text decoded alone (special tokens
    shown, as vLLM does; "" without a tokenizer): the producer has no tokenizer to do it."""
    def text(token_id: int) -> str:
        return tokenizer.decode([token_id]) if tokenizer is not None else ""
    return TokenLogprob(logprob, text(token),
                        [TopLogprob(token_id, value, text(token_id)) for token_id, value in top])


def usage_of(seq: Sequence) -> Usage:
    return Usage(prompt_tokens=seq.num_prompt_tokens, completion_tokens=seq.num_output_tokens,
                 cached_tokens=seq.num_cached_tokens)


def timings_of(seq: Sequence) -> Timings:
    def since_arrival(moment: float | None) -> float:
        return (moment if moment is not None else seq.finish_time) - seq.arrival_time
    return Timings(queued=since_arrival(seq.first_scheduled_time), ttft=since_arrival(seq.first_token_time),
                   total=since_arrival(seq.finish_time))
