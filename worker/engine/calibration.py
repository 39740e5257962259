"""An engine's steps timed over varied shapes: the samples its cost model (cost_model.py) is fitted on.

`measure` keeps phases of IN_FLIGHT x PROMPT_TOKENS requests in flight (prompts of half to all the
phase's length, 8-64 output tokens), so that steps mix new prefill chunks with decodes at growing
contexts, and times every engine.step() with the plan's shape. An engine with an ITL SLO runs it on
itself at start-up (cost_model.LiveCosts then keeps refitting while it serves); ops/cost_model.py
runs it for the tuner's simulator.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from producer.protocol import SamplingParams
from worker.engine.cost_model import StepSample, kv_reads, sampled_rows

if TYPE_CHECKING:
    from worker.engine.engine import Engine

# Per phase: sequences kept in flight, longest prompt. Skipped where the phase's prompts alone pass
# MAX_PHASE_PROMPT_TOKENS: on a CPU those phases take minutes.
IN_FLIGHT = (1, 4, 16, 32)
PROMPT_TOKENS = (32, 256, 1024)
MAX_PHASE_PROMPT_TOKENS = 8192
MAX_OUTPUT_TOKENS = 64


def measure(engine: Engine, num_steps: int, steps_per_phase: int = 25, seed: int = 0,
            on_progress: Callable[[int], None] = lambda done: None) -> list[StepSample]:
    """Time `num_steps` engine steps (see the module docstring); the engine holds no request after."""
    rng = random.Random(seed)
    shapes: list[tuple[int, int, int]] = []
    schedule = engine.scheduler.schedule

    def schedule_and_note_shape():
        plan = schedule()
        shapes.append((plan.num_tokens, kv_reads(plan), sampled_rows(plan)))  # before update() moves the counters on
        return plan
    engine.scheduler.schedule = schedule_and_note_shape
    phases = [(n, p) for n, p in itertools.product(IN_FLIGHT, PROMPT_TOKENS) if n * p <= MAX_PHASE_PROMPT_TOKENS]
    rng.shuffle(phases)  # a short calibration still sees small and large shapes
    vocab_size, samples, count = engine.info.vocab_size, [], 0
    try:
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
                num_tokens, reads, rows = shapes[-1]
                if num_tokens:
                    samples.append(StepSample(num_tokens, reads, rows, seconds))
                    on_progress(len(samples))
                if len(samples) >= num_steps:
                    return samples
            _end_all(engine)  # the next phase starts from its own shape
    finally:
        _end_all(engine)
        vars(engine.scheduler).pop("schedule", None)


def _end_all(engine: Engine) -> None:
    for request_id in list(engine.requests):
        engine.abort(request_id)
    while engine.has_unfinished:
        engine.step()
