"""SLO tuner: the scheduler settings that give the highest throughput within latency SLOs.

    python -m ops.tune [--ttft-p99 0.8] [--itl-p99 0.1] [--trace FILE | --count N --rate R ...]
                       [--model smollm2-135m] [--worker-args "--threads 2"]
                       [--token-budgets 256,512,1024,2048] [--fast-lane-shares 0.1,0.3]
                       [--watermarks 0,0.1,0.2] [--block-sizes 16,32] [--confirm 3] [--out DIR]

1. Calibrate: the simulator's cost model (worker/engine/cost_model.py, the model a worker with
   --itl-slo-ms sizes its steps with) is fitted to the real engine's step times on the model and
   flags the worker will run, and to the worker's publish round trip on a private redis-server
   (ops/cost_model.py), or read from --cost-model FILE (written there by an earlier calibration).
2. Search on the simulator (worker/engine/simulator.py): for every setting of the grid, the highest
   load (the trace's arrivals sped up or slowed down: trace.at_rate) at which the SLOs hold, by
   doubling or halving from the trace's own rate and then bisecting. A setting's score is its output
   tokens/s there. The SLOs hold when no request failed and the P99 TTFT and P99 ITL of every lane
   are within them (the client's figures, ops/load/report.py, computed alike for simulated runs).
3. Confirm the best --confirm settings on the real worker: a private deployment with the setting's
   flags runs the trace at the load the simulator found for it. The chosen setting is the best
   confirmed one that met the SLOs; the table gives the simulator's error as ratios (confirmed /
   predicted throughput, P99 TTFT and P99 ITL).
Prints the curve (every setting: at the trace's own rate, tokens/s and SLO met or not; and its
best load within the SLOs), and with --out writes tune.json and tune.png (throughput within the
SLOs against each knob).
The simulator's requests produce all of max_tokens (a trace's ignore_eos=False requests may stop
earlier on the real model); its steps cost what the worker's turns do (the engine step and the
publish round trip), not the intake's reads or the client's own I/O. With --itl-slo-ms in
--worker-args the simulated scheduler holds it too, with the same model.
"""

from __future__ import annotations

import argparse
import functools
import math
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

import msgspec
from rich.console import Console
from rich.table import Table

from ops import cost_model
from ops.tool import run_tool, wide_console
from ops.load.report import ALL, Report, summarize, to_json
from ops.load.runner import RequestRecord, RunResult, private_deployment, run
from ops.load.trace import TraceRequest, at_rate, generate, offered_rate, read_trace
from producer.protocol import DoneEvent, SamplingParams
from worker.engine.config import EngineConfig
from worker.engine.outputs import timings_of, usage_of
from worker.engine.simulator import SimRequest, simulate

KNOBS = ("token_budget", "fast_lane_share", "watermark", "block_size")
LOWEST_LOAD, HIGHEST_LOAD = 1 / 64, 64.0  # the load factors the search tries, on the trace's own rate


class Setting(msgspec.Struct, frozen=True):
    """One point of the search: the worker flags of the same names."""
    token_budget: int
    fast_lane_share: float
    watermark: float
    block_size: int

    def worker_args(self) -> list[str]:
        return [arg for knob in KNOBS for arg in (f"--{knob.replace('_', '-')}", str(getattr(self, knob)))]


class Figures(msgspec.Struct, frozen=True):
    """What the SLOs are judged on: the worst lane's P99s, all lanes' throughput."""
    output_tokens_per_s: float
    ttft_p99_s: float | None
    itl_p99_s: float | None
    failed: int

    @classmethod
    def of(cls, report: Report) -> Figures:
        def worst(attribute: str) -> float | None:
            values = [getattr(lane, attribute).p99 for lane in report.lanes.values()]
            return max((value for value in values if value is not None), default=None)
        everyone = report.lanes[ALL]
        return cls(everyone.output_tokens_per_s, worst("ttft_s"), worst("itl_s"), everyone.failed)


class SLO(msgspec.Struct, frozen=True):
    ttft_p99_s: float
    itl_p99_s: float

    def met_by(self, figures: Figures) -> bool:
        """Everyone served, every lane's P99 TTFT and ITL within bounds (no ITL: one-token outputs)."""
        return (figures.failed == 0 and figures.ttft_p99_s is not None and figures.ttft_p99_s <= self.ttft_p99_s
                and (figures.itl_p99_s is None or figures.itl_p99_s <= self.itl_p99_s))


