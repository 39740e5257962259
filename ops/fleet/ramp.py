"""The ramp on one topology: N workers, then more, each step warmed up and then measured over a
window, until a master saturates (and one step more, which shows the plateau), the machine runs
out of CPU, or the steps run out. The requests' tenant (the default one) is registered with an
intake shard per master, as an operator spreads a busy tenant over a cluster (`streambatch tenant
add --shards`).

The first step's workers are then measured three times more, every master's cap raised. First
with the caps far above what they can use (PROBE_HEADROOM times what the first step suggests): the
busiest master's CPU there is what these workers need of it. Then with the caps at twice that, so
that the busiest runs at half its cap: the latency at half a node's capacity, with the workload's
own shape (full workers, whose steps carry 64 events each; fewer sequences per worker would make
every event dearer, as fewer commands share each round trip). Last at the same caps without
consumers: requests submitted at the rate the step before completed them, nobody following them,
so that the masters' CPU per event with and without consumers says what the consumers cost Redis.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from producer.connect import connect
from producer.protocol import DEFAULT_TENANT, Keys
from producer.tenants import TenantRegistry

from ops.fleet.generators import Generators
from ops.fleet.nodes import Topology
from ops.fleet.scenario import Scenario
from ops.fleet.step import Step, StepKind, machine_cpu, step_of

PROBE_HEADROOM = 3  # the estimate runs high already: at its pace the workers would write more than they can


@dataclass(frozen=True)
class RampOptions:
    workers: tuple[int, ...]  # the steps' worker counts, rising
    warmup_s: float  # after the load changed, before the window: the new workers fill up
    window_s: float
    workers_per_process: int
    load_processes: int
    seed: int


def ramp(topology: Topology, scenario: Scenario, options: RampOptions, scratch: Path,
         on_step: Callable[[Step], None]) -> list[Step]:
    steps = []
    spread_intake(topology)
    with Generators(topology, scenario, options.workers_per_process, options.load_processes, scratch,
                    options.seed) as generators:

        def measured(kind: StepKind, workers: int, in_flight: int) -> Step:
            time.sleep(options.warmup_s)
            generators.window()  # the warm-up's: not counted
            before, machine_before = topology.sample(), machine_cpu()
            time.sleep(options.window_s)
            after, machine_after = topology.sample(), machine_cpu()
            hosts, loads = generators.window()
            steps.append(step_of(topology, kind, workers, in_flight, before, after,
                                 (machine_before, machine_after), hosts, loads))
            on_step(steps[-1])
            return steps[-1]

        saturated = None
        for workers in options.workers:
            in_flight = workers * scenario.in_flight_per_worker
            generators.grow(workers, in_flight)
            step = measured("ramp", workers, in_flight)
            if step is steps[0]:
                with topology.caps.raised(PROBE_HEADROOM * full_pace_cpu(step, scenario)):
                    needed = measured("probe", workers, in_flight).busiest.cpu_cores
                with topology.caps.raised(2 * needed):
                    half = measured("half capacity", workers, in_flight)
                    generators.unfollowed(half.requests_per_s)
                    measured("no consumers", workers, in_flight)
                generators.grow(workers, in_flight)
            if step.generator_bound or saturated is not None:
                break
            if step.saturated:
                saturated = step
    return steps


def full_pace_cpu(step: Step, scenario: Scenario) -> float:
    """About the busiest master's CPU with the step's workers at their full pace: what the step
    measured, scaled by the events they would write at CostModel's pace over those they wrote."""
    offered = step.workers * scenario.seqs_per_worker * scenario.decode_steps_per_s
    return step.busiest.cpu_cores * offered / step.events_written_per_s


def spread_intake(topology: Topology) -> None:
    client = connect(topology.url, cluster=topology.cluster)
    try:
        TenantRegistry(client, Keys()).add(DEFAULT_TENANT, shards=len(topology.masters))
    finally:
        client.close()
