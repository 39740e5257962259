"""The roofline's tables (rich) and plot (a PNG, matplotlib, no display needed): the peaks, each class
of steps against them, and where each class's time goes; the steps on a roofline chart beside a bar
of each class's time split."""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.ticker import NullFormatter, ScalarFormatter
from rich.table import Table

from ops.roofline.costs import CLASSES, PREFILL_HEAVY_SHARE, Geometry, step_class, step_costs
from ops.roofline.peaks import GemmRate, Peaks
from ops.roofline.steps import PARTS, Step

COLOURS = {"prefill-heavy": "tab:red", "mixed": "tab:purple", "decode": "tab:blue"}
PART_COLOURS = {"linear": "tab:blue", "attention": "tab:orange", "sampling": "tab:green", "other": "tab:gray",
                "host": "tab:brown"}


def peaks_line(peaks: Peaks) -> str:
    gemms = " · ".join(f"{dtype} {best.gflops:,.0f} GFLOP/s ({best.shape} at {best.rows} rows, {best.gemm})"
                       for dtype in peaks.dtypes for best in [peaks.best(dtype)])
    return (f"GEMM peak: {gemms}; bandwidth {peaks.bandwidth_gbps:,.1f} GB/s "
            f"(a read {peaks.read_gbps:,.1f}, a copy {peaks.copy_gbps:,.1f})")


def peaks_table(peaks: Peaks, threads: int) -> Table:
    """Per dtype and shape the best GEMM's GFLOP/s at each chunk of rows, and which GEMM that was."""
    rows = sorted({rate.rows for rate in peaks.gemms})
    table = Table(title=f"GEMM GFLOP/s at the model's shapes, {threads} threads (the better of the GEMMs)",
                  caption=peaks_line(peaks))
    for column in ("dtype", "shape", "in x out", *(f"{n} rows" for n in rows), "best by"):
        table.add_column(column, justify="right")
    best: dict[tuple[str, str, int], GemmRate] = {}
    for rate in peaks.gemms:
        key = (rate.dtype, rate.shape, rate.rows)
        if key not in best or rate.gflops > best[key].gflops:
            best[key] = rate
    for dtype in peaks.dtypes:
        for shape in dict.fromkeys(rate.shape for rate in peaks.gemms if rate.dtype == dtype):
            cells = [best[(dtype, shape, n)] for n in rows]
            winners = sorted({cell.gemm for cell in cells})
            table.add_row(dtype, shape, f"{cells[0].in_features} x {cells[0].out_features}",
                          *(f"{cell.gflops:,.0f}" for cell in cells), " / ".join(winners))
    return table


def classes_table(summary: dict[str, dict], dtype: str, peaks: Peaks) -> Table:
    table = Table(title=f"Steps against this machine's roofline ({dtype}: GEMM peak {peaks.gemm_gflops(dtype):,.0f} "
                        f"GFLOP/s, bandwidth {peaks.bandwidth_gbps:,.1f} GB/s)",
                  caption=f"prefill-heavy: prefill tokens >= {PREFILL_HEAVY_SHARE:.0%} of those computed; decode: "
                          "none; ms/step: the plain run's (timed by parts: the timed run's); roofline: the slower of "
                          "compute at the GEMM peak and bytes at the bandwidth; by part: the linear layers' and "
                          "attention's, each the slower of the two, added up")
    for column in ("class", "steps", "prefill\ntokens", "decode\nrows", "ms/step", "timed\nby parts", "GFLOP/s",
                   "% GEMM\npeak", "GB/s", "% band-\nwidth", "bound", "% roof-\nline", "% roofline\nby part",
                   "linear\nGFLOP/s", "linear %\nGEMM peak", "attention\nGFLOP/s"):
        table.add_column(column, justify="right")
    for kind, f in summary.items():
        table.add_row(kind, str(f["steps"]), f"{f['prefill_tokens']:,}", f"{f['decode_rows']:,}",
                      f"{f['ms_per_step']:,.1f}", f"{f['timed_ms_per_step']:,.1f}", f"{f['gflops']:,.1f}",
                      f"{f['share_of_gemm_peak']:.1%}", f"{f['gbps']:,.1f}", f"{f['share_of_bandwidth']:.1%}", f["bound"],
                      f"{f['share_of_roofline']:.1%}", f"{f['share_of_roofline_by_part']:.1%}",
                      f"{f['linear_gflops']:,.1f}",
                      f"{f['linear_share_of_gemm_peak']:.1%}", f"{f['attention_gflops']:,.1f}")
    return table


def split_table(summary: dict[str, dict]) -> Table:
    table = Table(title="Where the time goes (% of each class's step time, timed by parts)",
                  caption="other: the model's ops besides linear layers and attention; host: the rest of the step")
    for column in ("class", "ms/step", *PARTS):
        table.add_column(column, justify="right")
    for kind, f in summary.items():
        table.add_row(kind, f"{f['timed_ms_per_step']:,.1f}", *(f"{f['time_split'][part]:.1%}" for part in PARTS))
    return table


def plot(steps: list[Step], summary: dict[str, dict], geometry: Geometry, dtype: str, peaks: Peaks,
         path: Path) -> Path:
    figure = Figure(figsize=(13, 5), layout="constrained")
    roof, split = figure.subplots(1, 2, width_ratios=(3, 2))
    gflops, bandwidth = peaks.gemm_gflops(dtype), peaks.bandwidth_gbps
    points = {kind: [] for kind in CLASSES}
    for step in steps:
        cost = step_costs(step, geometry)
        points[step_class(step)].append((cost.flops / cost.bytes, cost.flops / step.plain_s / 1e9))
    intensities = [x for xy in points.values() for x, _ in xy] or [1.0]
    low, high = min(min(intensities) / 2, gflops / bandwidth / 4), max(max(intensities) * 2, gflops / bandwidth * 4)
    knee = gflops / bandwidth
    roof.plot([low, knee, high], [low * bandwidth, gflops, gflops], "k-", label="roofline (measured peaks)")
    for kind, xy in points.items():
        if xy:
            roof.scatter(*zip(*xy), s=10, alpha=0.6, color=COLOURS[kind], label=f"{kind} ({len(xy)} steps)")
    roof.set(xscale="log", yscale="log", xlabel="arithmetic intensity (FLOP/byte)", ylabel="GFLOP/s",
             title=f"each step against the roofline ({dtype}: {gflops:,.0f} GFLOP/s, {bandwidth:,.1f} GB/s)")
    roof.yaxis.set_major_formatter(ScalarFormatter())
    roof.yaxis.set_minor_formatter(NullFormatter())  # labels at every minor tick overlap on a short range
    kinds = list(summary)
    bottoms = [0.0] * len(kinds)
    for part in PARTS:
        shares = [100 * summary[kind]["time_split"][part] for kind in kinds]
        split.bar(kinds, shares, bottom=bottoms, color=PART_COLOURS[part], label=part)
        bottoms = [b + s for b, s in zip(bottoms, shares)]
    split.set(ylabel="% of step time", title="where the time goes", ylim=(0, 100))
    roof.legend(fontsize="small", loc="lower right")
    split.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1, 1))
    for axis in (roof, split):
        axis.grid(True, alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    return path