class Outcome(msgspec.Struct):
    setting: Setting
    at_trace_rate: Figures  # the simulator's figures at the trace's own rate
    load: float  # the highest load factor within the SLOs on the simulator; 0: none
    predicted: Figures | None  # at that load
    confirmed: Figures | None = None  # the real worker's, at the same load

    @property
    def score(self) -> float:
        return self.predicted.output_tokens_per_s if self.predicted is not None else 0.0


# --- the simulator, reported as the real runs are -------------------------------------------
def simulated_run(trace: list[TraceRequest], setting: Setting, calibration: cost_model.Calibration,
                  engine: EngineConfig = EngineConfig()) -> RunResult:
    """The trace on the simulated executor, as a RunResult the load report reads like a real one:
    submitted at its arrival, a token event per token at the end of the step that sampled it.
    `engine`: the worker's other options (its scheduler's, its --num-blocks if it has one, else its
    memory's blocks at the setting's block size)."""
    config = msgspec.structs.replace(engine.scheduler, token_budget=setting.token_budget,
                                     fast_lane_share=setting.fast_lane_share, watermark=setting.watermark,
                                     max_model_len=calibration.max_model_len)
    requests = [SimRequest(request.arrival_s, request.prompt_ids,
                           SamplingParams(max_tokens=request.max_tokens, temperature=request.temperature,
                                          seed=request.seed, ignore_eos=request.ignore_eos),
                           request.lane, f"sim-{index}") for index, request in enumerate(trace)]
    blocks = engine.num_blocks or calibration.kv_tokens // setting.block_size
    result = simulate(config, blocks, setting.block_size, requests, cost=calibration.cost,
                      enable_prefix_caching=engine.enable_prefix_caching)
    index_of = {request.request_id: index for index, request in enumerate(requests)}  # simulate() sorts by arrival
    records = []
    for seq in result.sequences:
        index, times = index_of[seq.request_id], result.token_times.get(seq, [])
        end = DoneEvent(seq=len(times), attempt=0, finish_reason=seq.finish_reason.value, usage=usage_of(seq),
                        timings=timings_of(seq), error=seq.error)
        records.append(RequestRecord(label=seq.request_id, lane=seq.lane, submitted=seq.arrival_time,
                                     arrivals=[(at, 1) for at in times], end=end, index=index,
                                     prefix_id=trace[index].prefix_id, finished=seq.finish_time))
    counters = {"streambatch:num_preemptions_total": float(sum(seq.num_preemptions for seq in result.sequences)),
                "streambatch:request_success_total": float(len(result.sequences))}
    return RunResult(records, started=0.0, ended=result.elapsed_s, offered_rate=offered_rate(trace),
                     metrics=counters, total=len(trace))


# --- the search ------------------------------------------------------------------------------
def highest_load(figures_at: Callable[[float], Figures], slo: SLO, *, low: float = LOWEST_LOAD,
                 high: float = HIGHEST_LOAD, refinements: int = 3) -> tuple[float, Figures | None]:
    """The highest load factor in [low, high] at which `figures_at(load)` meets the SLOs: doubling
    (or halving) from 1 until it brackets the edge, then `refinements` geometric bisections of the
    bracket. (0, None) when even `low` misses them. Assumes more load never helps latency."""
    def met(load: float) -> bool:
        return slo.met_by(figures_at(load))
    if met(1.0):
        good = 1.0
        while good * 2 <= high and met(good * 2):
            good *= 2
        if good * 2 > high:
            return good, figures_at(good)
        bad = good * 2
    else:
        bad = 1.0
        while bad / 2 >= low and not met(bad / 2):
            bad /= 2
        if bad / 2 < low:
            return 0.0, None
        good = bad / 2
    for _ in range(refinements):
        middle = math.sqrt(good * bad)
        if met(middle):
            good = middle
        else:
            bad = middle
    return good, figures_at(good)


def search(trace: list[TraceRequest], settings: list[Setting], slo: SLO, calibration: cost_model.Calibration,
           engine: EngineConfig = EngineConfig(),
           on_setting: Callable[[Outcome], None] = lambda outcome: None) -> list[Outcome]:
    """Every setting's highest load within the SLOs on the simulator; best score first."""
    outcomes = []
    for setting in settings:
        @functools.cache  # the search asks for some loads twice
        def figures_at(load: float, setting: Setting = setting) -> Figures:
            return Figures.of(summarize(simulated_run(at_rate(trace, load), setting, calibration, engine)))
        load, predicted = highest_load(figures_at, slo)
        outcomes.append(Outcome(setting, figures_at(1.0), load, predicted))
        on_setting(outcomes[-1])
    return sorted(outcomes, key=lambda outcome: -outcome.score)


