"""The simulator's cost model (worker/engine/simulator.py: CostModel), fitted to a real engine.

`calibrate` runs the real Engine offline on the target model for a few hundred steps of varied
shapes (how many sequences, how long their contexts, how much of each step is prefill), times
every `engine.step()` and notes the plan's shape; `fit` finds CostModel's fixed, per-token and
per-KV-read coefficients by least squares over those samples. The engine's step is what the
worker's loop runs between two Redis round trips, so the fit predicts the worker's step time
less its publishing.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import numpy as np

from producer.protocol import SamplingParams
from worker.engine.simulator import CostModel, kv_reads

# Per phase of the calibration workload: sequences kept in flight, longest prompt. Skipped where
# the phase's prompts alone pass MAX_PHASE_PROMPT_TOKENS: on a CPU those phases take minutes.
IN_FLIGHT = (1, 4, 16, 32)
PROMPT_TOKENS = (32, 256, 1024)
MAX_PHASE_PROMPT_TOKENS = 8192
MAX_OUTPUT_TOKENS = 64


class StepSample(msgspec.Struct, frozen=True):
    num_tokens: int  # tokens computed in the step
    kv_reads: int  # KV tokens its attention read
    seconds: float


class Calibration(msgspec.Struct, frozen=True):
    """What the tuner needs of the real worker: its step cost and its KV capacity."""
    model: str
    fixed_s: float
    per_token_s: float
    per_kv_read_s: float
    kv_tokens: int  # the KV pool in tokens (num_blocks x block_size): the same memory at any block size
    max_model_len: int
    num_samples: int
    mean_relative_error: float  # |predicted - measured| / measured on the samples, averaged

    @property
    def cost(self) -> CostModel:
        return CostModel(self.fixed_s, self.per_token_s, self.per_kv_read_s)


def fit(samples: list[StepSample], trim: float = 0.1) -> CostModel:
    """Least squares on step time = fixed + per_token x tokens + per_kv_read x reads, refitted
    without the `trim` share of samples slowest against the first fit: on a shared machine a
    step now and then waits for a core, and those stalls only ever add time."""
    first = _non_negative_least_squares(samples)
    if trim <= 0:
        return first
    ratios = sorted(s.seconds / first.time_of(s.num_tokens, s.kv_reads) for s in samples)
    cut = ratios[min(len(ratios) - 1, int((1 - trim) * len(ratios)))]
    kept = [s for s in samples if s.seconds / first.time_of(s.num_tokens, s.kv_reads) <= cut]
    return _non_negative_least_squares(kept)


def _non_negative_least_squares(samples: list[StepSample]) -> CostModel:
    """Every subset of the three terms is solved; the best with no negative coefficient wins
    (a negative cost means nothing, and a noisy column can pull one below zero)."""
    columns = np.array([[1.0, s.num_tokens, s.kv_reads] for s in samples])
    seconds = np.array([s.seconds for s in samples])
    best, best_residual = np.zeros(3), float(np.sum(seconds ** 2))
    for size in (1, 2, 3):
        for chosen in itertools.combinations(range(3), size):
            solution, *_ = np.linalg.lstsq(columns[:, chosen], seconds, rcond=None)
            if (solution < 0).any():
                continue
            coefficients = np.zeros(3)
            coefficients[list(chosen)] = solution
            residual = float(np.sum((columns @ coefficients - seconds) ** 2))
            if residual < best_residual:
                best, best_residual = coefficients, residual
    return CostModel(*(float(c) for c in best))


def mean_relative_error(cost: CostModel, samples: list[StepSample]) -> float:
    return sum(abs(cost.time_of(s.num_tokens, s.kv_reads) - s.seconds) / s.seconds for s in samples) / len(samples)


def measure(engine, num_steps: int, steps_per_phase: int = 25, seed: int = 0,
            on_progress: Callable[[int], None] = lambda done: None) -> list[StepSample]:
    """Time `num_steps` engine steps over phases of IN_FLIGHT x PROMPT_TOKENS: each phase keeps
    its count of requests in flight (prompts of half to all its length, 8-64 output tokens),
    so steps mix new prefill chunks with decodes at growing contexts."""
    rng = random.Random(seed)
    shapes: list[tuple[int, int]] = []
    schedule = engine.scheduler.schedule

    def schedule_and_note_shape():
        plan = schedule()
        shapes.append((plan.num_tokens, kv_reads(plan)))  # before update() moves the counters on
        return plan
    engine.scheduler.schedule = schedule_and_note_shape
    phases = [(n, p) for n, p in itertools.product(IN_FLIGHT, PROMPT_TOKENS) if n * p <= MAX_PHASE_PROMPT_TOKENS]
    rng.shuffle(phases)  # a short calibration still sees small and large shapes
    vocab_size, samples, count = engine.info.vocab_size, [], 0
    for in_flight, prompt_tokens in itertools.cycle(phases):
        for _ in range(steps_per_phase):
            while len(engine.requests) < in_flight:
                max_tokens = rng.randint(8, MAX_OUTPUT_TOKENS)
                longest = min(prompt_tokens, engine.max_model_len - MAX_OUTPUT_TOKENS)
                prompt = [rng.randrange(vocab_size) for _ in range(rng.randint(longest // 2, longest))]
                engine.add_request(f"calibration-{count}", prompt_ids=prompt,
                                   params=SamplingParams(max_tokens=max_tokens, ignore_eos=True))
                count += 1
            started = time.perf_counter()
            engine.step()
            seconds = time.perf_counter() - started
            num_tokens, reads = shapes[-1]
            if num_tokens:
                samples.append(StepSample(num_tokens, reads, seconds))
                on_progress(len(samples))
            if len(samples) >= num_steps:
                return samples
        for request_id in list(engine.requests):  # the next phase starts from its own shape
            engine.abort(request_id)
        engine.step()


def calibrate(config, *, threads: int | None = None, num_steps: int = 300, seed: int = 0,
              on_progress: Callable[[int], None] = lambda done: None) -> Calibration:
    """Load the engine the worker would run (`config`: an EngineConfig, as the worker's flags
    make it; its token budget bounds the prefill chunks measured) on `threads` torch threads,
    warm it up, measure `num_steps` steps and fit the cost model."""
    import torch

    from worker.engine.engine import Engine

    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        engine = Engine(config)
        engine.add_request("warm-up", prompt_ids=[1] * 64, params=SamplingParams(max_tokens=4, ignore_eos=True))
        while engine.has_unfinished:  # the first steps pay for allocations and kernel set-up
            engine.step()
        samples = measure(engine, num_steps, seed=seed, on_progress=on_progress)
    finally:
        torch.set_num_threads(before)
    cost = fit(samples)
    return Calibration(config.model, cost.fixed_s, cost.per_token_s, cost.per_kv_read_s,
                       kv_tokens=engine.num_blocks * config.block_size, max_model_len=engine.max_model_len,
                       num_samples=len(samples), mean_relative_error=mean_relative_error(cost, samples))


def save(calibration: Calibration, path: Path) -> None:
    path.write_bytes(msgspec.json.encode(calibration))


def load(path: Path) -> Calibration:
    return msgspec.json.decode(path.read_bytes(), type=Calibration)
