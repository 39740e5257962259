"""The fleet's tables: a line per step as it is measured, a table per topology, the summary."""

from __future__ import annotations

from rich.table import Table

from ops.fleet.step import Step


def step_line(step: Step) -> str:
    masters = " ".join(f"{node.cpu_share:.0%}" for node in step.nodes if node.master)
    state = " [red]saturated[/]" if step.saturated else " [yellow]machine busy[/]" if step.generator_bound else ""
    return (f"[bold]{step.topology}[/] {step.workers:>3} workers, {step.in_flight:>4} in flight: {step.events_per_s:>9,.0f} events/s, masters' CPU "
            f"{masters} of cap, intake->admit P99 {step.intake.p99_ms} ms, machine {step.machine_busy:.0%} busy{state}")


def steps_table(kind: str, steps: list[Step]) -> Table:
    table = Table(title=f"fleet on {'one node' if kind == 'node' else 'the cluster'}: a row per step")
    for column in ("workers", "in\nflight", "events/s", "written/s", "req/s", "steps/s\nper worker", "batch",
                   "intake->admit\nP50 / P99 ms", "after step\nP50 / P99 ms", "node: CPU (of cap) · cmd/s · throttled",
                   "workers' /\nload cores", "machine\nbusy", "load\navg"):
        table.add_column(column, justify="right")
    for step in steps:
        nodes = "\n".join(f"{node.name}: {node.cpu_cores:.3f} ({node.cpu_share:.0%}) · {node.commands_per_s:,.0f} · "
                          f"{node.throttled_share:.0%}" for node in step.nodes)
        table.add_row(str(step.workers), str(step.in_flight), f"{step.events_per_s:,.0f}", f"{step.events_written_per_s:,.0f}",
                      f"{step.requests_per_s:.1f}", f"{step.steps_per_s:.1f}", f"{step.batch:.1f}",
                      f"{step.intake.p50_ms} / {step.intake.p99_ms}", f"{step.after_step.p50_ms} / {step.after_step.p99_ms}",
                      nodes, f"{step.worker_cores:.2f} / {step.load_cores:.2f}", f"{step.machine_busy:.0%}",
                      f"{step.load_average:.2f}")
    return table


def summary_table(summary: dict) -> Table:
    table = Table(title="capacity", show_header=False)
    table.add_column(justify="left")
    table.add_column(justify="right")
    for kind, found in summary["topologies"].items():
        bound = "" if found["saturated"] else " (not saturated: a lower bound)"
        table.add_row(f"{kind}: events/s at {found['workers']} workers{bound}", f"{found['events_per_s']:,.0f}")
        table.add_row(f"{kind}: events/s per node-core", f"{found['events_per_s_per_node_core']:,}")
        half = found["half_capacity"]
        table.add_row(f"{kind}: intake->admit P99 at {half['workers']} workers (busiest master at "
                      f"{half['busiest_master_share']:.0%} of cap)", f"{half['intake_p99_ms']} ms")
        table.add_row("   of which after the worker's step ended, P99", f"{half['after_step_p99_ms']} ms")
    if "scaling" in summary:
        table.add_row("events/s, cluster / node", f"{summary['scaling']['ratio']}x")
    fleet = summary["fleet"]
    table.add_row(f"{fleet['workers']:,} workers x {fleet['seqs_per_worker']} sequences x {fleet['steps_per_s']} "
                  "steps/s", f"{fleet['events_per_s']:,} events/s")
    table.add_row("masters: at capacity / at half", f"{fleet['masters_at_capacity']} / {fleet['masters_at_half_capacity']}")
    table.add_row("consumer cores per 1M events/s (and for the fleet)",
                  f"{fleet['consumer_cores_per_million_events_per_s']} ({fleet['consumer_cores']})")
    return table
