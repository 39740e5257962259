"""Preemption avalanche: a KV pool pushed past its comfortable load, the watermark and cool-down on and off.

    python -m ops.avalanche [--model smollm2-135m] [--num-blocks 16] [--count 20] [--rate 2]
                            [--prompt-lengths uniform:8,24] [--output-lengths uniform:64,96]
                            [--worker-args "--threads 2"] [--out DIR]

A small pool (--num-blocks) and long outputs arriving faster than they finish: every admission
grows into blocks the pool does not have, and each preemption throws away work that must be
recomputed. The same trace runs on two fresh private workers, one after the other:
  on   the scheduler's defaults: admissions leave --watermark (0.2) of the pool free, and after
       --cooldown-after-steps (3) preempting steps in a row --cooldown-watermark (0.1) more, for
       --calm-steps (32) steps;
  off  --watermark 0 --cooldown-watermark 0: admissions take the pool to the last block, and a
       cool-down raises nothing.
Per run: the preemption rate (the worker's streambatch:num_preemptions_total over its
streambatch:request_success_total, read before and after the run), output tokens/s, P99 ITL and
TTFT, KV usage; a plot (--out DIR: avalanche.png, and avalanche.json); and the brief's triage of
what an operator should do, in its order:
  1. preemption rate above 5%: raise the watermark;
  2. then over-long requests: a share of them needs more than a quarter of the pool (prompt +
     max_tokens), so a handful fill it: cap max_tokens, or give the worker more KV;
  3. then rate-limit at the entrance: requests waited for the worker through most of the run, so
     the producer's max_backlog should refuse what the pool cannot hold instead of queueing it.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import msgspec
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ops.tool import run_tool, wide_console
from ops.load.report import ALL, Report, summarize, to_json
from ops.load.runner import RunResult, private_deployment, run
from ops.load.trace import TraceRequest, generate, offered_rate

OFF = ["--watermark", "0", "--cooldown-watermark", "0"]
MAX_PREEMPTION_RATE = 0.05
LONG_REQUEST_POOL_SHARE = 0.25  # a request needing more than this share of the pool is over-long
MAX_LONG_REQUEST_SHARE = 0.05  # of the requests
SATURATED_WAITING_SHARE = 0.5  # requests waited for the worker in at least this share of the samples
WATERMARK_STEP = 0.1


class Trial(msgspec.Struct):
    """One of the two runs: its flags, what it measured, what to do about it."""
    name: str  # "on" or "off"
    worker_args: list[str]
    watermark: float  # the one the worker ran with
    report: Report
    advice: list[str]


def long_request_share(trace: list[TraceRequest], pool_tokens: int) -> float:
    """Share of the requests whose prompt + max_tokens need more than a quarter of the pool."""
    limit = LONG_REQUEST_POOL_SHARE * pool_tokens
    return sum(len(request.prompt_ids) + request.max_tokens > limit for request in trace) / len(trace)


def advice(preemption_rate: float | None, watermark: float, long_share: float,
           waiting_share: float | None) -> list[str]:
    """The brief's triage, in its order, for what the figures show; empty when none applies."""
    steps = []
    if preemption_rate is not None and preemption_rate > MAX_PREEMPTION_RATE:
        steps.append(f"preemption rate {preemption_rate:.0%} > {MAX_PREEMPTION_RATE:.0%}: raise the watermark "
                     f"(--watermark {watermark:g} -> {min(watermark + WATERMARK_STEP, 0.5):g})")
    if long_share > MAX_LONG_REQUEST_SHARE:
        steps.append(f"over-long requests: {long_share:.0%} of them need more than "
                     f"{LONG_REQUEST_POOL_SHARE:.0%} of the KV pool (prompt + max_tokens): cap max_tokens, "
                     f"or give the worker more KV (--kv-cache-memory, --num-blocks)")
    if waiting_share is not None and waiting_share >= SATURATED_WAITING_SHARE:
        steps.append(f"requests waited for the worker in {waiting_share:.0%} of the samples: rate-limit at the "
                     f"entrance (the producer's max_backlog refuses what the workers cannot hold)")
    return steps


def comparison_table(trials: list[Trial]) -> Table:
    table = Table("", *(f"{trial.name}: {' '.join(trial.worker_args) or 'defaults'}" for trial in trials),
                  title="preemption avalanche: the same trace, watermark and cool-down on and off",
                  title_justify="left")
    rows = [
        ("requests (failed)", lambda r: f"{r.lanes[ALL].requests} ({r.lanes[ALL].failed})"),
        ("preemptions", lambda r: "-" if r.preemptions is None else f"{r.preemptions:.0f}"),
        ("preemption rate", lambda r: _share(r.preemption_rate)),
        ("output tokens/s", lambda r: f"{r.lanes[ALL].output_tokens_per_s:.1f}"),
        ("P99 ITL (s)", lambda r: _seconds(r.lanes[ALL].itl_s.p99)),
        ("P99 TTFT (s)", lambda r: _seconds(r.lanes[ALL].ttft_s.p99)),
        ("KV usage mean / max", lambda r: f"{_share(r.kv_usage_mean)} / {_share(r.kv_usage_max)}"),
        ("waiting share", lambda r: _share(r.waiting_share)),
    ]
    for name, show in rows:
        table.add_row(name, *(show(trial.report) for trial in trials))
    return table


