"""PNG plots of the ramps (matplotlib, no display needed): events/s and intake -> admit P99
against the number of workers, one line per topology, its half-capacity step (raised caps)
marked apart."""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure

from ops.fleet.step import Step

LABELS = {"node": "one node", "cluster-1": "cluster, 1 master", "cluster": "cluster, 3 masters"}


def plot(ramps: dict[str, list[Step]], directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    figure = Figure(figsize=(11, 4.5), layout="constrained")
    throughput, latency = figure.subplots(1, 2)
    for (kind, steps), colour in zip(ramps.items(), ("tab:blue", "tab:green", "tab:orange")):
        ramp = [step for step in steps if step.kind == "ramp"]
        workers = [step.workers for step in ramp]
        throughput.plot(workers, [step.events_per_s for step in ramp], "o-", color=colour, label=LABELS[kind])
        latency.plot(workers, [step.intake.p99_ms for step in ramp], "o-", color=colour,
                     label=f"{LABELS[kind]}: XADD -> admit")
        latency.plot(workers, [step.started.p99_ms for step in ramp], "s--", color=colour,
                     label=f"{LABELS[kind]}: XADD -> engine (a step's end)")
        for step in steps:
            if step.kind == "ramp" and step.saturated:
                throughput.plot([step.workers], [step.events_per_s], "x", color="red", markersize=12)
            if step.kind == "half capacity":
                latency.plot([step.workers], [step.intake.p99_ms], "*", color=colour, markersize=12,
                             label=f"{LABELS[kind]}: at half capacity (cap {step.node_cpu:.3f} core)")
    throughput.set(xlabel="workers", ylabel="token events/s delivered", title="events/s (x: a master saturated)",
                   ylim=(0, None))
    latency.set(xlabel="workers", ylabel="ms", title="intake -> admit P99", yscale="log")
    for axis in (throughput, latency):
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize="small")
    path = directory / "fleet.png"
    figure.savefig(path, dpi=120)
    return path
