"""One step of the ramp: a window with N workers, in figures, from what the nodes, the workers,
the load and the machine said at its start and end.

A node is saturated when it uses SATURATED of its CPU cap. When none is but the machine's cores
are busy (MACHINE_BUSY), the load generators (and whatever else runs on the machine) are what
limits the step: the nodes' figures are then a lower bound of what they could take.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

from ops.fleet.nodes import NodeSample, Topology
from ops.fleet.windows import HostWindow, LoadWindow
from ops.percentile import percentile

SATURATED = 0.9
MACHINE_BUSY = 0.95

# "ramp": N workers kept full; "probe", "half capacity" and "no consumers": the first step's
# workers, each master's cap raised (ramp.py)
StepKind = Literal["ramp", "probe", "half capacity", "no consumers"]


@dataclass
class Quantiles:
    p50_ms: float | None
    p99_ms: float | None
    count: int

    @classmethod
    def of(cls, seconds: list[float]) -> Quantiles:
        def ms(q: float) -> float | None:
            value = percentile(seconds, q)
            return None if value is None else round(1000 * value, 2)
        return cls(ms(0.5), ms(0.99), len(seconds))


@dataclass
class NodeFigures:
    name: str
    master: bool
    cpu_cores: float
    cpu_share: float  # of its cap
    commands_per_s: float  # as Redis counts them: a script's calls included
    events_per_s: float  # token events written on it: calls of the events' publish command
    throttled_share: float  # of the CFS periods it ran in, those that ended with its quota spent


@dataclass
class Step:
    topology: str
    kind: StepKind
    node_cpu: float  # each master's CPU cap in the step, in cores
    workers: int
    in_flight: int  # requests the load kept in flight (without consumers: about as many, submitted at a rate)
    window_s: float
    events_per_s: float  # token events delivered to the live consumers
    events_written_per_s: float  # token events the workers' engines emitted
    requests_per_s: float  # requests completed, as their consumers saw them end
    steps_per_s: float  # per worker
    batch: float  # sequences per step, mean
    intake: Quantiles  # a request's XADD -> a worker's claim of it (the intake's admission)
    started: Quantiles  # XADD -> the engine taking it in, at the end of the step it came during
    nodes: list[NodeFigures]
    worker_cores: float  # the worker processes' CPU
    load_cores: float  # the producers' and consumers' CPU
    machine_busy: float  # share of all the machine's cores busy (anyone's work)
    load_average: float  # the 1-minute load average at the window's end
    failures: dict[str, int] = field(default_factory=dict)

    @property
    def busiest(self) -> NodeFigures:
        return max((node for node in self.nodes if node.master), key=lambda node: node.cpu_share)

    @property
    def saturated(self) -> bool:
        return self.busiest.cpu_share >= SATURATED

    @property
    def generator_bound(self) -> bool:
        return not self.saturated and self.machine_busy >= MACHINE_BUSY

    def as_json(self) -> dict:
        return {name: getattr(self, name) for name in self.__dataclass_fields__} | {
            "intake": vars(self.intake), "started": vars(self.started),
            "nodes": [vars(node) for node in self.nodes],
            "saturated": self.saturated, "generator_bound": self.generator_bound}


def machine_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, all cores (/proc/stat)."""
    with open("/proc/stat") as stat:
        ticks = [int(value) for value in stat.readline().split()[1:]]
    hertz = os.sysconf("SC_CLK_TCK")
    idle = ticks[3] + ticks[4]  # idle, iowait
    return (sum(ticks) - idle) / hertz, sum(ticks) / hertz


def step_of(topology: Topology, kind: StepKind, workers: int, in_flight: int, before: dict[str, NodeSample],
            after: dict[str, NodeSample], machine: tuple[tuple[float, float], tuple[float, float]],
            hosts: list[HostWindow], loads: list[LoadWindow]) -> Step:
    any_node = next(iter(after))
    wall = after[any_node].at - before[any_node].at
    event_command = "spublish" if topology.cluster else "publish"
    cap = topology.caps.cores
    nodes = []
    for node in topology.nodes:
        start, end = before[node.name], after[node.name]
        cores = (end.cpu_s - start.cpu_s) / wall
        periods = end.throttling.periods - start.throttling.periods
        nodes.append(NodeFigures(
            node.name, node.master, round(cores, 4), round(cores / cap, 3),
            round((end.commands - start.commands) / wall, 1),
            round((end.calls.get(event_command, 0) - start.calls.get(event_command, 0)) / wall, 1),
            round((end.throttling.throttled - start.throttling.throttled) / periods, 3) if periods else 0.0))
    (busy_start, total_start), (busy_end, total_end) = machine
    steps = sum(host.steps for host in hosts)
    failures: dict[str, int] = {}
    for load in loads:
        for reason, count in load.failures.items():
            failures[reason] = failures.get(reason, 0) + count
    return Step(
        topology.kind, kind, cap, workers, in_flight, round(wall, 3),
        events_per_s=round(sum(load.events for load in loads) / wall, 1),
        events_written_per_s=round(sum(host.tokens for host in hosts) / wall, 1),
        requests_per_s=round(sum(load.completed for load in loads) / wall, 2),
        steps_per_s=round(steps / wall / workers, 2),
        batch=round(sum(host.scheduled for host in hosts) / steps, 1) if steps else 0.0,
        intake=Quantiles.of([value for host in hosts for value in host.intake_s]),
        started=Quantiles.of([value for host in hosts for value in host.started_s]),
        nodes=nodes,
        worker_cores=round(sum(host.cpu_s for host in hosts) / wall, 3),
        load_cores=round(sum(load.cpu_s for load in loads) / wall, 3),
        machine_busy=round((busy_end - busy_start) / (total_end - total_start), 3),
        load_average=os.getloadavg()[0], failures=failures)
