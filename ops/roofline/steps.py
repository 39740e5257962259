"""Our engine on a workload, every step timed by its parts.

StepClock times a step's parts at the engine's own seams, none of its code changed: every leaf linear
layer (PackedLinear or nn.Linear: forward pre/post hooks; FusedProjections and ProjectionSlice hold no
weights of their own, so nothing is counted twice), the attention function transformers calls
(re-registered wrapped), the model forward and the sampler (wrapped where the runner and the engine look
them up), and what each step computes (the plan the runner is given). The CPU runs every op
synchronously, so a clock around a call is that call's compute. A step's parts:
  linear     the linear layers, lm_head included
  attention  paged attention: writing the new K/V, attending over each context
  sampling   the sampler
  other      the model's other ops: embedding, norms, rotary, activations, residuals, transformers' glue
  host       the rest of the step: scheduling, the step's inputs and attention metadata, outputs
The hooks' own cost falls in `other`; ops.roofline prints the run's overhead (timed against plain).
The forward runs eager: a compiled one has no seams to time.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

from torch import nn
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

import worker.engine.engine as engine_module
from producer.protocol import SamplingParams
from worker.engine.attention import ATTN_IMPLEMENTATION
from worker.engine.cost_model import sampled_rows
from worker.engine.engine import Engine
from worker.engine.linear import PackedLinear

PARTS = ("linear", "attention", "sampling", "other", "host")


@dataclass
class Step:
    seconds: float
    seqs: list[tuple[int, int]]  # per scheduled sequence: (tokens in its KV cache before the step, new tokens)
    sampled: int  # rows that sample a token
    linear_s: float
    attention_s: float
    forward_s: float
    sampling_s: float

    @property
    def tokens(self) -> int:
        return sum(new for _, new in self.seqs)

    @property
    def prefill_tokens(self) -> int:
        """Tokens of the sequences with more than one new token: the prefill chunks attention serves apart."""
        return sum(new for _, new in self.seqs if new > 1)

    @property
    def decode_rows(self) -> int:
        return sum(1 for _, new in self.seqs if new == 1)

    def parts(self) -> dict[str, float]:
        """Seconds per part (PARTS); they add up to the step's."""
        return {"linear": self.linear_s, "attention": self.attention_s, "sampling": self.sampling_s,
                "other": self.forward_s - self.linear_s - self.attention_s,
                "host": self.seconds - self.forward_s - self.sampling_s}


@dataclass
class StepClock:
    """Installed on an engine for a `with` block; start() before each step, end() after it."""

    engine: Engine
    seconds: dict[str, float] = field(default_factory=dict)
    plan: tuple[list[tuple[int, int]], int] | None = None  # the step's (seqs, sampled rows), once it runs
    _linear_started: float = 0.0
    _undo: list = field(default_factory=list)

    def __enter__(self) -> StepClock:
        runner = self.engine.runner
        for module in self.engine.model.modules():
            if type(module) in (nn.Linear, PackedLinear):
                self._undo += [module.register_forward_pre_hook(self._linear_starts).remove,
                               module.register_forward_hook(self._linear_ends).remove]
        attention = ALL_ATTENTION_FUNCTIONS[ATTN_IMPLEMENTATION]
        AttentionInterface.register(ATTN_IMPLEMENTATION, self._timed(attention, "attention"))
        sample, forward, execute = engine_module.sample, runner.forward, runner.execute
        engine_module.sample = self._timed(sample, "sampling")
        runner.forward = self._timed(forward, "forward")

        def execute_planned(plan):
            self.plan = [(seq.num_computed_tokens, new) for seq, new in plan.scheduled.items()], sampled_rows(plan)
            return execute(plan)

        runner.execute = execute_planned
        self._undo += [lambda: AttentionInterface.register(ATTN_IMPLEMENTATION, attention),
                       lambda: setattr(engine_module, "sample", sample),
                       lambda: setattr(runner, "forward", forward), lambda: delattr(runner, "execute")]
        return self

    def __exit__(self, *exc) -> None:
        while self._undo:
            self._undo.pop()()

    def start(self) -> None:
        self.seconds = dict.fromkeys(("linear", "attention", "forward", "sampling"), 0.0)
        self.plan = None

    def end(self, seconds: float) -> Step | None:
        """The step just ended, `seconds` long; None when it computed nothing."""
        if self.plan is None:
            return None
        seqs, sampled = self.plan
        return Step(seconds, seqs, sampled, self.seconds["linear"], self.seconds["attention"],
                    self.seconds["forward"], self.seconds["sampling"])

    def _linear_starts(self, module, args) -> None:
        self._linear_started = time.perf_counter()

    def _linear_ends(self, module, args, output) -> None:
        self.seconds["linear"] += time.perf_counter() - self._linear_started

    def _timed(self, function, part: str):
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - started
        return timed


def warm_up(engine: Engine) -> None:
    """A short request first (native kernels, oneDNN's primitives, the allocator), of ids no workload
    prompt starts with, so that nothing of the run is in the prefix cache."""
    rng = random.Random(-1)
    engine.add_request("warm-up", prompt_ids=[rng.randrange(engine.info.vocab_size) for _ in range(64)],
                       params=SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished:
        engine.step()


def run(engine: Engine, requests: list[tuple[list[int], int]], clock: StepClock | None = None
        ) -> tuple[float, list[Step]]:
    """Every request at once (greedy, EOS ignored) until the last one ends -> (seconds, the steps that
    computed something, each timed by its parts when a clock is given)."""
    for i, (ids, max_tokens) in enumerate(requests):
        engine.add_request(f"r{i}", prompt_ids=ids,
                           params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    steps = []
    started = time.perf_counter()
    while engine.has_unfinished:
        if clock is None:
            engine.step()
            continue
        clock.start()
        step_started = time.perf_counter()
        engine.step()
        step = clock.end(time.perf_counter() - step_started)
        if step is not None:
            steps.append(step)
    return time.perf_counter() - started, steps
