"""Continuous vs static batching on the same trace, and the fast lane's price, as ratios with targets.

Five runs of one trace, each on a fresh private worker with the same flags but --policy:
  saturated             continuous, the requests arriving faster than the worker sustains (the
                        fast lane's figures below);
  normal lane alone     continuous, the saturated run's normal-lane requests alone (same requests,
                        same arrival times);
  static, saturated     static, the saturated run's trace: what a static worker sustains, its
                        capacity (requests/s);
  continuous, static    the whole trace at one offered load that both policies sustain, so that
                        they deliver the same throughput (the brief's "at the same throughput"):
                        --rate, or by default LOAD_SHARE of static's capacity just measured.
From them:
  throughput ratio      continuous / static output tokens/s, all lanes: within 10% of 1, both kept up
                        and delivered the same throughput, the comparison's premise (the table says
                        so; a static worker fed a trickle of arrivals runs part-filled batches, so it
                        may not sustain the share of the capacity its saturated run measured: then
                        lower --load-share);
  P99 TTFT, e2e, normalized latency ratios   static / continuous, all lanes: how many times better
                        continuous is (target: at least 3 on TTFT and on normalized latency, e2e /
                        output tokens per request as the vLLM paper reports it; the brief claims 3-4x
                        on P99 latency). P99 e2e is shown without a target: it is mostly the longest
                        outputs' own decode time under either policy;
  P99 ITL ratio         shown, no target: the gap between tokens is a step's length, which the step
                        budget governs (the worker's --itl-slo-ms, slo.py), not the batching policy;
  fast / normal P99 TTFT  in the saturated run (target: at most 1/4); the run counts as saturated
                        when requests waited for the worker in at least half of the samples;
  normal-lane loss      1 - the normal lane's tokens/s in the saturated run / in the normal lane's
                        run alone (target: at most 10%). Under saturation the lanes share a fixed
                        capacity, so this is at least the fast lane's share of the work; the total
                        (all lanes) against the normal lane alone is shown beside it: below 1, the
                        fast lane costs more than the work it brings.
"""

from __future__ import annotations

import msgspec
from rich.table import Table

from ops.load.report import ALL, Report

LOAD_SHARE = 0.8  # of the static worker's capacity: the comparison's default offered load
MIN_LATENCY_RATIO = 3.0
MAX_FAST_TO_NORMAL_TTFT = 0.25
MAX_NORMAL_LOSS = 0.10
SATURATED_WAITING_SHARE = 0.5  # requests waited for the worker in at least this share of the samples
SAME_THROUGHPUT = 0.1  # continuous / static throughput within this of 1: both delivered the offered load


class Comparison(msgspec.Struct):
    throughput_ratio: float | None
    ttft_p99_ratio: float | None
    e2e_p99_ratio: float | None
    normalized_p99_ratio: float | None
    itl_p99_ratio: float | None
    fast_to_normal_ttft_p99: float | None
    normal_loss: float | None
    total_to_normal_alone: float | None
    saturated: bool
    same_throughput: bool
    targets: dict[str, bool]  # target -> met


def capacity(saturated: Report) -> float:
    """Requests/s a worker served in a run that kept it saturated: finished requests / the run's span."""
    return saturated.lanes[ALL].finished / saturated.duration_s


def compare(continuous: Report, static: Report, saturated: Report, normal_alone: Report) -> Comparison:
    mixed, fixed = continuous.lanes[ALL], static.lanes[ALL]
    fast, normal = saturated.lanes.get("fast"), saturated.lanes.get("normal")
    alone = normal_alone.lanes.get("normal")
    alone_rate = alone.output_tokens_per_s if alone else None
    ratios = {
        "throughput_ratio": _ratio(mixed.output_tokens_per_s, fixed.output_tokens_per_s),
        "ttft_p99_ratio": _ratio(fixed.ttft_s.p99, mixed.ttft_s.p99),
        "e2e_p99_ratio": _ratio(fixed.e2e_s.p99, mixed.e2e_s.p99),
        "normalized_p99_ratio": _ratio(fixed.normalized_s.p99, mixed.normalized_s.p99),
        "itl_p99_ratio": _ratio(fixed.itl_s.p99, mixed.itl_s.p99),
        "fast_to_normal_ttft_p99": _ratio(fast.ttft_s.p99, normal.ttft_s.p99) if fast and normal else None,
        "normal_loss": 1 - _ratio(normal.output_tokens_per_s, alone_rate) if normal and alone_rate else None,
        "total_to_normal_alone": _ratio(saturated.lanes[ALL].output_tokens_per_s, alone_rate),
    }
    is_saturated = (saturated.waiting_share or 0.0) >= SATURATED_WAITING_SHARE
    targets = {
        f"P99 TTFT at least {MIN_LATENCY_RATIO:g}x better": _at_least(ratios["ttft_p99_ratio"], MIN_LATENCY_RATIO),
        f"P99 normalized latency at least {MIN_LATENCY_RATIO:g}x better":
            _at_least(ratios["normalized_p99_ratio"], MIN_LATENCY_RATIO),
        "fast-lane P99 TTFT at most 1/4 of the normal lane's, saturated":
            is_saturated and _at_most(ratios["fast_to_normal_ttft_p99"], MAX_FAST_TO_NORMAL_TTFT),
        f"normal lane loses at most {MAX_NORMAL_LOSS:.0%} throughput": _at_most(ratios["normal_loss"], MAX_NORMAL_LOSS),
    }
    same = ratios["throughput_ratio"] is not None and abs(ratios["throughput_ratio"] - 1) <= SAME_THROUGHPUT
    return Comparison(**ratios, saturated=is_saturated, same_throughput=same, targets=targets)


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or not denominator:
        return None
    return numerator / denominator


def _at_least(value: float | None, bound: float) -> bool:
    return value is not None and value >= bound


def _at_most(value: float | None, bound: float) -> bool:
    return value is not None and value <= bound


def comparison_table(comparison: Comparison) -> Table:
    table = Table("", "value", title="continuous vs static", title_justify="left")
    shown = (("throughput, continuous / static", comparison.throughput_ratio, "x"),
             ("P99 TTFT, static / continuous", comparison.ttft_p99_ratio, "x"),
             ("P99 e2e, static / continuous", comparison.e2e_p99_ratio, "x"),
             ("P99 normalized latency (e2e / tokens), static / continuous", comparison.normalized_p99_ratio, "x"),
             ("P99 ITL, static / continuous (no target: the step budget's)", comparison.itl_p99_ratio, "x"),
             ("saturated: P99 TTFT, fast / normal lane", comparison.fast_to_normal_ttft_p99, "x"),
             ("saturated: normal-lane throughput lost to the fast lane", comparison.normal_loss, "%"),
             ("saturated: all lanes' throughput / the normal lane's alone", comparison.total_to_normal_alone, "x"))
    for name, value, unit in shown:
        table.add_row(name, "-" if value is None else f"{value:.2f}x" if unit == "x" else f"{value:.1%}")
    table.add_row("the saturated run saturated the worker", "yes" if comparison.saturated else "[red]no[/]")
    table.add_row(f"both policies delivered the same throughput (within {SAME_THROUGHPUT:.0%})",
                  "yes" if comparison.same_throughput else "[red]no: lower --load-share[/]")
    for target, met in comparison.targets.items():
        table.add_row(f"target: {target}", "[green]met[/]" if met else "[red]not met[/]")
    return table
