"""The wire contract shared by producer and worker: sampling parameters and the lane rule.

Every struct here is a msgspec Struct; `__post_init__` validates on construction and on
decoding alike, so a bad value is refused with a clear message wherever it enters.
"""

from __future__ import annotations

from typing import Literal

import msgspec

Lane = Literal["fast", "normal"]
LANES: tuple[Lane, ...] = ("fast", "normal")

# The lane rule's defaults; the worker's config may override them.
FAST_PROMPT_TOKENS = 256
FAST_MAX_TOKENS = 128


class SamplingParams(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """How one request is sampled and when it stops (names follow vLLM's)."""

    max_tokens: int = 256
    temperature: float = 1.0
    top_k: int = 0  # 0 = disabled
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs to return per token

    def __post_init__(self) -> None:
        problems = _sampling_problems(self)
        if problems:
            raise ValueError("invalid sampling params: " + "; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _sampling_problems(p: SamplingParams) -> list[str]:
    checks = [
        (p.max_tokens >= 1, f"max_tokens must be >= 1, got {p.max_tokens}"),
        (0.0 <= p.temperature <= 100.0, f"temperature must be in [0, 100], got {p.temperature}"),
        (p.top_k >= 0, f"top_k must be >= 0 (0 disables), got {p.top_k}"),
        (0.0 < p.top_p <= 1.0, f"top_p must be in (0, 1], got {p.top_p}"),
        (0.0 <= p.min_p <= 1.0, f"min_p must be in [0, 1], got {p.min_p}"),
        (0.0 < p.repetition_penalty <= 10.0,
         f"repetition_penalty must be in (0, 10], got {p.repetition_penalty}"),
        (-2.0 <= p.presence_penalty <= 2.0,
         f"presence_penalty must be in [-2, 2], got {p.presence_penalty}"),
        (-2.0 <= p.frequency_penalty <= 2.0,
         f"frequency_penalty must be in [-2, 2], got {p.frequency_penalty}"),
        (p.seed is None or 0 <= p.seed < 2**63, f"seed must be in [0, 2**63), got {p.seed}"),
        (all(isinstance(s, str) and s for s in p.stop), "stop strings must be non-empty"),
        (len(p.stop) <= 16, f"at most 16 stop strings, got {len(p.stop)}"),
        (all(t >= 0 for t in p.stop_token_ids), "stop_token_ids must be >= 0"),
        (p.logprobs is None or 0 <= p.logprobs <= 20, f"logprobs must be in [0, 20], got {p.logprobs}"),
    ]
    return [message for ok, message in checks if not ok]


def pick_lane(
    prompt_tokens: int,
    max_tokens: int,
    requested: Lane | None = None,
    fast_prompt_tokens: int = FAST_PROMPT_TOKENS,
    fast_max_tokens: int = FAST_MAX_TOKENS,
) -> Lane:
    """Fast lane = short prompt and small max_tokens. A caller may ask for `normal`
    outright; a claim of `fast` that breaks the rule is demoted to `normal`."""
    if requested is not None and requested not in LANES:
        raise ValueError(f"unknown lane {requested!r}; expected one of {LANES}")
    qualifies = prompt_tokens <= fast_prompt_tokens and max_tokens <= fast_max_tokens
    if requested == "normal" or not qualifies:
        return "normal"
    return "fast"


FinishReason = Literal["stop", "length", "cancelled", "deadline", "error"]


class Usage(msgspec.Struct, frozen=True):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class Timings(msgspec.Struct, frozen=True):
    """Seconds, measured by the worker from the request's arrival in the engine."""

    queued: float  # arrival -> first scheduled
    ttft: float  # arrival -> first token
    total: float  # arrival -> finish
