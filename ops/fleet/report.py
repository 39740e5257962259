"""The fleet's tables: a line per step as it is measured, a table per topology, the summary."""

from __future__ import annotations

from rich.table import Table

from ops.fleet.step import Step

TITLES = {"node": "one node", "cluster-1": "a cluster of one master", "cluster": "a cluster of three masters"}


def step_line(step: Step) -> str:
    masters = " ".join(f"{node.cpu_share:.0%}" for node in step.nodes if node.master)
    state = " [red]saturated[/]" if step.saturated else " [yellow]machine busy[/]" if step.generator_bound else ""
    events = (f"{step.events_per_s:>7,.0f} events/s delivered" if step.kind != "no consumers"
              else f"{step.events_written_per_s:>7,.0f} events/s, no consumers")
    return (f"[bold]{step.topology}[/] {step.workers:>2} workers ({step.kind}): {events}, masters' CPU {masters} of "
            f"{step.node_cpu:.3f} core, intake->admit P99 {step.intake.p99_ms} ms, "
            f"machine {step.machine_busy:.0%} busy{state}")


def steps_table(kind: str, steps: list[Step]) -> Table:
    table = Table(title=f"fleet on {TITLES[kind]}: a row per step")
    for column in ("workers", "step", "cap\n(cores)", "in\nflight", "events/s\ndelivered", "written/s", "req/s",
                   "steps/s\nper worker", "batch", "intake->admit\nP50 / P99 ms", "intake->engine\nP50 / P99 ms",
                   "node: CPU cores (of cap) · cmd/s · throttled", "workers' /\nload cores", "machine\nbusy",
                   "load\navg"):
        table.add_column(column, justify="right")
    for step in steps:
        nodes = "\n".join(f"{node.name}: {node.cpu_cores:.3f} ({node.cpu_share:.0%}) · {node.commands_per_s:,.0f} · "
                          f"{node.throttled_share:.0%}" for node in step.nodes)
        table.add_row(str(step.workers), step.kind, f"{step.node_cpu:.3f}", str(step.in_flight),
                      f"{step.events_per_s:,.0f}",
                      f"{step.events_written_per_s:,.0f}", f"{step.requests_per_s:.1f}", f"{step.steps_per_s:.1f}",
                      f"{step.batch:.1f}", f"{step.intake.p50_ms} / {step.intake.p99_ms}",
                      f"{step.started.p50_ms} / {step.started.p99_ms}", nodes,
                      f"{step.worker_cores:.2f} / {step.load_cores:.2f}", f"{step.machine_busy:.0%}",
                      f"{step.load_average:.2f}")
    return table


def summary_table(summary: dict) -> Table:
    table = Table(title="capacity", show_header=False)
    table.add_column(justify="left")
    table.add_column(justify="right")
    for kind, found in summary["topologies"].items():
        bound = "" if found["saturated"] else " (no master saturated: a lower bound)"
        table.add_row(f"{kind}: events/s delivered at {found['workers']} workers{bound}",
                      f"{found['events_per_s']:,.0f}")
        table.add_row(f"{kind}: events/s per master-core", f"{found['events_per_s_per_node_core']:,}")
        half = found["half_capacity"]
        if half is not None:
            table.add_row(f"{kind}: intake->admit P50 / P99 at half capacity ({half['workers']} workers, masters "
                          f"capped to {half['node_cpu']:.3f} core, the busiest at {half['busiest_master_share']:.0%})",
                          f"{half['intake_p50_ms']} / {half['intake_p99_ms']} ms")
            table.add_row("   intake->engine (at the end of the step it came during), P50 / P99",
                          f"{half['started_p50_ms']} / {half['started_p99_ms']} ms")
        if found["consumers_share_of_master_cpu"] is not None:
            table.add_row(f"{kind}: consumers' share of the masters' CPU per event",
                          f"{found['consumers_share_of_master_cpu']:.0%}")
    for ratio, found in summary.get("scaling", {}).items():
        bound = "" if found["both_saturated"] else " (not both saturated)"
        table.add_row(f"events/s delivered, {ratio}{bound}", f"{found['ratio']}x")
    fleet = summary["fleet"]
    table.add_row(f"{fleet['workers']:,} workers x {fleet['seqs_per_worker']} sequences x {fleet['steps_per_s']} "
                  "steps/s", f"{fleet['events_per_s']:,} events/s")
    table.add_row("masters needed: at capacity / at half capacity",
                  f"{fleet['masters_at_capacity']} / {fleet['masters_at_half_capacity']}")
    table.add_row("consumers: CPU per event delivered (and cores for the fleet)",
                  f"{fleet['consumer_cpu_us_per_event']} us ({fleet['consumer_cores']})")
    round_trips = fleet.get("round_trips")
    if round_trips is not None:
        table.add_row("Redis's CPU per fenced write, by scripts per pipeline",
                      ", ".join(f"{size}: {us} us" for size, us in round_trips["redis_cpu_us_per_event"].items()))
        table.add_row(f"masters needed at the fleet's {round_trips['events_per_round_trip_fleet']} events per round "
                      f"trip (measured at {round_trips['events_per_round_trip_measured']}): at capacity / at half",
                      f"{round_trips['masters_at_capacity']} / {round_trips['masters_at_half_capacity']}")
    return table
