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
The hooks' own cost falls in `other`; ops.roofline prints the run's overhead (timed against plain). A clock
`by_parts=False` only records what each step computes, one wrapper per step: the plain run's steps, whose
times are the engine's own (pair() gives each timed step its plain time). The forward runs eager: a compiled
one has no seams to time.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field, replace

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
    plain_s: float = 0.0  # the same step's time in the plain run (pair()); its parts above are the timed run's

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
    by_parts: bool = True
    seconds: dict[str, float] = field(default_factory=dict)
    plan: tuple[list[tuple[int, int]], int] | None = None  # the step's (seqs, sampled rows), once it runs
    _linear_started: float = 0.0
    _undo: list = field(default_factory=list)

    def __enter__(self) -> StepClock:
        runner = self.engine.runner
        execute = runner.execute

        def execute_planned(plan):
            self.plan = [(seq.num_computed_tokens, new) for seq, new in plan.scheduled.items()], sampled_rows(plan)
            return execute(plan)

        runner.execute = execute_planned
        self._undo.append(lambda: delattr(runner, "execute"))
        if self.by_parts:
            self._time_parts()
        return self

    def _time_parts(self) -> None:
        runner = self.engine.runner
        for module in self.engine.model.modules():
            if type(module) in (nn.Linear, PackedLinear):
                self._undo += [module.register_forward_pre_hook(self._linear_starts).remove,
                               module.register_forward_hook(self._linear_ends).remove]
        attention = ALL_ATTENTION_FUNCTIONS[ATTN_IMPLEMENTATION]
        AttentionInterface.register(ATTN_IMPLEMENTATION, self._timed(attention, "attention"))
        sample, forward = engine_module.sample, runner.forward
        engine_module.sample = self._timed(sample, "sampling")
        runner.forward = self._timed(forward, "forward")
        self._undo += [lambda: AttentionInterface.register(ATTN_IMPLEMENTATION, attention),
                       lambda: setattr(engine_module, "sample", sample), lambda: setattr(runner, "forward", forward)]

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


def run(engine: Engine, requests: list[tuple[list[int], int]], clock: StepClock
        ) -> tuple[float, list[Step]]:
    """Every request at once (greedy, EOS ignored) until the last one ends -> (seconds, the steps that
    computed something, each timed by its parts where the clock times them)."""
    for i, (ids, max_tokens) in enumerate(requests):
        engine.add_request(f"r{i}", prompt_ids=ids,
                           params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    steps = []
    started = time.perf_counter()
    while engine.has_unfinished:
        clock.start()
        step_started = time.perf_counter()
        engine.step()
        step = clock.end(time.perf_counter() - step_started)
        if step is not None:
            steps.append(step)
    return time.perf_counter() - started, steps


def pair(plain: list[Step], timed: list[Step]) -> list[Step]:
    """The timed run's steps, each with its time in the plain run: the two runs of one workload on fresh
    KV pools schedule the same steps, which is checked."""
    if [(s.seqs, s.sampled) for s in plain] != [(s.seqs, s.sampled) for s in timed]:
        raise RuntimeError("the plain and the timed run scheduled different steps: their times cannot be paired")
    return [replace(step, plain_s=untimed.seconds) for untimed, step in zip(plain, timed)]
