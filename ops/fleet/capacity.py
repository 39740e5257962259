"""From the ramps to the figures the README's Scaling section rests on.

- A topology's capacity: the events/s delivered at its first saturated step (a master at its CPU
  cap). A ramp that ended without one (the machine ran out of CPU first, or the steps ran out)
  gives its last step's figure, marked as a lower bound.
- A node's capacity per core: token events written on the masters per second, over the masters'
  CPU, at that step. A Redis master runs its commands on one thread, so a master's capacity is
  about this figure times one core; the figure is measured on a share of a core, which assumes
  the work per event does not change with the share.
- Intake -> admit at half a node's capacity: the step whose busiest master was nearest half its cap.
- The fleet: `fleet_workers` x sequences x 50 steps/s token events (the issue's fleet figure), over
  a master's capacity (all its core, or half of it for the latency measured at half), and the
  consumers' CPU per event from the load processes (which also submit every request).
"""

from __future__ import annotations

import math

from ops.fleet.scenario import Scenario
from ops.fleet.step import Step

FLEET_STEPS_PER_S = 50


def capacity_step(steps: list[Step]) -> Step:
    return next((step for step in steps if step.saturated), steps[-1])


def per_core(step: Step) -> float:
    masters = [node for node in step.nodes if node.master]
    cores = sum(node.cpu_cores for node in masters)
    return sum(node.events_per_s for node in masters) / cores if cores else 0.0


def half_capacity_step(steps: list[Step]) -> Step:
    return min(steps, key=lambda step: abs(step.busiest.cpu_share - 0.5))


def summarize(ramps: dict[str, list[Step]], scenario: Scenario, node_cpu: float, fleet_workers: int) -> dict:
    topologies = {}
    for kind, steps in ramps.items():
        at, half = capacity_step(steps), half_capacity_step(steps)
        topologies[kind] = {
            "masters": sum(node.master for node in at.nodes), "workers": at.workers, "saturated": at.saturated,
            "generator_bound": at.generator_bound, "events_per_s": at.events_per_s,
            "events_per_s_per_node_core": round(per_core(at)),
            "half_capacity": {"workers": half.workers, "busiest_master_share": half.busiest.cpu_share,
                              "intake_p99_ms": half.intake.p99_ms, "after_step_p99_ms": half.after_step.p99_ms},
        }
    summary: dict = {"topologies": topologies}
    if {"node", "cluster"} <= set(topologies):
        node, cluster = topologies["node"], topologies["cluster"]
        summary["scaling"] = {"ratio": round(cluster["events_per_s"] / node["events_per_s"], 2),
                              "lower_bound_of_cluster": not cluster["saturated"],
                              "upper_bound": not node["saturated"]}
    basis = topologies.get("cluster") or topologies["node"]
    events = fleet_workers * scenario.seqs_per_worker * FLEET_STEPS_PER_S
    delivered = sum(step.events_per_s * step.window_s for steps in ramps.values() for step in steps)
    consumer_s = sum(step.load_cores * step.window_s for steps in ramps.values() for step in steps)
    consumer_cores_per_million = consumer_s / delivered * 1e6 if delivered else None
    summary["fleet"] = {
        "workers": fleet_workers, "seqs_per_worker": scenario.seqs_per_worker, "steps_per_s": FLEET_STEPS_PER_S,
        "events_per_s": events, "events_per_s_per_master_core": basis["events_per_s_per_node_core"],
        "masters_at_capacity": math.ceil(events / basis["events_per_s_per_node_core"]),
        "masters_at_half_capacity": math.ceil(2 * events / basis["events_per_s_per_node_core"]),
        "consumer_cores_per_million_events_per_s": round(consumer_cores_per_million, 2)
        if consumer_cores_per_million else None,
        "consumer_cores": round(consumer_cores_per_million * events / 1e6) if consumer_cores_per_million else None,
    }
    return summary