def grid(token_budgets: list[int], fast_lane_shares: list[float], watermarks: list[float],
         block_sizes: list[int]) -> list[Setting]:
    return [Setting(budget, share, watermark, block_size) for budget in token_budgets
            for share in fast_lane_shares for watermark in watermarks for block_size in block_sizes]


def ratios(outcome: Outcome) -> dict[str, float | None]:
    """Confirmed / predicted, per figure (None where either side has no value)."""
    def ratio(attribute: str) -> float | None:
        confirmed, predicted = getattr(outcome.confirmed, attribute), getattr(outcome.predicted, attribute)
        return confirmed / predicted if confirmed is not None and predicted else None
    return {name: ratio(attribute) for name, attribute in (("throughput", "output_tokens_per_s"),
                                                           ("ttft_p99", "ttft_p99_s"), ("itl_p99", "itl_p99_s"))}


def candidates(outcomes: list[Outcome], count: int) -> list[Outcome]:
    """The best `count` outcomes within the SLOs, one per prediction: settings the simulator cannot
    tell apart (a watermark the pool never reaches) would confirm the same thing twice."""
    picked: dict[tuple[float, Figures], Outcome] = {}
    for outcome in outcomes:
        if outcome.predicted is not None and len(picked) < count:
            picked.setdefault((outcome.load, outcome.predicted), outcome)
    return list(picked.values())


def chosen(outcomes: list[Outcome], slo: SLO) -> Outcome | None:
    """The best confirmed setting that met the SLOs on the real worker."""
    confirmed = [outcome for outcome in outcomes if outcome.confirmed is not None and slo.met_by(outcome.confirmed)]
    return max(confirmed, key=lambda outcome: outcome.confirmed.output_tokens_per_s, default=None)


# --- the report ---------------------------------------------------------------------------------
def curve_table(outcomes: list[Outcome], slo: SLO, rate: float) -> Table:
    table = Table(*(knob.replace("_", " ") for knob in KNOBS), "tok/s", "P99 TTFT", "P99 ITL", "SLO",
                  "best load", "tok/s there", title_justify="left",
                  title=f"simulator: at the trace's {rate:.2f} req/s, and the highest load within the SLOs "
                        f"(P99 TTFT <= {slo.ttft_p99_s:g} s, P99 ITL <= {slo.itl_p99_s:g} s)")
    for outcome in outcomes:
        here = outcome.at_trace_rate
        best = (f"{_load(outcome.load)} ({outcome.load * rate:.2f} req/s)", f"{outcome.score:.1f}") \
            if outcome.predicted is not None else ("never", "-")
        table.add_row(*(f"{getattr(outcome.setting, knob):g}" for knob in KNOBS), f"{here.output_tokens_per_s:.1f}",
                      _seconds(here.ttft_p99_s), _seconds(here.itl_p99_s),
                      "[green]met[/]" if slo.met_by(here) else "[red]missed[/]", *best)
    return table


def confirmation_table(outcomes: list[Outcome], slo: SLO) -> Table:
    table = Table(*(knob.replace("_", " ") for knob in KNOBS), "load", "tok/s pred / conf", "P99 TTFT pred / conf",
                  "P99 ITL pred / conf", "SLO", "ratio tok/s", "ratio TTFT", "ratio ITL", title_justify="left",
                  title="the best settings on the real worker, at the load the simulator found "
                        "(ratios: confirmed / predicted)")
    for outcome in outcomes:
        if outcome.confirmed is None:
            continue
        predicted, confirmed, ratio = outcome.predicted, outcome.confirmed, ratios(outcome)
        table.add_row(*(f"{getattr(outcome.setting, knob):g}" for knob in KNOBS), _load(outcome.load),
                      f"{predicted.output_tokens_per_s:.1f} / {confirmed.output_tokens_per_s:.1f}",
                      f"{_seconds(predicted.ttft_p99_s)} / {_seconds(confirmed.ttft_p99_s)}",
                      f"{_seconds(predicted.itl_p99_s)} / {_seconds(confirmed.itl_p99_s)}",
                      "[green]met[/]" if slo.met_by(confirmed) else f"[red]missed[/] ({confirmed.failed} failed)",
                      *(f"{value:.2f}" if value is not None else "-" for value in ratio.values()))
    return table


