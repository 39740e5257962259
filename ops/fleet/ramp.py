"""The ramp on one topology: N workers, then more, each step warmed up and then measured over a
window, until a master saturates (and one step more, which shows the plateau), the machine runs
out of CPU, or the steps run out. The requests' tenant (the default one) is registered with an
intake shard per master, as an operator spreads a busy tenant over a cluster (`streambatch tenant
add --shards`).

If a master saturated, two more steps follow on the ramp's last workers. One at half the first
saturated step's events/s, with fewer requests in flight (each worker less full): the latency at
half a node's capacity, which whole workers of 64 sequences may step over on a node capped to a
small share of a core. Then the same load without consumers: requests submitted at the rate the
half step completed them, nobody following them, so that the masters' CPU per event with and
without consumers says what the consumers cost Redis.
"""

from __future__ import annotations

import math
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
            if saturated is not None or step.generator_bound:
                break
            if step.saturated:
                saturated = step
        if saturated is not None:
            in_flight = math.ceil(saturated.events_per_s / 2 / scenario.decode_steps_per_s)
            generators.grow(step.workers, in_flight)
            half = measured("half capacity", step.workers, in_flight)
            generators.unfollowed(half.requests_per_s)
            measured("no consumers", step.workers, in_flight)
    return steps


def spread_intake(topology: Topology) -> None:
    client = connect(topology.url, cluster=topology.cluster)
    try:
        TenantRegistry(client, Keys()).add(DEFAULT_TENANT, shards=len(topology.masters))
    finally:
        client.close()
