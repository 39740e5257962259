"""Scheduler benchmark on the simulated executor (no model, no GPU).

Prints, measured side by side in one run:
  1. scheduler wall time per step at 64 / 256 / 1,024 running sequences, and its share
     of the simulated step time;
  2. slot utilisation, throughput and latency, continuous vs static, heavy-tailed outputs;
  3. KV utilisation of the paged pool vs reserving max length per request;
  4. fast-lane protection: reserve vs preempt vs none, under a normal-lane flood;
  5. block size: KV utilisation and scheduler cost for 8 .. 64.

    python -m ops.bench_scheduler [--quick] [--seed N]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from rich.console import Console
from rich.table import Table

from ops.percentile import percentile
from producer.protocol import SamplingParams
from worker.engine.blocks import BlockPool
from worker.engine.cost_model import CostModel
from worker.engine.scheduler import Scheduler
from worker.engine.scheduler_config import SchedulerConfig
from worker.engine.sequence import Sequence
from worker.engine.simulator import FakeModel, SimRequest, simulate

console = Console(width=150)


def heavy_tailed_requests(rng: random.Random, count: int, rate_per_s: float | None,
                          fast_share: float = 0.0) -> list[SimRequest]:
    """Prompts 20-1,000 tokens; outputs lognormal (median ~60, P99 > 10x mean); Poisson
    arrivals at `rate_per_s`, or all at once when None."""
    requests, now = [], 0.0
    for i in range(count):
        now += rng.expovariate(rate_per_s) if rate_per_s else 0.0
        fast = rng.random() < fast_share
        prompt_len = rng.randint(20, 200) if fast else rng.randint(20, 1000)
        max_tokens = rng.randint(8, 64) if fast else min(2000, int(rng.lognormvariate(4.1, 1.2)) + 1)
        prompt = [rng.randrange(32000) for _ in range(prompt_len)]
        requests.append(SimRequest(now, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                                   "fast" if fast else "normal", f"r{i}"))
    return requests


def overhead_table(sizes: list[int], steps: int) -> Table:
    table = Table(title="1. Scheduler time per step (schedule + update), steady decode")
    for column in ("running seqs", "µs / step", "µs / seq", "simulated step ms", "share of step"):
        table.add_column(column, justify="right")
    cost, model = CostModel(), FakeModel()
    for size in sizes:
        scheduler = Scheduler(SchedulerConfig(token_budget=max(2048, size), max_model_len=1 << 20),
                              BlockPool(size * 200, 16))
        rng = random.Random(size)
        for i in range(size):
            prompt = [rng.randrange(32000) for _ in range(rng.randint(100, 1000))]
            scheduler.add(Sequence(f"r{i}", prompt, SamplingParams(max_tokens=100_000, ignore_eos=True)))
        while scheduler.num_waiting or any(not s.is_decoding for s in scheduler.running):
            plan = scheduler.schedule()
            scheduler.update(plan, model.execute(plan))
        spent, simulated = 0.0, 0.0
        for _ in range(steps):
            started = time.perf_counter()
            plan = scheduler.schedule()
            middle = time.perf_counter()
            sampled = model.execute(plan)
            resumed = time.perf_counter()
            scheduler.update(plan, sampled)
            spent += (middle - started) + (time.perf_counter() - resumed)
            simulated += cost.step_time(plan)
        per_step = spent / steps
        table.add_row(str(size), f"{per_step * 1e6:,.0f}", f"{per_step * 1e6 / size:.2f}",
                      f"{simulated / steps * 1e3:.1f}", f"{per_step / (simulated / steps):.2%}")
    return table


def policy_table(rng_seed: int, count: int) -> Table:
    table = Table(title=f"2. Continuous vs static, {count} heavy-tailed requests, 32 slots (max_num_seqs)")
    for column in ("policy", "arrivals", "slot use while backlogged", "slot use overall", "tokens / sim s",
                   "e2e P50 s", "e2e P99 s", "TTFT P99 s"):
        table.add_column(column, justify="right")
    backlog = heavy_tailed_requests(random.Random(rng_seed), count, None)
    mean_out = statistics.mean(r.params.max_tokens for r in backlog)
    p99_out = percentile([r.params.max_tokens for r in backlog], 0.99)
    table.caption = (f"output tokens: mean {mean_out:.0f}, P99 {p99_out:.0f} ({p99_out / mean_out:.1f}x mean); "
                     "Poisson arrivals at 70% of the rate continuous sustains on the backlog")
    rate = None
    for label in ("backlog", "Poisson"):
        requests = backlog if label == "backlog" else heavy_tailed_requests(random.Random(rng_seed), count, rate)
        for policy in ("continuous", "static"):
            backlogged = []  # decodes per step while requests wait
            result = simulate(SchedulerConfig(policy=policy, max_num_seqs=32), 20_000, 16, requests,
                              on_step=lambda s, plan: s.num_waiting and backlogged.append(len(plan.scheduled)))
            throughput = result.decode_tokens / result.elapsed_s
            rate = rate or 0.7 * throughput / mean_out
            e2e = [s.finish_time - s.arrival_time for s in result.sequences]
            ttft = [s.first_token_time - s.arrival_time for s in result.sequences]
            busy = f"{sum(backlogged) / (32 * len(backlogged)):.1%}" if backlogged else "never backlogged"
            table.add_row(policy, label, busy, f"{result.decode_tokens / (32 * result.steps):.1%}",
                          f"{throughput:,.0f}", f"{percentile(e2e, 0.5):.2f}", f"{percentile(e2e, 0.99):.2f}",
                          f"{percentile(ttft, 0.99):.2f}")
    return table


def kv_table(rng_seed: int, count: int) -> Table:
    table = Table(title="3. KV utilisation (tokens stored / slots held), every step, same run")
    for column in ("allocation", "mean", "min", "peak blocks used"):
        table.add_column(column, justify="right")
    contiguous = []

    def sample(scheduler, plan):  # after schedule: count what this step writes as stored
        if scheduler.running:
            stored = sum(s.num_computed_tokens + plan.scheduled.get(s, 0) for s in scheduler.running)
            held = sum(s.num_prompt_tokens + s.params.max_tokens for s in scheduler.running)
            contiguous.append(stored / held)
    requests = heavy_tailed_requests(random.Random(rng_seed), count, None)
    result = simulate(SchedulerConfig(max_num_seqs=64), 5_000, 16, requests, on_step=sample,
                      sample_kv_every=1)
    paged = result.kv_utilisation_samples
    table.add_row("paged, 16-token blocks", f"{statistics.mean(paged):.1%}", f"{min(paged):.1%}",
                  str(result.peak_used_blocks))
    table.add_row("contiguous, prompt + max_tokens reserved", f"{statistics.mean(contiguous):.1%}",
                  f"{min(contiguous):.1%}", "-")
    return table


def fast_lane_table(rng_seed: int, count: int) -> Table:
    table = Table(title="4. Fast-lane protection under a normal-lane flood (pool 1,500 blocks)")
    for column in ("protection", "fast TTFT P50 ms", "fast TTFT P99 ms", "normal TTFT P99 s",
                   "tokens / sim s", "preemptions / request"):
        table.add_column(column, justify="right")
    requests = heavy_tailed_requests(random.Random(rng_seed), count, 60.0, fast_share=0.3)
    for protection in ("none", "reserve", "preempt"):
        result = simulate(SchedulerConfig(fast_lane_protection=protection), 1_500, 16, requests)
        fast = [s.first_token_time - s.arrival_time for s in result.sequences if s.lane == "fast"]
        normal = [s.first_token_time - s.arrival_time for s in result.sequences if s.lane == "normal"]
        preemptions = sum(s.num_preemptions for s in result.sequences)
        table.add_row(protection, f"{percentile(fast, 0.5) * 1e3:.0f}", f"{percentile(fast, 0.99) * 1e3:.0f}",
                      f"{percentile(normal, 0.99):.2f}", f"{result.decode_tokens / result.elapsed_s:,.0f}",
                      f"{preemptions / len(requests):.1%}")
    return table


def block_size_table(rng_seed: int, count: int) -> Table:
    table = Table(title="5. Block size trade-off (same workload, same KV capacity in tokens)")
    for column in ("block size", "KV utilisation", "scheduler µs / step", "preemptions", "tokens / sim s"):
        table.add_column(column, justify="right")
    requests = heavy_tailed_requests(random.Random(rng_seed), count, None)
    for block_size in (8, 16, 32, 64):
        result = simulate(SchedulerConfig(max_num_seqs=64), 80_000 // block_size, block_size, requests,
                          sample_kv_every=1)
        table.add_row(str(block_size), f"{statistics.mean(result.kv_utilisation_samples):.1%}",
                      f"{result.scheduler_s / result.steps * 1e6:.0f}",
                      str(sum(s.num_preemptions for s in result.sequences)),
                      f"{result.decode_tokens / result.elapsed_s:,.0f}")
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller workloads (about 20 s)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    count = 300 if args.quick else 1500
    console.print(overhead_table([64, 256, 1024], steps=50 if args.quick else 200))
    console.print(policy_table(args.seed, count))
    console.print(kv_table(args.seed, count // 2))
    console.print(fast_lane_table(args.seed, count))
    console.print(block_size_table(args.seed, count // 2))


if __name__ == "__main__":
    main()
