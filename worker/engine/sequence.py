"""One request's state inside the engine.

A single counter, `num_computed_tokens`, says how many of the sequence's tokens have
their KV in the cache (as in vLLM v1). Prefill, chunked prefill, prefix-cache hits,
decode and recompute after preemption are all "compute the tokens from
num_computed_tokens up to len(token_ids)"; no separate phase flags to keep in sync.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from producer.protocol import Lane, SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, its KV discarded, to be recomputed
    FINISHED = "finished"


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's length
    CANCELLED = "cancelled"
    DEADLINE = "deadline"
    ERROR = "error"  # rejected or failed; `Sequence.error` says why


@dataclass(eq=False)  # identity semantics: sequences live in sets and dicts
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    lane: Lane = "normal"
    eos_token_ids: tuple[int, ...] = ()
    cache_salt: bytes = b""  # its prefix-cache namespace: blocks are shared only with the same salt (blocks.py)
    tenant: str = ""  # whose request it is: fair shares between tenants (fairness.py)
    arrival_time: float = field(default_factory=time.monotonic)

    token_ids: list[int] = field(init=False)  # prompt + output, appended as sampled
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prefix-cache hit on first admission (usage report)
    block_table: list[int] = field(default_factory=list)  # logical block -> physical block
    block_hashes: list[bytes] = field(default_factory=list)  # chained hash of each full block
    status: Status = Status.WAITING
    finish_reason: FinishReason | None = None
    error: str | None = None
    num_preemptions: int = 0
    length_limit: int = 0  # total tokens at which it ends: prompt + max_tokens, or the model length
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.stop_token_ids = set(self.params.stop_token_ids)
        if not self.params.ignore_eos:
            self.stop_token_ids.update(self.eos_token_ids)

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, {self.status.value}, lane={self.lane}, "
                f"computed={self.num_computed_tokens}/{len(self.token_ids)})")

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_decoding(self) -> bool:
        """Only the last sampled token is missing from the cache."""
        return self.num_output_tokens > 0 and self.num_uncomputed_tokens == 1

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def rewind(self, num_tokens: int) -> None:
        """Back to the queue with only its first `num_tokens` tokens, none computed, no blocks
        (a fresh pool after a failed step): recomputed as after a preemption."""
        del self.token_ids[num_tokens:]
        self.num_computed_tokens, self.block_table, self.block_hashes = 0, [], []
        self.status = Status.WAITING if self.first_scheduled_time is None else Status.PREEMPTED

    def finish(self, reason: FinishReason, now: float, error: str | None = None) -> None:
        self.status = Status.FINISHED
        self.finish_reason = reason
        self.error = error
        self.finish_time = now
