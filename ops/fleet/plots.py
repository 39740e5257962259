"""PNG plots of the ramps (matplotlib, no display needed): events/s and intake -> admit P99
against the number of workers, one line per topology."""

from __future__ import annotations

from pathlib import Path

from matplotlib.figure import Figure

from ops.fleet.step import Step

LABELS = {"node": "1 master", "cluster": "3 masters"}


def plot(ramps: dict[str, list[Step]], directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    figure = Figure(figsize=(11, 4.5), layout="constrained")
    throughput, latency = figure.subplots(1, 2)
    for kind, steps in ramps.items():
        workers = [step.workers for step in steps]
        throughput.plot(workers, [step.events_per_s for step in steps], "o-", label=LABELS[kind])
        latency.plot(workers, [step.intake.p99_ms for step in steps], "o-", label=f"{LABELS[kind]}: XADD -> admit")
        latency.plot(workers, [step.after_step.p99_ms for step in steps], "s--",
                     label=f"{LABELS[kind]}: after the step ended")
        saturated = [step for step in steps if step.saturated]
        if saturated:
            throughput.plot([saturated[0].workers], [saturated[0].events_per_s], "x", color="red", markersize=12)
    throughput.set(xlabel="workers", ylabel="token events/s delivered", title="events/s (x: a master saturated)")
    latency.set(xlabel="workers", ylabel="ms", title="intake -> admit P99")
    for axis in (throughput, latency):
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize="small")
    path = directory / "fleet.png"
    figure.savefig(path, dpi=120)
    return [path]
