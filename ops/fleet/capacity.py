"""From the ramps to the figures the README's Scaling section rests on.

- A topology's capacity: the most events/s delivered at a saturated step (a master at its CPU
  cap: the first such step, or the one after it). A ramp that ended without one (the machine ran
  out of CPU first, or the steps ran out) gives its last step's figure, marked as a lower bound.
- A master's capacity per core: token events written on the masters per second over the masters'
  CPU, at that step. A Redis master runs its commands on one thread, so a master's capacity is
  about this figure times one core; it is measured on a share of a core, which assumes that the
  work per event does not depend on the share.
- Intake -> admit at half a node's capacity: the half-capacity step (ramp.py).
- What the consumers cost: on Redis, the masters' CPU per event written with consumers (the
  half-capacity step) against without (the step after it, the same workload and caps); in the
  consumers' own processes, their CPU per event delivered (they also submit every request).
- The fleet: `fleet_workers` x sequences x 50 steps/s token events (the issue's fleet figure), over
  a cluster master's capacity (the 3-master cluster's, else the first topology's): all of its core,
  or half of it for the latency measured at half. Then again with each event's write costed at the
  fleet's own events per round trip (round_trips.py): a fleet on a hundred masters or more
  sends each of them pipelines of one or two events, not the twenty of three masters.
"""

from __future__ import annotations

import math

from ops.fleet.round_trips import RoundTripCost, events_per_round_trip, masters_needed
from ops.fleet.scenario import Scenario
from ops.fleet.step import Step

FLEET_STEPS_PER_S = 50


def capacity_step(steps: list[Step]) -> Step:
    ramp = [step for step in steps if step.kind == "ramp"]
    saturated = [step for step in ramp if step.saturated]
    return max(saturated, key=lambda step: step.events_per_s) if saturated else ramp[-1]


def master_cpu_per_event_s(step: Step) -> float | None:
    masters = [node for node in step.nodes if node.master]
    events = sum(node.events_per_s for node in masters)
    return sum(node.cpu_cores for node in masters) / events if events else None


def consumers_share_of_redis(steps: list[Step]) -> float | None:
    """The share of the masters' CPU per event that live consumers cause."""
    found = {step.kind: master_cpu_per_event_s(step) for step in steps}
    with_them, without = found.get("half capacity"), found.get("no consumers")
    return round(1 - without / with_them, 3) if with_them and without else None


def summarize(ramps: dict[str, list[Step]], scenario: Scenario, fleet_workers: int, round_trips: RoundTripCost) -> dict:
    topologies = {}
    for kind, steps in ramps.items():
        at = capacity_step(steps)
        half = next((step for step in steps if step.kind == "half capacity"), None)
        per_event = master_cpu_per_event_s(at)
        topologies[kind] = {
            "masters": sum(node.master for node in at.nodes), "workers": at.workers, "saturated": at.saturated,
            "generator_bound": at.generator_bound, "events_per_s": at.events_per_s,
            "events_per_s_per_node_core": round(1 / per_event) if per_event else None,
            "half_capacity": None if half is None else {
                "workers": half.workers, "node_cpu": half.node_cpu, "busiest_master_share": half.busiest.cpu_share,
                "intake_p50_ms": half.intake.p50_ms, "intake_p99_ms": half.intake.p99_ms,
                "started_p50_ms": half.started.p50_ms, "started_p99_ms": half.started.p99_ms},
            "consumers_share_of_master_cpu": consumers_share_of_redis(steps),
        }
    summary: dict = {"topologies": topologies}
    if "cluster" in topologies:
        cluster = topologies["cluster"]
        summary["scaling"] = {f"cluster / {kind}": {
            "ratio": round(cluster["events_per_s"] / found["events_per_s"], 2),
            "both_saturated": cluster["saturated"] and found["saturated"]}
            for kind, found in topologies.items() if kind != "cluster"}
    sized_on = topologies.get("cluster") or next(iter(topologies.values()))
    per_core = sized_on["events_per_s_per_node_core"]
    events = fleet_workers * scenario.seqs_per_worker * FLEET_STEPS_PER_S
    followed = [step for steps in ramps.values() for step in steps if step.kind != "no consumers"]
    delivered = sum(step.events_per_s * step.window_s for step in followed)
    consumer_cpu_s = sum(step.load_cores * step.window_s for step in followed)
    consumer_cpu_per_event = consumer_cpu_s / delivered if delivered else None
    summary["fleet"] = {
        "workers": fleet_workers, "seqs_per_worker": scenario.seqs_per_worker, "steps_per_s": FLEET_STEPS_PER_S,
        "events_per_s": events, "events_per_s_per_master_core": per_core,
        "masters_at_capacity": math.ceil(events / per_core) if per_core else None,
        "masters_at_half_capacity": math.ceil(2 * events / per_core) if per_core else None,
        "consumer_cpu_us_per_event": round(1e6 * consumer_cpu_per_event, 1) if consumer_cpu_per_event else None,
        "consumer_cores": math.ceil(consumer_cpu_per_event * events) if consumer_cpu_per_event else None,
    }
    if per_core:
        seqs, measured_on = scenario.seqs_per_worker, sized_on["masters"]
        at_capacity = masters_needed(events, per_core, measured_on, seqs, round_trips)
        summary["fleet"]["round_trips"] = {
            "redis_cpu_us_per_event": round_trips.measured_us,
            "events_per_round_trip_measured": round(events_per_round_trip(seqs, measured_on), 2),
            "events_per_round_trip_fleet": round(events_per_round_trip(seqs, at_capacity), 2),
            "masters_at_capacity": at_capacity,
            "masters_at_half_capacity": masters_needed(events, per_core, measured_on, seqs, round_trips, 0.5)}
    return summary
