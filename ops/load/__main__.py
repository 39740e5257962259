"""Load generator and SLO report: drive a trace through producer -> Redis -> worker -> streams.

    python -m ops.load trace --out trace.jsonl [trace options]        write a generated trace
    python -m ops.load run [trace options | --trace FILE] [target]    one run: table, JSON, plots
    python -m ops.load sweep --rates 1,2,4 [...]                      the same trace at several loads
    python -m ops.load compare [trace options] [--model M]            continuous vs static (compare.py)
    python -m ops.load slo --itl-slo-ms MS [trace options] [--model M]  the ITL SLO against none (slo.py)
    python -m ops.load gateway [trace options] [--model M]            each request direct and through the gateway

The target is a live deployment (--redis-url, with --metrics-url per worker for its counters) or,
without --redis-url, a private one started for the run: a redis-server and one worker on --model
with --worker-args. A sweep or a comparison starts a fresh private worker for every run, so that no
run finds the prompts of the one before in the prefix cache (against a live deployment they may).
--out DIR writes the report(s) as JSON and the PNG plots there, and beside each report its requests
as JSON lines (<run>.requests.jsonl: arrival, first token, finish, every token event, tokens, lane;
seconds from the run's start), from which every figure can be recomputed.

The default trace is sized for a 2-core CPU on the bundled smollm2-135m (a comparison takes three to
six minutes): 80 requests, a fifth of them in the fast lane, normal-lane prompts and outputs
lognormal (outputs up to 256 tokens, mean about 47), Poisson arrivals at 6 req/s. With the
comparison's worker flags (16 seats) a worker sustains 5-7 req/s of it on the continuous policy (AVX2
or AVX-512 machines) and about half that on the static one: --saturated-rate 16 is well above both,
and unless --rate is given the comparison offers both policies 80% (--load-share) of what the static
worker sustained (so that both deliver the same throughput), and `slo` offers 80% of what the worker
without an SLO sustained. `--model random:llama --count 12` makes a quick run (the tests' way).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import re
import shlex
import sys
import tempfile
from pathlib import Path

import msgspec
from rich.console import Console
from rich.table import Table

from ops.demo import running_gateway, use_cluster_option
from ops.tool import run_tool
from ops.load.compare import LOAD_SHARE, capacity, compare, comparison_table
from ops.load.report import ALL, report_table, summarize, sweep_table, to_json, write_requests
from ops.load.runner import RunResult, private_deployment, run
from ops.load.slo import compare_slo, slo_table
from ops.load.trace import TOKEN_IDS, at_rate, generate, offered_rate, read_trace, write_trace
from producer.connect import add_cluster_flag

# What every run of a comparison gives the worker besides --policy (or --itl-slo-ms): seats for a
# static batch of 16 and room in the engine's queue to form it, and a token budget that keeps a
# step with a prefill chunk in it short.
COMPARE_WORKER_ARGS = "--max-num-seqs 16 --intake-ahead 16 --token-budget 512"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if hasattr(args, "redis_cluster"):
        use_cluster_option(parser, args)
    console = Console()
    return run_tool("load", lambda: args.command(args, console), console)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m ops.load", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(required=True)
    # Each command gets option parsers of its own: argparse shares a parent's option objects
    # between its children, so one child's set_defaults would change the others' defaults.
    command = commands.add_parser("trace", parents=[trace_options()], help="write a generated trace as JSONL")
    command.add_argument("--out", type=Path, required=True, help="the JSONL file")
    command.set_defaults(command=trace_command)
    command = commands.add_parser("run", parents=[trace_options(), target_options(), run_options()],
                                  help="one run, reported")
    command.set_defaults(command=run_command)
    command = commands.add_parser("sweep", parents=[trace_options(), target_options(), run_options()],
                                  help="the trace at several loads")
    command.add_argument("--rates", required=True, type=lambda text: [float(rate) for rate in text.split(",")],
                         help="offered loads in requests/s, comma-separated")
    command.set_defaults(command=sweep_command)
    compare_rate = "mean arrivals per second of the policies' runs (default: --load-share of the measured capacity)"
    command = commands.add_parser("compare", parents=[trace_options(rate=None, rate_help=compare_rate),
                                                      target_options(COMPARE_WORKER_ARGS), run_options()],
                                  help="continuous vs static")
    command.add_argument("--saturated-rate", type=float, default=16.0,
                         help="offered load of the fast-lane runs: above what the worker sustains")
    command.add_argument("--load-share", type=float, default=LOAD_SHARE,
                         help="without --rate: the policies' offered load as a share of the static worker's "
                              "capacity, measured in a saturated run")
    command.set_defaults(command=compare_command)
    slo_rate = "mean arrivals per second of the runs with and without the SLO (default: --load-share of the capacity)"
    command = commands.add_parser("slo", parents=[trace_options(rate=None, rate_help=slo_rate),
                                                  target_options(COMPARE_WORKER_ARGS), run_options()],
                                  help="the worker with --itl-slo-ms against without, at the same load")
    command.add_argument("--itl-slo-ms", type=float, required=True, help="the worker's ITL SLO, milliseconds")
    command.add_argument("--saturated-rate", type=float, default=16.0,
                         help="offered load of the run that measures the capacity: above what the worker sustains")
    command.add_argument("--load-share", type=float, default=LOAD_SHARE,
                         help="without --rate: the offered load as a share of the capacity without the SLO")
    command.set_defaults(command=slo_command)
    command = commands.add_parser("gateway", parents=[trace_options(), target_options(), run_options()],
                                  help="each request twice at once, through the producer and through the OpenAI gateway: ratios")
    command.set_defaults(command=gateway_command)
    return parser


def trace_options(rate: float | None = 6.0, rate_help: str = "mean arrivals per second") -> argparse.ArgumentParser:
    options = argparse.ArgumentParser(add_help=False)
    group = options.add_argument_group("trace (ops/load/trace.py)")
    group.add_argument("--trace", type=Path, help="replay this JSONL trace instead of generating one")
    group.add_argument("--count", type=int, default=80, help="requests")
    group.add_argument("--rate", type=float, default=rate, help=rate_help)
    group.add_argument("--seed", type=int, default=0)
    group.add_argument("--arrivals", choices=("poisson", "bursty"), default="poisson")
    group.add_argument("--peak-to-trough", type=float, default=10.0, help="bursty: peak rate / trough rate")
    group.add_argument("--burst-period", type=float, default=10.0, help="bursty: seconds of one on/off cycle")
    group.add_argument("--burst-on-share", type=float, default=0.25, help="bursty: share of a cycle at the peak")
    group.add_argument("--prompt-lengths", default="lognormal:64,0.8,512", help="normal lane's prompt tokens")
    group.add_argument("--output-lengths", default="lognormal:24,1.2,256", help="normal lane's output tokens")
    group.add_argument("--fast-share", type=float, default=0.2, help="share of requests in the fast lane")
    group.add_argument("--fast-prompt-lengths", default="uniform:8,32")
    group.add_argument("--fast-output-lengths", default="uniform:4,12")
    group.add_argument("--shared-prefix-share", type=float, default=0.0,
                       help="share of requests that start with a shared system prompt")
    group.add_argument("--shared-prefix-tokens", type=int, default=64)
    group.add_argument("--num-prefixes", type=int, default=1, help="distinct shared system prompts")
    return options


def target_options(worker_args: str = "") -> argparse.ArgumentParser:
    options = argparse.ArgumentParser(add_help=False)
    group = options.add_argument_group("target")
    group.add_argument("--redis-url", help="a live deployment (default: a private one)")
    add_cluster_flag(group)
    group.add_argument("--metrics-url", action="append", default=[],
                       help="a live worker's /metrics URL, for its counters (repeat per worker)")
    group.add_argument("--prefix", default="sb", help="key prefix of the live deployment")
    group.add_argument("--model", default="smollm2-135m", help="the private worker's model")
    group.add_argument("--worker-args", default=worker_args, help="the private worker's other flags, as one string (default: %(default)r)")
    return options


def run_options() -> argparse.ArgumentParser:
    options = argparse.ArgumentParser(add_help=False)
    group = options.add_argument_group("run")
    group.add_argument("--concurrency", type=int, help="closed loop with this many clients (arrivals ignored)")
    group.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take")
    group.add_argument("--out", type=Path, help="write JSON reports and PNG plots to this directory")
    return options


def trace_of(args) -> list:
    if args.trace is not None:
        return read_trace(args.trace)
    return generate(args.count, args.rate or 1.0, seed=args.seed, arrivals=args.arrivals, peak_to_trough=args.peak_to_trough,
                    burst_period_s=args.burst_period, burst_on_share=args.burst_on_share,
                    prompt_lengths=args.prompt_lengths, output_lengths=args.output_lengths,
                    fast_share=args.fast_share, fast_prompt_lengths=args.fast_prompt_lengths,
                    fast_output_lengths=args.fast_output_lengths, shared_prefix_share=args.shared_prefix_share,
                    shared_prefix_tokens=args.shared_prefix_tokens, num_prefixes=args.num_prefixes)


def trace_command(args, console: Console) -> None:
    trace = trace_of(args)
    write_trace(args.out, trace)
    console.print(f"{len(trace)} requests, {offered_rate(trace):.2f} req/s offered -> {args.out}")


def run_on_target(args, trace: list, console: Console, worker_args: list[str] = ()) -> RunResult:
    """One run on the live deployment, or on a fresh private one (with `worker_args` added)."""
    if args.redis_url is not None:
        return run(trace, args.redis_url, concurrency=args.concurrency, timeout=args.timeout,
                   metrics_urls=args.metrics_url, prefix=args.prefix, console=console)
    with private_deployment([*shlex.split(args.worker_args), *worker_args], args.model,
                            console=console) as (url, metrics_url):
        return run(trace, url, concurrency=args.concurrency, timeout=args.timeout, metrics_urls=[metrics_url],
                   console=console)


def run_command(args, console: Console) -> None:
    result = run_on_target(args, trace_of(args), console)
    report = summarize(result)
    console.print(report_table(report))
    if args.out is not None:
        from ops.load import plots  # matplotlib only when plotting

        written = [_write(args.out / "report.json", to_json(report)),
                   write_requests(args.out / "run.requests.jsonl", result),
                   plots.latency_cdfs({"run": result}, args.out / "latency_cdfs.png"),
                   plots.token_timeline({"run": result}, args.out / "token_timeline.png")]
        _say_written(console, written)


def sweep_command(args, console: Console) -> None:
    if args.concurrency is not None:
        raise ValueError("a sweep varies the offered load of an open loop: drop --concurrency")
    trace = trace_of(args)
    reports, results = [], {}
    for rate in args.rates:
        console.rule(f"{rate:g} req/s")
        results[f"{rate:g}"] = run_on_target(args, at_rate(trace, rate / offered_rate(trace)), console)
        reports.append(summarize(results[f"{rate:g}"]))
        console.print(report_table(reports[-1], f"{rate:g} req/s"))
    console.print(sweep_table(reports))
    if args.out is not None:
        from ops.load import plots

        _say_written(console, [_write(args.out / "sweep.json", to_json(reports)),
                               plots.load_curve(reports, args.out / "load_curve.png"),
                               *_write_requests(args.out, results)])


class Phases:
    """Runs of a comparison on fresh private workers, each reported as it ends."""

    def __init__(self, args, console: Console) -> None:
        self.args, self.console = args, console
        self.results: dict[str, RunResult] = {}
        self.reports: dict = {}

    def run(self, name: str, requests: list, worker_args: list[str]) -> None:
        self.console.rule(f"{name}: {len(requests)} requests at {offered_rate(requests):.2f} req/s, "
                          f"{' '.join(worker_args)}")
        self.results[name] = run_on_target(self.args, requests, self.console, worker_args)
        self.reports[name] = summarize(self.results[name])
        self.console.print(report_table(self.reports[name], name))

    def at_share_of_capacity(self, trace: list, saturated: str, what: str) -> list:
        """The trace at --rate, or at --load-share of the capacity the `saturated` run measured."""
        if self.args.rate is not None:
            return trace
        measured = capacity(self.reports[saturated])
        rate = self.args.load_share * measured
        self.console.print(f"capacity of {what}: {measured:.2f} req/s; compared at {self.args.load_share:.0%} of it, "
                           f"{rate:.2f} req/s")
        return at_rate(trace, rate / offered_rate(trace))

    def write(self, name: str, summary, plotted: tuple[str, ...]) -> None:
        from ops.load import plots

        side_by_side = {run: self.results[run] for run in plotted}
        _say_written(self.console, [_write(self.args.out / f"{name}.json", to_json({"runs": self.reports} | summary)),
                                    plots.latency_cdfs(side_by_side, self.args.out / "latency_cdfs.png"),
                                    plots.token_timeline(side_by_side, self.args.out / "token_timeline.png"),
                                    *_write_requests(self.args.out, self.results)])


def compare_command(args, console: Console) -> None:
    if args.redis_url is not None or args.concurrency is not None:
        raise ValueError("compare starts its own workers (one per policy) and sets the offered load: "
                         "drop --redis-url and --concurrency")
    trace = trace_of(args)
    saturated = at_rate(trace, args.saturated_rate / offered_rate(trace))
    phases = Phases(args, console)
    phases.run("saturated", saturated, ["--policy", "continuous"])
    phases.run("saturated, normal lane alone", [r for r in saturated if r.lane != "fast"], ["--policy", "continuous"])
    phases.run("static, saturated", saturated, ["--policy", "static"])
    trace = phases.at_share_of_capacity(trace, "static, saturated", "the static worker")
    phases.run("continuous", trace, ["--policy", "continuous"])
    phases.run("static", trace, ["--policy", "static"])
    reports = phases.reports
    comparison = compare(reports["continuous"], reports["static"], reports["saturated"],
                         reports["saturated, normal lane alone"])
    console.print(comparison_table(comparison))
    if args.out is not None:
        phases.write("compare", {"comparison": comparison}, ("continuous", "static"))


def slo_command(args, console: Console) -> None:
    if args.redis_url is not None or args.concurrency is not None:
        raise ValueError("slo starts its own workers (with and without the SLO) and sets the offered load: "
                         "drop --redis-url and --concurrency")
    trace = trace_of(args)
    phases = Phases(args, console)
    if args.rate is None:  # the capacity the load is a share of
        phases.run("saturated", at_rate(trace, args.saturated_rate / offered_rate(trace)), [])
        trace = phases.at_share_of_capacity(trace, "saturated", "the worker without an SLO")
    phases.run("no SLO", trace, [])
    phases.run("SLO", trace, ["--itl-slo-ms", f"{args.itl_slo_ms:g}"])
    comparison = compare_slo(phases.reports["no SLO"], phases.reports["SLO"], args.itl_slo_ms / 1e3)
    console.print(slo_table(comparison))
    if args.out is not None:
        phases.write("slo", {"comparison": comparison}, ("no SLO", "SLO"))


def gateway_command(args, console: Console) -> None:
    """Each request of the trace twice, at the same moment, on a fresh private worker with a
    gateway beside it: once through the producer and once through the gateway (its first token
    moved to another id, so that neither copy finds the other's blocks in the prefix cache), at
    half the trace's rate each, so that the worker sees the trace's offered load. Both paths run
    in the same minutes of the same machine on the same lengths: the gateway's price as ratios."""
    if args.redis_url is not None:
        raise ValueError("gateway starts its own worker and gateway: drop --redis-url")
    trace = [twin for request in at_rate(trace_of(args), 0.5) for twin in (_moved(request), request)]
    with tempfile.TemporaryDirectory(prefix="streambatch-load-gateway-") as scratch, contextlib.ExitStack() as stack, \
            private_deployment(shlex.split(args.worker_args), args.model, console=console) as (url, metrics_url):
        gateway_url = running_gateway(stack, url, Path(scratch))[1]
        result = run(trace, url, concurrency=args.concurrency, timeout=args.timeout, metrics_urls=[metrics_url],
                     console=console, gateway_url=gateway_url, gateway_every=2)
    reports = {}
    for via, name in (("producer", "direct"), ("gateway", "gateway")):
        requests = [record for record in result.requests if record.via == via]
        share = len(requests) / len(result.requests)
        reports[name] = summarize(dataclasses.replace(result, requests=requests, total=len(requests),
                                                      offered_rate=result.offered_rate and result.offered_rate * share))
        console.print(report_table(reports[name], name))
    console.print(gateway_table(reports["direct"], reports["gateway"]))
    if args.out is not None:
        _say_written(console, [_write(args.out / "gateway.json", to_json(reports)),
                               write_requests(args.out / "gateway.requests.jsonl", result)])


def _moved(request):
    """The request with another first token id (one of the generated traces' ids)."""
    first = request.prompt_ids[0] + 1 if request.prompt_ids[0] + 1 in TOKEN_IDS else TOKEN_IDS[0]
    return msgspec.structs.replace(request, prompt_ids=[first, *request.prompt_ids[1:]])


def gateway_table(direct, gateway) -> Table:
    """Gateway / direct, all lanes: throughput, and TTFT and ITL at P50 and P99."""
    table = Table("", "direct", "gateway", "gateway / direct", title="direct vs through the gateway",
                  title_justify="left")
    mine, theirs = direct.lanes[ALL], gateway.lanes[ALL]
    rows = [("output tokens/s", mine.output_tokens_per_s, theirs.output_tokens_per_s, 1.0),
            ("P50 TTFT", mine.ttft_s.p50, theirs.ttft_s.p50, 1e3), ("P99 TTFT", mine.ttft_s.p99, theirs.ttft_s.p99, 1e3),
            ("P50 ITL", mine.itl_s.p50, theirs.itl_s.p50, 1e3), ("P99 ITL", mine.itl_s.p99, theirs.itl_s.p99, 1e3)]
    for name, left, right, scale in rows:
        unit = "" if scale == 1.0 else " ms"
        shown = [f"{value * scale:.1f}{unit}" if value is not None else "-" for value in (left, right)]
        table.add_row(name, *shown, f"{right / left:.3f}x" if left and right is not None else "-")
    table.add_row("finished requests", str(mine.finished), str(theirs.finished), "")
    return table


def _write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def _write_requests(out: Path, results: dict[str, RunResult]) -> list[Path]:
    """Each run's requests beside its report: <out>/<run name, slugged>.requests.jsonl."""
    return [write_requests(out / f"{re.sub(r'[^a-z0-9]+', '-', name.lower()).strip('-')}.requests.jsonl", result)
            for name, result in results.items()]


def _say_written(console: Console, paths: list[Path]) -> None:
    console.print("wrote " + ", ".join(str(path) for path in paths))


if __name__ == "__main__":
    sys.exit(main())