def plot(outcomes: list[Outcome], slo: SLO, path: Path) -> Path:
    """Per knob that varies: the best throughput within the SLOs over the other knobs (the curve),
    every setting as a dot (a cross where no load met the SLOs), the confirmed runs as stars."""
    from matplotlib.figure import Figure

    knobs = [knob for knob in KNOBS if len({getattr(o.setting, knob) for o in outcomes}) > 1] or ["token_budget"]
    figure = Figure(figsize=(4.5 * len(knobs), 4.2), layout="constrained")
    for axis, knob in zip(figure.subplots(1, len(knobs), squeeze=False)[0], knobs):
        values = sorted({getattr(o.setting, knob) for o in outcomes})
        axis.plot(values, [max(o.score for o in outcomes if getattr(o.setting, knob) == value) for value in values],
                  "o-", color="tab:blue", label="simulator: best within SLOs")
        met = [o for o in outcomes if o.predicted is not None]
        axis.scatter([getattr(o.setting, knob) for o in met], [o.score for o in met], s=12, color="tab:blue",
                     alpha=0.3)
        never = [getattr(o.setting, knob) for o in outcomes if o.predicted is None]
        if never:
            axis.scatter(never, [0] * len(never), marker="x", color="tab:red", label="SLOs missed at every load")
        for confirmed, style in ((True, "tab:green"), (False, "tab:red")):
            points = [o for o in outcomes if o.confirmed is not None and slo.met_by(o.confirmed) == confirmed]
            if points:
                axis.scatter([getattr(o.setting, knob) for o in points],
                             [o.confirmed.output_tokens_per_s for o in points], marker="*", s=120, color=style,
                             label=f"real worker: SLOs {'met' if confirmed else 'missed'}")
        axis.set(xlabel=knob.replace("_", " "), ylabel="output tokens/s", xticks=values)
        if knob in ("token_budget", "block_size"):
            axis.set_xscale("log", base=2)
            axis.set_xticks(values, [f"{value:g}" for value in values])
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize="small")
    figure.suptitle(f"throughput within P99 TTFT <= {slo.ttft_p99_s:g} s and P99 ITL <= {slo.itl_p99_s:g} s")
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    return path


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _load(load: float) -> str:
    """A load factor; the search's ceiling means at least that much."""
    return f"{'>= ' if load >= HIGHEST_LOAD else ''}x{load:.2f}"


# --- the command ---------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = wide_console(150)
    return run_tool("tune", lambda: tune(args, console), console)


