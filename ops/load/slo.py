"""Inter-token latency held to an SLO (the worker's --itl-slo-ms) against none, same trace, same load.

Three runs of one trace, each on a fresh private worker with the same flags:
  saturated      no SLO, the requests arriving faster than the worker sustains: its capacity
                 (requests/s), as compare.py measures it (not run when --rate gives the load);
  no SLO, SLO    the trace at LOAD_SHARE of that capacity, without and with --itl-slo-ms.
Targets, of the run under the SLO (issue 25): P99 ITL at most 1.5x the SLO and at most 3x its
median ITL, with at most 10% of the throughput (output tokens/s, all lanes) lost against no SLO.
ITL is the client's: the gap between a request's token events through Redis (report.py).
"""

from __future__ import annotations

import msgspec
from rich.table import Table

from ops.load.report import ALL, Report

MAX_P99_TO_SLO = 1.5
MAX_P99_TO_MEDIAN = 3.0
MAX_THROUGHPUT_LOSS = 0.10


class RunFigures(msgspec.Struct):
    output_tokens_per_s: float
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    itl_p50_s: float | None
    itl_p99_s: float | None

    @classmethod
    def of(cls, report: Report) -> RunFigures:
        lane = report.lanes[ALL]
        return cls(lane.output_tokens_per_s, lane.ttft_s.p50, lane.ttft_s.p99, lane.itl_s.p50, lane.itl_s.p99)

    @property
    def itl_p99_to_median(self) -> float | None:
        return self.itl_p99_s / self.itl_p50_s if self.itl_p99_s is not None and self.itl_p50_s else None


class SloComparison(msgspec.Struct):
    itl_slo_s: float
    without_slo: RunFigures
    with_slo: RunFigures
    throughput_loss: float | None  # 1 - with / without
    targets: dict[str, bool]  # target -> met


def compare_slo(without_slo: Report, with_slo: Report, itl_slo_s: float) -> SloComparison:
    plain, held = RunFigures.of(without_slo), RunFigures.of(with_slo)
    loss = 1 - held.output_tokens_per_s / plain.output_tokens_per_s if plain.output_tokens_per_s else None
    ratio = held.itl_p99_to_median
    targets = {
        f"P99 ITL at most {MAX_P99_TO_SLO:g}x the SLO": held.itl_p99_s is not None
        and held.itl_p99_s <= MAX_P99_TO_SLO * itl_slo_s,
        f"P99 ITL at most {MAX_P99_TO_MEDIAN:g}x the median ITL": ratio is not None and ratio <= MAX_P99_TO_MEDIAN,
        f"at most {MAX_THROUGHPUT_LOSS:.0%} of the throughput lost": loss is not None and loss <= MAX_THROUGHPUT_LOSS,
    }
    return SloComparison(itl_slo_s, plain, held, loss, targets)


def slo_table(comparison: SloComparison) -> Table:
    slo_ms = comparison.itl_slo_s * 1e3
    table = Table("", "no SLO", f"ITL SLO {slo_ms:g} ms", title="the ITL SLO against none, same trace and load",
                  title_justify="left")
    runs = (comparison.without_slo, comparison.with_slo)

    def milliseconds(value: float | None) -> str:
        return "-" if value is None else f"{value * 1e3:.1f} ms"
    rows = [("output tokens/s", [f"{run.output_tokens_per_s:.1f}" for run in runs]),
            ("P50 TTFT", [milliseconds(run.ttft_p50_s) for run in runs]),
            ("P99 TTFT", [milliseconds(run.ttft_p99_s) for run in runs]),
            ("P50 ITL", [milliseconds(run.itl_p50_s) for run in runs]),
            ("P99 ITL", [milliseconds(run.itl_p99_s) for run in runs]),
            ("P99 ITL / P50 ITL", ["-" if run.itl_p99_to_median is None else f"{run.itl_p99_to_median:.2f}x"
                                   for run in runs]),
            ("P99 ITL / the SLO", ["-" if run.itl_p99_s is None else f"{run.itl_p99_s / comparison.itl_slo_s:.2f}x"
                                   for run in runs])]
    for name, values in rows:
        table.add_row(name, *values)
    loss = comparison.throughput_loss
    table.add_row("throughput lost to the SLO", "", "-" if loss is None else f"{loss:.1%}")
    for target, met in comparison.targets.items():
        table.add_row(f"target: {target}", "", "[green]met[/]" if met else "[red]not met[/]")
    return table
