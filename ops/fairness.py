"""python -m ops.fairness: two tenants through a real worker, fair (vtc) against FIFO, in one run.

    python -m ops.fairness [--quiet-rate 0.4] [--flood-factor 30] [--duration 30] [--itl-slo-ms 100]
                           [--model random:smollm2] [--plot fairness.png] [--json F]

Starts a private redis-server and registers two tenants, `quiet` and `flood`; then, for the quiet
tenant alone and for both tenants under each fairness policy (a worker process started afresh with
`--fairness vtc` and then `fifo`), sends Poisson arrivals for --duration seconds (the flood tenant at
--flood-factor times the quiet one's rate: past the worker's capacity) through each tenant's own
producer, and follows every request live. The workers run under an ITL SLO (--itl-slo-ms, 0: none):
without one a CPU worker admits the whole flood at once and every step slows with its batch, so
that the order of admissions, which fairness decides, hardly matters to anyone's TTFT. It prints, per policy and tenant, the requests served,
P50 / P99 TTFT, and each tenant's share of the tokens; and the quiet tenant's P99 TTFT against
what it gets alone. The plot shows each tenant's output tokens per second over time, per policy,
and the P99 TTFTs. Every request's record (tenant, arrival, first token, finish, tokens) goes in
the --json file.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from matplotlib.figure import Figure
from rich.console import Console
from rich.table import Table

from ops.demo import redis_at, redis_client, running_process, wait_until_ready
from ops.percentile import percentile
from ops.tool import ToolError, run_tool
from producer import AsyncProducer, SamplingParams, TokenEvent
from producer.protocol import ErrorEvent, Keys
from producer.tenants import TenantRegistry

TENANTS = ("quiet", "flood")
PROMPT_TOKENS, OUTPUT_TOKENS = 48, 64
RUNS = (("quiet alone", "vtc", ("quiet",)), ("fair (vtc)", "vtc", TENANTS), ("fifo", "fifo", TENANTS))


@dataclass
class Record:
    tenant: str
    arrival: float  # seconds from the run's start
    request_id: str = ""
    first_token: float | None = None
    finish: float | None = None
    tokens: list[float] = field(default_factory=list)  # each token event's time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ops.fairness", description=__doc__.split("\n")[0])
    parser.add_argument("--quiet-rate", type=float, default=0.4, help="the quiet tenant's requests per second")
    parser.add_argument("--flood-factor", type=float, default=30.0, help="the flood tenant's rate, in quiet rates")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per run")
    parser.add_argument("--itl-slo-ms", type=float, default=100.0, help="the workers' ITL SLO (0: none)")
    parser.add_argument("--model", default="random:smollm2", help="the worker's model")
    parser.add_argument("--worker-args", default="", help="the worker's other flags, as one string")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", type=Path, default=Path("fairness.png"))
    parser.add_argument("--json", type=Path, help="every figure and request record")
    args = parser.parse_args(argv)
    console = Console()
    return run_tool("fairness", lambda: measure(args, console), console)


def measure(args: argparse.Namespace, console: Console) -> None:
    runs: dict[str, list[Record]] = {}
    with tempfile.TemporaryDirectory(prefix="streambatch-fairness-") as scratch, contextlib.ExitStack() as stack:
        url = stack.enter_context(redis_at(None, Path(scratch), console))
        registry = TenantRegistry(redis_client(url), Keys())
        for tenant in TENANTS:
            registry.add(tenant)
        for name, policy, tenants in RUNS:
            log = Path(scratch) / f"worker-{policy}-{len(tenants)}.log"
            command = [sys.executable, "-m", "worker", "--model", args.model, "--name", f"fair-{len(runs)}",
                       "--fairness", policy, *args.worker_args.split()]
            if args.itl_slo_ms:
                command += ["--itl-slo-ms", str(args.itl_slo_ms)]
            with running_process(command, log, url) as worker:
                wait_until_ready(url, f"fair-{len(runs)}", worker, log, 600, console)
                console.print(f"[bold]{name}:[/] {args.duration:.0f} s of arrivals")
                runs[name] = asyncio.run(_trace(url, args, tenants))
    figures = _figures(runs)
    console.print(_table(figures))
    _plot(runs, figures, args.plot)
    console.print(f"plot: {args.plot}")
    if args.json is not None:
        args.json.write_text(json.dumps({"figures": figures, "requests": {name: [asdict(record) for record in records]
                                                                         for name, records in runs.items()}}))


async def _trace(url: str, args: argparse.Namespace, tenants: tuple[str, ...]) -> list[Record]:
    """Poisson arrivals per tenant, each request followed live; -> every request's record."""
    rng = random.Random(args.seed)
    rates = {"quiet": args.quiet_rate, "flood": args.quiet_rate * args.flood_factor}
    arrivals = sorted((at, tenant) for tenant in tenants for at in _poisson(rng, rates[tenant], args.duration))
    records: list[Record] = []
    started = time.monotonic()
    async with AsyncProducer(url) as producer:
        producers = {tenant: producer.as_tenant(tenant) for tenant in tenants}

        async def one(at: float, tenant: str) -> None:
            await asyncio.sleep(max(0.0, at - (time.monotonic() - started)))
            record = Record(tenant, time.monotonic() - started)
            records.append(record)
            prompt = [rng.randrange(2, 500) for _ in range(PROMPT_TOKENS)]  # ids any model here has
            handle = await producers[tenant].submit(prompt_ids=prompt, lane="normal", params=SamplingParams(
                max_tokens=OUTPUT_TOKENS, temperature=0, ignore_eos=True))
            record.request_id = handle.id
            async for event in handle.stream():
                now = time.monotonic() - started
                if isinstance(event, TokenEvent):
                    record.first_token = record.first_token if record.first_token is not None else now
                    record.tokens.append(now)
                elif isinstance(event, ErrorEvent):
                    raise ToolError(f"a {tenant} request failed: {event.code}: {event.message}")
            record.finish = time.monotonic() - started

        await asyncio.gather(*(one(at, tenant) for at, tenant in arrivals))
    return records