def build_parser() -> argparse.ArgumentParser:
    def numbers(kind):
        return lambda text: [kind(value) for value in text.split(",")]
    parser = argparse.ArgumentParser(prog="python -m ops.tune", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ttft-p99", type=float, default=0.8, help="SLO: P99 time to first token, seconds")
    parser.add_argument("--itl-p99", type=float, default=0.1, help="SLO: P99 inter-token latency, seconds")
    group = parser.add_argument_group("trace (ops/load/trace.py; write others with `python -m ops.load trace`)")
    group.add_argument("--trace", type=Path, help="a JSONL trace (default: one generated from the options below)")
    group.add_argument("--count", type=int, default=60, help="requests")
    group.add_argument("--rate", type=float, default=2.0, help="mean arrivals per second (Poisson)")
    group.add_argument("--fast-share", type=float, default=0.25, help="share of requests in the fast lane")
    group.add_argument("--seed", type=int, default=0)
    group = parser.add_argument_group("worker")
    group.add_argument("--model", default="smollm2-135m")
    group.add_argument("--worker-args", default="", help="the worker's other flags, as one string (the calibration "
                                                         "runs the engine they make, on their --threads)")
    group.add_argument("--cost-model", type=Path, help="read the calibration from this JSON file if it exists, "
                                                       "else calibrate and write it there")
    group.add_argument("--calibration-steps", type=int, default=300)
    group = parser.add_argument_group("search")
    group.add_argument("--token-budgets", type=numbers(int), default=[256, 512, 1024, 2048])
    group.add_argument("--fast-lane-shares", type=numbers(float), default=[0.1, 0.3])
    group.add_argument("--watermarks", type=numbers(float), default=[0.0, 0.1, 0.2])
    group.add_argument("--block-sizes", type=numbers(int), default=[16, 32])
    group.add_argument("--confirm", type=int, default=3, help="best settings to run on the real worker (0: none)")
    group.add_argument("--timeout", type=float, default=600.0, help="seconds one confirming run may take")
    parser.add_argument("--out", type=Path, help="write tune.json and tune.png here")
    return parser


def tune(args, console: Console) -> None:
    from worker.config import parse_config

    worker_args = shlex.split(args.worker_args)
    worker = parse_config(["--model", args.model, *worker_args])  # the engine the worker will build
    trace = read_trace(args.trace) if args.trace else generate(args.count, args.rate, seed=args.seed,
                                                               fast_share=args.fast_share)
    slo = SLO(args.ttft_p99, args.itl_p99)
    calibration = calibrated(args, worker, console)
    console.print(f"cost model of {calibration.model}: turn = {calibration.fixed_s * 1e3:.2f} ms + "
                  f"{calibration.per_token_s * 1e6:.2f} µs/token + {calibration.per_kv_read_s * 1e9:.2f} ns/KV token "
                  f"read + {calibration.per_row_s * 1e6:.1f} µs/row sampled and published + "
                  f"{calibration.publish_s * 1e3:.2f} ms publish round trip (fitted on {calibration.num_samples} "
                  f"steps, mean error {calibration.mean_relative_error:.0%}); KV pool {calibration.kv_tokens:,} tokens")
    settings = grid(args.token_budgets, args.fast_lane_shares, args.watermarks, args.block_sizes)
    with console.status("") as status:
        done = []

        def on_setting(outcome: Outcome) -> None:
            done.append(outcome)
            status.update(f"simulating: {len(done)}/{len(settings)} settings")
        outcomes = search(trace, settings, slo, calibration, worker.engine, on_setting)
    rate = offered_rate(trace)
    console.print(curve_table(outcomes, slo, rate))
    for outcome in candidates(outcomes, args.confirm):
        console.rule(f"confirming {' '.join(outcome.setting.worker_args())} at {_load(outcome.load)} "
                     f"({outcome.load * rate:.2f} req/s)")
        with private_deployment([*worker_args, *outcome.setting.worker_args()], args.model,
                                console=console) as (url, metrics_url):
            result = run(at_rate(trace, outcome.load), url, timeout=args.timeout, metrics_urls=[metrics_url],
                         console=console)
        outcome.confirmed = Figures.of(summarize(result))
    console.print(confirmation_table(outcomes, slo))
    best = chosen(outcomes, slo)
    if best is not None:
        console.print(f"[bold]chosen:[/] {' '.join(best.setting.worker_args())}: "
                      f"{best.confirmed.output_tokens_per_s:.1f} output tokens/s at {best.load * rate:.2f} req/s "
                      f"within the SLOs on the real worker")
    elif args.confirm:
        console.print("[bold red]no confirmed setting met the SLOs on the real worker[/]: the simulator was "
                      "optimistic (see the ratios); try a lower load or looser SLOs")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "tune.json").write_bytes(to_json({"slo": slo, "calibration": calibration, "offered_rate": rate,
                                                       "outcomes": outcomes, "chosen": best}))
        console.print(f"wrote {args.out / 'tune.json'}, {plot(outcomes, slo, args.out / 'tune.png')}")


def calibrated(args, worker, console: Console) -> cost_model.Calibration:
    if args.cost_model is not None and args.cost_model.exists():
        return cost_model.load(args.cost_model)
    # the largest budget of the search bounds the chunks, so the fit sees the steps it will predict
    engine = msgspec.structs.replace(worker.engine, scheduler=msgspec.structs.replace(
        worker.engine.scheduler, token_budget=max(args.token_budgets)))
    with console.status(f"calibrating the cost model on {args.model}") as status:
        calibration = cost_model.calibrate(
            engine, threads=worker.threads, num_steps=args.calibration_steps,
            on_progress=lambda done: status.update(f"calibrating the cost model on {args.model}: "
                                                   f"{done}/{args.calibration_steps} steps"))
    if args.cost_model is not None:
        cost_model.save(calibration, args.cost_model)
    return calibration


if __name__ == "__main__":
    sys.exit(main())
