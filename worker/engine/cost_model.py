"""What a step costs, from its shape: the model the ITL SLO is held with, and the simulator's clock.

A worker's turn, from one token event to the next, is its engine step plus what it does between
two steps (the outbox's publish round trip, the intake's read):

    turn = fixed + per_token x tokens computed + per_kv_read x KV tokens attention reads
           + per_row x rows that sample (lm_head, the sampler, the outputs, each row's share of the
             publish) + publish (the round trip itself)

`fit` finds the coefficients by least squares over timed steps (worker/engine/calibration.py
times them); the publish terms are fitted the same way, on the gaps between steps against the rows
each step published. `LiveCosts` keeps an engine's model up to date while it serves. Pure Python and
numpy: the scheduler, which sizes its steps with the model, imports no torch.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, replace

import msgspec
import numpy as np

from worker.engine.plan import StepPlan

REFIT_STEPS = 64  # an engine refits its model this often
LIVE_STEPS = 512  # the latest steps it refits on, beside its calibration's


def kv_reads(plan: StepPlan) -> int:
    """KV tokens attention reads in the step: each scheduled sequence's context after it."""
    return sum(seq.num_computed_tokens + n for seq, n in plan.scheduled.items())


def sampled_rows(plan: StepPlan) -> int:
    return sum(1 for seq in plan.scheduled if plan.samples(seq))


@dataclass(frozen=True)
class CostModel:
    """Seconds of a worker's turn. Defaults are a small model on one GPU: 256 decodes at 1k
    context take about 20 ms."""

    fixed_s: float = 0.008
    per_token_s: float = 0.00002
    per_kv_read_s: float = 0.00000004
    per_row_s: float = 0.0
    publish_s: float = 0.0

    def step_time(self, plan: StepPlan) -> float:
        return self.time_of(plan.num_tokens, kv_reads(plan), sampled_rows(plan))

    def engine_time(self, num_tokens: int, kv_reads: int, rows: int) -> float:
        """The engine step alone."""
        return self.fixed_s + self.per_token_s * num_tokens + self.per_kv_read_s * kv_reads + self.per_row_s * rows

    def time_of(self, num_tokens: int, kv_reads: int, rows: int) -> float:
        """The whole turn: the engine step and the publish round trip after it."""
        return self.engine_time(num_tokens, kv_reads, rows) + self.publish_s

    def prefill_allowance(self, num_tokens: int, kv_reads: int, rows: int, turn_s: float) -> int:
        """Prefill tokens that a step already holding this much (its decodes) can take and stay
        within `turn_s`: each costs a token's compute and its own KV read, and a chunk that ends its
        prompt samples a row, counted once. Not counted (a few percent at most): a second such
        chunk's row, and a chunk's cached prefix that attention reads too."""
        spare = turn_s - self.time_of(num_tokens, kv_reads, rows) - self.per_row_s
        per_token = self.per_token_s + self.per_kv_read_s
        if spare <= 0:
            return 0
        return int(spare / per_token) if per_token > 0 else 1 << 30


class StepSample(msgspec.Struct, frozen=True, array_like=True):
    num_tokens: int  # tokens computed in the step
    kv_reads: int  # KV tokens its attention read
    rows: int  # rows that sampled
    seconds: float


def fit(samples: list[StepSample], trim: float = 0.1) -> CostModel:
    """Least squares on seconds = fixed + per_token x tokens + per_kv_read x reads + per_row x rows,
    refitted without the `trim` share of samples slowest against the first fit: on a shared machine a
    step now and then waits for a core, and those stalls only ever add time."""
    first = _non_negative_least_squares(samples)
    if trim <= 0:
        return first
    ratios = sorted(s.seconds / _predicted(first, s) for s in samples)
    cut = ratios[min(len(ratios) - 1, int((1 - trim) * len(ratios)))]
    return _non_negative_least_squares([s for s in samples if s.seconds / _predicted(first, s) <= cut])


def _predicted(cost: CostModel, sample: StepSample) -> float:
    return max(cost.engine_time(sample.num_tokens, sample.kv_reads, sample.rows), 1e-12)


def _non_negative_least_squares(samples: list[StepSample]) -> CostModel:
    """Every subset of the terms is solved; the best with no negative coefficient wins (a negative
    cost means nothing, and a noisy column can pull one below zero)."""
    columns = np.array([[1.0, s.num_tokens, s.kv_reads, s.rows] for s in samples])
    seconds = np.array([s.seconds for s in samples])
    best, best_residual = np.zeros(4), float(np.sum(seconds ** 2))
    for size in range(1, 5):
        for chosen in itertools.combinations(range(4), size):
            solution, *_ = np.linalg.lstsq(columns[:, chosen], seconds, rcond=None)
            if (solution < 0).any():
                continue
            coefficients = np.zeros(4)
            coefficients[list(chosen)] = solution
            residual = float(np.sum((columns @ coefficients - seconds) ** 2))
            if residual < best_residual:
                best, best_residual = coefficients, residual
    return CostModel(*(float(c) for c in best))


def with_publish(cost: CostModel, gaps: list[StepSample]) -> CostModel:
    """`cost` with the publish terms fitted on `gaps`: the time between a step and the next
    (num_tokens and kv_reads 0, rows: the rows the first one published)."""
    publish = fit(gaps)
    return replace(cost, publish_s=publish.fixed_s, per_row_s=cost.per_row_s + publish.per_row_s)


def mean_relative_error(cost: CostModel, samples: list[StepSample]) -> float:
    return sum(abs(_predicted(cost, s) - s.seconds) / s.seconds for s in samples) / len(samples)


class LiveCosts:
    """An engine's model while it serves: its calibration's fit, scaled every REFIT_STEPS steps by
    how much slower or faster the latest LIVE_STEPS steps ran than it predicts (the median ratio: the
    machine's speed drifts, a neighbour takes a core), with the publish terms fitted on the gaps
    between steps while requests were running (the worker's loop between two steps; an engine
    driven offline has next to none). Live steps refit only that scale: their shapes vary too little
    (mostly decodes: as many tokens as rows) for the terms to be told apart."""

    def __init__(self, calibration: list[StepSample]) -> None:
        self.calibrated = fit(calibration)
        self.model = self.calibrated
        self.live: deque[StepSample] = deque(maxlen=LIVE_STEPS)
        self.gaps: deque[StepSample] = deque(maxlen=LIVE_STEPS)
        self.steps = 0
        self.last_end: float | None = None  # when the latest step ended, if the engine stayed busy
        self.last_rows = 0

    def step_started(self, now: float) -> None:
        if self.last_end is not None:
            self.gaps.append(StepSample(0, 0, self.last_rows, now - self.last_end))

    def step_ended(self, num_tokens: int, kv_reads: int, rows: int, started: float, now: float, busy: bool) -> None:
        """`busy`: requests remain, so the next step follows the loop's turn at once."""
        if num_tokens:
            self.live.append(StepSample(num_tokens, kv_reads, rows, now - started))
            self.steps += 1
            if self.steps % REFIT_STEPS == 0:
                self.model = self._refitted()
        self.last_end, self.last_rows = (now, rows) if busy else (None, 0)

    def _refitted(self) -> CostModel:
        ratios = sorted(s.seconds / _predicted(self.calibrated, s) for s in self.live)
        scale = ratios[len(ratios) // 2]
        model = CostModel(*(scale * term for term in (self.calibrated.fixed_s, self.calibrated.per_token_s,
                                                       self.calibrated.per_kv_read_s, self.calibrated.per_row_s)))
        return with_publish(model, list(self.gaps)) if len(self.gaps) >= REFIT_STEPS else model
