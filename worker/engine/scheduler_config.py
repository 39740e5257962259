"""The scheduler's knobs, validated in one place. Names match the worker's flags."""

from __future__ import annotations

from typing import Literal

import msgspec

from producer.protocol import FAST_MAX_TOKENS, FAST_PROMPT_TOKENS

Policy = Literal["continuous", "static"]
Fairness = Literal["vtc", "fifo"]
VictimPolicy = Literal["cheapest", "newest", "most_blocks"]
FastLaneProtection = Literal["reserve", "preempt", "none"]


class SchedulerConfig(msgspec.Struct, forbid_unknown_fields=True):
    token_budget: int = 2048  # tokens computed per step, prefill and decode together
    max_num_seqs: int | None = None  # optional cap on running sequences; None = no cap
    max_model_len: int = 8192
    watermark: float = 0.2  # share of the pool an admission must leave free
    fast_lane_share: float = 0.3  # share of each step's prefill budget reserved for the fast lane
    fast_prompt_tokens: int = FAST_PROMPT_TOKENS
    fast_max_tokens: int = FAST_MAX_TOKENS
    # How the fast lane avoids waiting behind a pool full of normal-lane work:
    # "reserve" keeps fast_lane_reserve of the KV pool out of normal-lane admissions;
    # "preempt" lets a fast request that has waited fast_lane_max_wait_steps engine steps since
    # the step of its first refused admission evict the newest normal-lane sequences until its
    # first chunk fits. ops/bench_scheduler.py measures both.
    fast_lane_protection: FastLaneProtection = "preempt"
    fast_lane_reserve: float = 0.3  # share of the KV pool, under "reserve"
    fast_lane_max_wait_steps: int = 4
    victim_policy: VictimPolicy = "cheapest"
    cooldown_after_steps: int = 3  # preemptions in this many consecutive steps start a cool-down
    cooldown_watermark: float = 0.1  # added to the watermark while cooling down
    calm_steps: int = 32  # steps without preemption that end a cool-down
    # A waiting request's patience runs out in the head_of_line_patience-th engine step,
    # counting the step of its first refused admission as the first: from then on nobody in
    # its lane is admitted ahead of it, the other lane leaves room for its first chunk, and it
    # is admitted without the watermark as soon as that chunk fits.
    head_of_line_patience: int = 64
    # waiting requests examined past non-fitting ones per admission pass (a lane can get two
    # passes in a step: its share, then what the other lane left)
    max_admission_skips: int = 32
    policy: Policy = "continuous"
    # Between tenants inside a lane (fairness.py): "vtc" admits the least-served tenant's next
    # request (virtual token counters, weighted by the registry) and preempts the most-served
    # tenant's; "fifo" admits by arrival, whoever's.
    fairness: Fairness = "vtc"
    # A ceiling on the inter-token latency of running requests (stall-free batching, as Sarathi-Serve
    # does): a step that carries decodes takes only the prefill tokens that the engine's fitted cost
    # model (cost_model.py) says keep its turn under this, the fast lane's first; a step without
    # decodes takes the whole token budget. None: every step may take the whole budget.
    itl_slo_ms: float | None = None

    def __post_init__(self) -> None:
        checks = [
            (self.token_budget >= 1, f"token_budget must be >= 1, got {self.token_budget}"),
            (self.max_num_seqs is None or self.max_num_seqs >= 1,
             f"max_num_seqs must be >= 1 or None, got {self.max_num_seqs}"),
            (self.max_model_len >= 2, f"max_model_len must be >= 2, got {self.max_model_len}"),
            (0.0 <= self.watermark < 1.0, f"watermark must be in [0, 1), got {self.watermark}"),
            (0.0 <= self.fast_lane_share <= 0.5,
             f"fast_lane_share must be in [0, 0.5], got {self.fast_lane_share}"),
            (0.0 <= self.fast_lane_reserve <= 0.5,
             f"fast_lane_reserve must be in [0, 0.5], got {self.fast_lane_reserve}"),
            (self.fast_prompt_tokens >= 1 and self.fast_max_tokens >= 1,
             "fast_prompt_tokens and fast_max_tokens must be >= 1"),
            (self.fast_lane_max_wait_steps >= 0, "fast_lane_max_wait_steps must be >= 0"),
            (self.cooldown_after_steps >= 1, "cooldown_after_steps must be >= 1"),
            (0.0 <= self.watermark + self.cooldown_watermark < 1.0,
             "watermark + cooldown_watermark must be in [0, 1)"),
            (self.calm_steps >= 0 and self.head_of_line_patience >= 1 and self.max_admission_skips >= 0,
             "calm_steps, head_of_line_patience and max_admission_skips must be positive"),
            (self.itl_slo_ms is None or self.itl_slo_ms > 0, f"itl_slo_ms must be > 0, got {self.itl_slo_ms}"),
        ]
        problems = [message for ok, message in checks if not ok]
        if problems:
            raise ValueError("invalid scheduler config: " + "; ".join(problems))
