"""A simulated executor: a deterministic fake model plus a cost model for step time (cost_model.py).

It stands in for the model runner so the scheduler can be driven at scale (tests, the
scheduler benchmark, later the scale simulation). The fake model's next token depends
only on the request's prompt and the position, so a preempted and recomputed sequence
must finish with exactly the output it would have had without preemption.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from producer.protocol import Lane, SamplingParams
from worker.engine.blocks import BlockPool, BlockStats
from worker.engine.cost_model import CostModel
from worker.engine.fairness import TenantShare
from worker.engine.plan import StepPlan
from worker.engine.scheduler import Scheduler
from worker.engine.scheduler_config import SchedulerConfig
from worker.engine.sequence import Sequence


class FakeModel:
    """next token = f(prompt, position); EOS with a fixed probability when enabled."""

    def __init__(self, vocab_size: int = 32000, eos_token_id: int | None = None,
                 eos_probability: float = 0.0) -> None:
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.eos_token_ids = () if eos_token_id is None else (eos_token_id,)
        self.eos_threshold = int(eos_probability * 1_000_000)
        self.prompt_keys: dict[Sequence, int] = {}

    def next_token(self, seq: Sequence) -> int:
        key = self.prompt_keys.get(seq)
        if key is None:
            key = self.prompt_keys[seq] = hash(tuple(seq.prompt_token_ids))
        draw = hash((key, len(seq.token_ids))) & 0x7FFFFFFF
        if self.eos_token_id is not None and draw % 1_000_000 < self.eos_threshold:
            return self.eos_token_id
        token = draw % self.vocab_size
        return token + 1 if token == self.eos_token_id else token

    def execute(self, plan: StepPlan) -> dict[Sequence, int]:
        return {seq: self.next_token(seq) for seq in plan.scheduled if plan.samples(seq)}


@dataclass(frozen=True)
class SimRequest:
    arrival_s: float
    prompt_token_ids: list[int]
    params: SamplingParams
    lane: Lane | None = None
    request_id: str = ""
    tenant: str = ""


@dataclass
class SimResult:
    sequences: list[Sequence]
    steps: int = 0
    elapsed_s: float = 0.0
    scheduler_s: float = 0.0  # wall-clock time spent inside schedule() + update()
    decode_tokens: int = 0  # tokens sampled (useful output)
    kv_utilisation_samples: list[float] = field(default_factory=list)
    peak_used_blocks: int = 0
    final_stats: BlockStats | None = None
    # simulated time of each output token, per sequence (its ITL gaps; a preemption shows as a long one)
    token_times: dict[Sequence, list[float]] = field(default_factory=dict)


def simulate(config: SchedulerConfig, num_blocks: int, block_size: int,
             requests: Iterable[SimRequest], model: FakeModel | None = None,
             cost: CostModel | None = None, on_step: Callable[[Scheduler, StepPlan], None] | None = None,
             max_steps: int = 1_000_000, enable_prefix_caching: bool = True,
             sample_kv_every: int = 0, tenants: dict[str, TenantShare] | None = None) -> SimResult:
    """Run requests (sorted by arrival) to completion on simulated time: each step takes what `cost`
    says its turn takes (the scheduler sizes its steps with the same model under an ITL SLO);
    `tenants`: their weights and running caps, as a worker has them from the registry."""
    model, cost = model or FakeModel(), cost or CostModel()
    now = [0.0]
    scheduler = Scheduler(config, BlockPool(num_blocks, block_size, enable_prefix_caching),
                          clock=lambda: now[0], cost=cost)
    scheduler.set_tenants(tenants or {})
    pending = sorted(requests, key=lambda r: r.arrival_s)
    result = SimResult(sequences=[])
    next_request = 0
    while next_request < len(pending) or scheduler.has_work:
        if not scheduler.has_work:
            now[0] = max(now[0], pending[next_request].arrival_s)
        while next_request < len(pending) and pending[next_request].arrival_s <= now[0]:
            request = pending[next_request]
            seq = Sequence(request.request_id or f"r{next_request}", request.prompt_token_ids,
                           request.params, eos_token_ids=model.eos_token_ids, arrival_time=request.arrival_s,
                           tenant=request.tenant)
            result.sequences.append(scheduler.add(seq, request.lane))
            next_request += 1
        started = time.perf_counter()
        plan = scheduler.schedule()
        result.scheduler_s += time.perf_counter() - started
        if on_step is not None:
            on_step(scheduler, plan)
        sampled = model.execute(plan)
        now[0] += cost.step_time(plan) if plan.scheduled else 0.0
        started = time.perf_counter()
        scheduler.update(plan, sampled)
        result.scheduler_s += time.perf_counter() - started
        result.steps += 1
        result.decode_tokens += len(sampled)
        for seq in sampled:
            result.token_times.setdefault(seq, []).append(now[0])
        if sample_kv_every and result.steps % sample_kv_every == 0:
            stats = scheduler.pool.stats(scheduler.running)
            result.kv_utilisation_samples.append(stats.kv_utilisation)
            result.peak_used_blocks = max(result.peak_used_blocks, stats.used)
        if result.steps >= max_steps:
            raise RuntimeError(f"simulation did not drain within {max_steps} steps")
    result.elapsed_s = now[0]
    result.final_stats = scheduler.pool.stats()
    return result
