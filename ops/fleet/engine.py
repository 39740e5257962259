"""The engine of a synthetic worker: Engine's own bookkeeping with the simulator's model.

Everything the worker loop sees of an engine (requests, the scheduler and its block pool, aborts,
outputs with usage and timings, recovery from a failed step) is Engine's code, unchanged; only
what Engine loads and runs on a device is replaced: no kernels, no model, no KV cache tensors.
Each step, FakeModel (worker/engine/simulator.py) picks the scheduled sequences' next tokens and
the step then lasts what CostModel says a real step of that shape takes, so a Worker around it
keeps production's step cadence and writes production's events, on the CPU of the scheduler
alone. Each token's text is TOKEN_TEXT, so that events are as large as real ones.

It also keeps a tally for ops/fleet: steps, tokens, and for each request taken in, when the
worker claimed it and when it entered the engine (recorded by workers.FleetWorker).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from worker.engine.config import EngineConfig
from worker.engine.cost_model import kv_reads, sampled_rows
from worker.engine.engine import Engine
from worker.engine.models import ModelInfo
from worker.engine.outputs import RequestOutput
from worker.engine.plan import StepPlan
from worker.engine.sequence import Sequence
from worker.engine.simulator import CostModel, FakeModel

from ops.fleet.scenario import VOCAB_SIZE

# SmolLM2's tokenizer averages 3.7 bytes per token on English prose (this repository's README):
# every token's text delta is 4 bytes, one short word.
TOKEN_TEXT = " and"


@dataclass
class AdmitTiming:
    request_id: str  # the engine's id: "<tenant>/<request id>" (worker/flight.py)
    claimed: float  # unix seconds, when the worker's claim of it answered (the intake's admission)
    started: float  # unix seconds, when the worker handed it to the engine (at the end of a step)


@dataclass
class Tally:
    steps: int = 0
    tokens: int = 0
    scheduled: int = 0  # sequences in each step, summed over steps: / steps is the mean batch
    admissions: list[AdmitTiming] = field(default_factory=list)


class SyntheticEngine(Engine):
    def __init__(self, config: EngineConfig, cost: CostModel) -> None:
        """What Engine.__init__ sets up, minus what it loads: a model of no layers (nothing is
        computed and no KV cache allocated), the fake model's vocabulary and no end-of-sequence
        token (requests end at their max_tokens), and `config.num_blocks` blocks of bookkeeping."""
        if config.num_blocks is None or config.max_model_len is None:
            raise ValueError("a synthetic engine needs num_blocks and max_model_len in its config")
        self.config, self.model, self.tokenizer = config, FakeModel(VOCAB_SIZE), None
        self.cost = cost
        self.info = ModelInfo(num_layers=0, num_heads=0, num_kv_heads=0, head_dim=0, vocab_size=VOCAB_SIZE,
                              max_model_len=config.max_model_len, eos_token_ids=(), dtype=torch.float32)
        self._init_bookkeeping(config.max_model_len, config.num_blocks)
        self.ranks = self.runner = None
        self.tally = Tally()
        self.step_seconds = 0.0  # what the cost model gives the step in progress

    def step(self) -> list[RequestOutput]:
        """Engine.step, lasting the cost model's time for the step's shape (when the scheduling
        took less, which it does)."""
        started = time.monotonic()
        self.step_seconds = 0.0
        outputs = super().step()
        time.sleep(max(0.0, self.step_seconds - (time.monotonic() - started)))
        return outputs

    def _run(self, plan: StepPlan, outputs: list[RequestOutput]) -> None:
        """Engine._run with the fake model in place of the runner and the sampler."""
        self.last_step_tokens = plan.num_tokens
        outputs += [self._final(seq, RequestOutput(seq.request_id)) for seq in plan.finished
                    if seq.request_id in self.requests and self.requests[seq.request_id].seq is seq]
        if not plan.scheduled:
            return
        # the engine's part of the turn: the publish after it is real
        self.step_seconds = self.cost.engine_time(plan.num_tokens, kv_reads(plan), sampled_rows(plan))
        sampled = self.model.execute(plan)
        self.scheduler.update(plan, sampled)
        for seq, token in sampled.items():
            output = self._token_output(seq, token, None, None)
            output.text = TOKEN_TEXT
            outputs.append(output)
        self.tally.steps += 1
        self.tally.tokens += len(sampled)
        self.tally.scheduled += len(plan.scheduled)

    def _final(self, seq: Sequence, output: RequestOutput) -> RequestOutput:
        self.model.prompt_keys.pop(seq, None)  # FakeModel keeps a key per sequence seen: not for ended ones
        return super()._final(seq, output)

    def take_tally(self) -> Tally:
        """The tally since the last call (the worker's thread adds to a new one meanwhile)."""
        tally, self.tally = self.tally, Tally()
        return tally
