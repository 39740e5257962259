"""PNG plots of runs (matplotlib, no display needed):
  latency_cdfs    TTFT, ITL and e2e CDFs, one line per run and lane;
  load_curve      output tokens/s and P99 TTFT / ITL against offered load (a sweep);
  token_timeline  one row per request: a grey line while it waits for its first token, a tick
                  per token event; side by side per run, so continuous batching (tokens flowing
                  to many rows at once, new rows starting at any time) and static batching
                  (blocks of rows that start together, the next block after the last ends)
                  show at a glance."""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.ticker import NullFormatter

from ops.load.report import Report, latencies
from ops.load.runner import RunResult

LANE_COLOURS = {"fast": "tab:orange", "normal": "tab:blue"}
LATENCIES = (("ttft", "TTFT (s)"), ("itl", "ITL (s)"), ("e2e", "end-to-end latency (s)"))


def latency_cdfs(runs: dict[str, RunResult], path: Path) -> Path:
    figure = Figure(figsize=(15, 4.5), layout="constrained")
    axes = figure.subplots(1, len(LATENCIES))
    styles = ("-", "--", ":", "-.")
    for (name, result), style in zip(runs.items(), styles * len(runs)):
        for lane in sorted({record.lane for record in result.requests}):
            measured = latencies([record for record in result.requests if record.lane == lane])
            for axis, (key, _) in zip(axes, LATENCIES):
                values = sorted(measured[key])
                if values:
                    shares = [(i + 1) / len(values) for i in range(len(values))]
                    axis.step(values, shares, where="post", linestyle=style, color=LANE_COLOURS.get(lane),
                              label=f"{name} · {lane}" if len(runs) > 1 else lane)
    for axis, (_, label) in zip(axes, LATENCIES):
        axis.set(xlabel=label, ylabel="share of samples", xscale="log", ylim=(0, 1.01))
        axis.xaxis.set_minor_formatter(NullFormatter())  # labels at every minor tick overlap on a short range
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize="small")
    figure.suptitle("latency CDFs per lane")
    return _save(figure, path)


def load_curve(points: list[Report], path: Path) -> Path:
    figure = Figure(figsize=(11, 4.5), layout="constrained")
    throughput, latency = figure.subplots(1, 2)
    rates = [report.offered_rate for report in points]
    for lane in sorted({lane for report in points for lane in report.lanes}):
        reports = [report.lanes.get(lane) for report in points]
        colour = LANE_COLOURS.get(lane, "black")
        throughput.plot(rates, [r.output_tokens_per_s if r else None for r in reports], "o-", color=colour,
                        label=lane)
        latency.plot(rates, [r.ttft_s.p99 if r else None for r in reports], "o-", color=colour,
                     label=f"P99 TTFT {lane}")
        latency.plot(rates, [r.itl_s.p99 if r else None for r in reports], "s--", color=colour,
                     label=f"P99 ITL {lane}")
    throughput.set(xlabel="offered load (requests/s)", ylabel="output tokens/s", title="throughput")
    latency.set(xlabel="offered load (requests/s)", ylabel="seconds", yscale="log", title="P99 latency")
    for axis in (throughput, latency):
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize="small")
    return _save(figure, path)


def token_timeline(runs: dict[str, RunResult], path: Path) -> Path:
    rows = max(len(result.requests) for result in runs.values())
    figure = Figure(figsize=(7 * len(runs), max(4.0, min(20.0, 0.08 * rows + 2))), layout="constrained")
    axes = figure.subplots(1, len(runs), sharex=True, sharey=True, squeeze=False)[0]
    for axis, (name, result) in zip(axes, runs.items()):
        ordered = sorted(result.requests, key=lambda record: record.submitted)
        for row, record in enumerate(ordered):
            start = record.submitted - result.started
            first = record.arrivals[0][0] - result.started if record.arrivals else None
            axis.hlines(row, start, first if first is not None else result.ended - result.started,
                        color="lightgrey", linewidth=1)
            times = [at - result.started for at, _ in record.arrivals]
            axis.scatter(times, [row] * len(times), s=2, marker="|", color=LANE_COLOURS.get(record.lane, "black"))
        report_lanes = sorted({record.lane for record in result.requests})
        axis.set(title=name, xlabel="seconds since the start of the run", ylabel="request (by submit time)")
        axis.invert_yaxis()
        axis.legend(handles=[axis.scatter([], [], color=LANE_COLOURS.get(lane, "black"), label=lane)
                             for lane in report_lanes] + [axis.hlines([], 0, 0, color="lightgrey",
                                                                       label="waiting for its first token")],
                    fontsize="small", loc="lower right")
    figure.suptitle("token timeline: one row per request, a tick per token event")
    return _save(figure, path)


def _save(figure: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    return path

