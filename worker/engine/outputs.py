"""What the engine reports after each step, per request."""

from __future__ import annotations

from dataclasses import dataclass, field

from producer.protocol import FinishReason, Timings, Usage
from worker.engine.sequence import Sequence


@dataclass
class RequestOutput:
    """New tokens of one request in one step; the last one of a request has `finished`."""

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""  # the text delta; never a broken character, never past a stop string
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str | None = None
    poisoned: bool = False  # ended because engine steps with it kept failing (finish reason "error")
    usage: Usage | None = None
    timings: Timings | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def usage_of(seq: Sequence) -> Usage:
    return Usage(prompt_tokens=seq.num_prompt_tokens, completion_tokens=seq.num_output_tokens,
                 cached_tokens=seq.num_cached_tokens)


def timings_of(seq: Sequence) -> Timings:
    def since_arrival(moment: float | None) -> float:
        return (moment if moment is not None else seq.finish_time) - seq.arrival_time
    return Timings(queued=since_arrival(seq.first_scheduled_time), ttft=since_arrival(seq.first_token_time),
                   total=since_arrival(seq.finish_time))