def _poisson(rng: random.Random, rate: float, duration: float) -> list[float]:
    times, now = [], 0.0
    while (now := now + rng.expovariate(rate)) < duration:
        times.append(now)
    return times


def _figures(runs: dict[str, list[Record]]) -> dict:
    figures: dict = {}
    for name, records in runs.items():
        tokens = {tenant: sum(len(r.tokens) for r in records if r.tenant == tenant) for tenant in TENANTS}
        total = sum(tokens.values()) or 1
        for tenant in TENANTS:
            mine = [r for r in records if r.tenant == tenant]
            if not mine:
                continue
            ttfts = [r.first_token - r.arrival for r in mine if r.first_token is not None]
            figures.setdefault(name, {})[tenant] = {
                "requests": len(mine), "p50_ttft_s": round(percentile(ttfts, 0.5) or 0, 3),
                "p99_ttft_s": round(percentile(ttfts, 0.99) or 0, 3), "token_share": round(tokens[tenant] / total, 3)}
    alone = figures["quiet alone"]["quiet"]["p99_ttft_s"] or 1e-9
    figures["quiet_p99_ttft_vs_alone"] = {name: round(figures[name]["quiet"]["p99_ttft_s"] / alone, 2)
                                          for name in ("fair (vtc)", "fifo")}
    return figures


def _table(figures: dict) -> Table:
    table = Table("run", "tenant", "requests", "TTFT P50 / P99", "token share",
                  title="fair (vtc) vs FIFO between tenants, one worker")
    for name, _, _ in RUNS:
        for tenant, row in figures[name].items():
            table.add_row(name, tenant, str(row["requests"]), f"{row['p50_ttft_s']:.2f} / {row['p99_ttft_s']:.2f} s",
                          f"{row['token_share']:.0%}")
    ratios = figures["quiet_p99_ttft_vs_alone"]
    table.caption = (f"the quiet tenant's P99 TTFT against alone: {ratios['fair (vtc)']}x fair, "
                     f"{ratios['fifo']}x FIFO")
    return table


def _plot(runs: dict[str, list[Record]], figures: dict, path: Path) -> None:
    figure = Figure(figsize=(14, 4.5), layout="constrained")
    axes = figure.subplots(1, 3)
    for axis, name in zip(axes, ("fair (vtc)", "fifo")):
        for tenant, colour in zip(TENANTS, ("tab:green", "tab:red")):
            times = [at for record in runs[name] if record.tenant == tenant for at in record.tokens]
            if times:
                seconds = int(max(times)) + 1
                counts = [0] * seconds
                for at in times:
                    counts[int(at)] += 1
                axis.plot(range(seconds), counts, color=colour, label=tenant)
        axis.set(title=f"{name}: output tokens per second", xlabel="seconds", ylabel="tokens/s")
        axis.legend()
        axis.grid(True, alpha=0.3)
    names = [name for name, _, _ in RUNS]
    for offset, (tenant, colour) in enumerate(zip(TENANTS, ("tab:green", "tab:red"))):
        values = [figures[name].get(tenant, {}).get("p99_ttft_s", 0) for name in names]
        axes[2].bar([i + 0.4 * offset for i in range(len(names))], values, width=0.4, color=colour, label=tenant)
    axes[2].set(title="P99 TTFT (s)", xticks=[i + 0.2 for i in range(len(names))], xticklabels=names, yscale="log")
    axes[2].legend()
    figure.savefig(path)


if __name__ == "__main__":
    sys.exit(main())