def plot(trials: list[Trial], results: list[RunResult], path: Path) -> Path:
    """Bars of preemption rate, throughput and P99 ITL per run; KV usage over each run."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(16, 4), layout="constrained")
    rate, throughput, itl, usage = figure.subplots(1, 4)
    names, colours = [trial.name for trial in trials], ["tab:green", "tab:red"][:len(trials)]
    reports = [trial.report for trial in trials]
    bars = ((rate, [report.preemption_rate or 0.0 for report in reports], "preemptions / request"),
            (throughput, [report.lanes[ALL].output_tokens_per_s for report in reports], "output tokens/s"),
            (itl, [report.lanes[ALL].itl_s.p99 or 0.0 for report in reports], "P99 ITL (s)"))
    for axis, values, label in bars:
        axis.bar(names, values, color=colours)
        axis.set(ylabel=label, title=label)
        axis.grid(True, axis="y", alpha=0.3)
    rate.axhline(MAX_PREEMPTION_RATE, color="black", linestyle="--", linewidth=1, label="5%: raise the watermark")
    rate.legend(fontsize="small")
    for trial, result, colour in zip(trials, results, colours):
        samples = [(sample.at - result.started, sample.kv_usage) for sample in result.samples
                   if sample.kv_usage is not None]
        usage.plot([at for at, _ in samples], [value for _, value in samples], color=colour,
                   label=f"{trial.name} (watermark {trial.watermark:g})")
    usage.set(xlabel="seconds since the start of the run", ylabel="KV blocks held", title="KV usage", ylim=(0, 1.05))
    usage.grid(True, alpha=0.3)
    usage.legend(fontsize="small")
    figure.suptitle("watermark and cool-down on (defaults) and off (--watermark 0 --cooldown-watermark 0)")
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    return path


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = wide_console(120)
    return run_tool("avalanche", lambda: avalanche(args, console), console)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m ops.avalanche", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--num-blocks", type=int, default=16, help="the workers' KV pool, in blocks")
    parser.add_argument("--worker-args", default="", help="the workers' other flags, as one string")
    parser.add_argument("--count", type=int, default=20, help="requests")
    parser.add_argument("--rate", type=float, default=2.0, help="mean arrivals per second (Poisson)")
    parser.add_argument("--prompt-lengths", default="uniform:8,24", help="prompt tokens (ops/load/trace.py)")
    parser.add_argument("--output-lengths", default="uniform:64,96", help="output tokens (ops/load/trace.py)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take")
    parser.add_argument("--out", type=Path, help="write avalanche.json and avalanche.png here")
    return parser


def avalanche(args, console: Console) -> None:
    from worker.config import parse_config

    trace = generate(args.count, args.rate, seed=args.seed, prompt_lengths=args.prompt_lengths,
                     output_lengths=args.output_lengths)
    common = [*shlex.split(args.worker_args), "--num-blocks", str(args.num_blocks)]
    trials, results = [], []
    for name, flags in (("on", []), ("off", OFF)):
        worker_args = [*common, *flags]
        engine = parse_config(["--model", args.model, *worker_args]).engine
        pool_tokens = engine.num_blocks * engine.block_size
        console.rule(f"{name}: {len(trace)} requests at {offered_rate(trace):.2f} req/s, a pool of "
                     f"{engine.num_blocks} blocks ({pool_tokens} tokens), {' '.join(flags) or 'defaults'}")
        with private_deployment(worker_args, args.model, console=console) as (url, metrics_url):
            results.append(run(trace, url, timeout=args.timeout, metrics_urls=[metrics_url], console=console))
        report = summarize(results[-1])
        trials.append(Trial(name, flags, engine.scheduler.watermark, report,
                        advice(report.preemption_rate, engine.scheduler.watermark,
                               long_request_share(trace, pool_tokens), report.waiting_share)))
    console.print(comparison_table(trials))
    for trial in trials:
        console.print(f"[bold]advice for {trial.name}[/] (watermark {trial.watermark:g}):")
        for number, step in enumerate(trial.advice or ["none: preemptions are rare and the worker keeps up"], 1):
            console.print(f"  {number}. {escape(step)}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "avalanche.json").write_bytes(to_json(trials))
        console.print(f"wrote {args.out / 'avalanche.json'}, {plot(trials, results, args.out / 'avalanche.png')}")


if __name__ == "__main__":
    sys.exit(main())
