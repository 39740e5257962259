"""The Redis under test: one node, a cluster of one master and its replica, or LocalCluster's 3
masters with a replica each; every master's process under the same CPU cap (cpu_caps.py). And
what each node did, read from the node itself: INFO's CPU time (used_cpu_user + used_cpu_sys, all
its threads), commands processed (Redis counts the commands a script calls too) and per-command
calls (commandstats), and its group's throttling.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import redis
from rich.console import Console

from ops.demo import redis_at
from ops.fleet.cpu_caps import CpuCaps, Throttling
from ops.fleet.one_master_cluster import OneMasterCluster
from ops.local_cluster import LocalCluster


@dataclass(frozen=True)
class Node:
    name: str  # "node", or "master:<port>" / "replica:<port>"
    master: bool
    client: redis.Redis

    @property
    def group(self) -> str:
        """Its CPU cap's cgroup (cpu_caps.py)."""
        return self.name.replace(":", "-")


@dataclass(frozen=True)
class NodeSample:
    at: float  # time.monotonic()
    cpu_s: float
    commands: int
    calls: dict[str, int]  # by command, lower case ("evalsha", "spublish", ...)
    throttling: Throttling


@dataclass(frozen=True)
class Topology:
    kind: str  # one of TOPOLOGIES
    url: str
    nodes: list[Node]
    caps: CpuCaps

    @property
    def cluster(self) -> bool:
        return self.kind != "node"

    @property
    def masters(self) -> list[Node]:
        return [node for node in self.nodes if node.master]

    def sample(self) -> dict[str, NodeSample]:
        return {node.name: sample(node, self.caps) for node in self.nodes}

    def masters_slots(self) -> list[list[tuple[int, int]]]:
        """Each master's hash slot ranges (none on one node)."""
        if not self.cluster:
            return []
        ranges: dict[bytes, list[tuple[int, int]]] = {}
        for start, end, (_, _, node_id, *_), *_ in self.masters[0].client.execute_command("CLUSTER", "SLOTS"):
            ranges.setdefault(node_id, []).append((start, end))
        return list(ranges.values())


# What --topologies names: one plain node, or a cluster of LocalCluster's kind (a replica each).
CLUSTERS = {"cluster-1": OneMasterCluster, "cluster": LocalCluster}
TOPOLOGIES = ("node", *CLUSTERS)
# A capped master answers the cluster bus only while it has quota, so under load its pings can be
# late by seconds; the fleet measures load, not failover, and a replica taking over mid-step (the
# cluster down meanwhile) would spoil the measurement.
NODE_TIMEOUT_MS = 60_000


@contextlib.contextmanager
def topology(kind: str, scratch: Path, cores: float, console: Console) -> Iterator[Topology]:
    """Redis started for the run, every master capped to `cores`; stopped on the way out."""
    with CpuCaps(cores) as caps, contextlib.ExitStack() as stack:
        if kind == "node":
            url = stack.enter_context(redis_at(None, scratch, console))
            nodes = [Node("node", True, redis.Redis.from_url(url))]
        else:
            cluster = stack.enter_context(CLUSTERS[kind](scratch / "cluster", node_timeout_ms=NODE_TIMEOUT_MS))
            url = cluster.url
            nodes = [Node(f"{'master' if found['master'] else 'replica'}:{found['port']}", found["master"],
                          redis.Redis(port=found["port"]))
                     for found in sorted(cluster.nodes(), key=lambda found: (not found["master"], found["port"]))]
            console.print(f"[bold]redis:[/] started a cluster of {len(nodes)} redis-servers "
                          f"({sum(node.master for node in nodes)} master(s), each with a replica) at {url}")
        for node in nodes:
            caps.add(node.group, node.client.info("server")["process_id"], capped=node.master)
        console.print(f"[bold]redis:[/] each master capped to {cores:g} core (CFS quota {caps.quota_us} us "
                      f"per {caps.period_us} us)")
        yield Topology(kind, url, nodes, caps)


def sample(node: Node, caps: CpuCaps) -> NodeSample:
    pipe = node.client.pipeline(transaction=False)
    pipe.info("cpu")
    pipe.info("stats")
    pipe.info("commandstats")
    cpu, stats, commands = pipe.execute()
    calls = {name.removeprefix("cmdstat_"): figures["calls"] for name, figures in commands.items()}
    return NodeSample(time.monotonic(), cpu["used_cpu_user"] + cpu["used_cpu_sys"], stats["total_commands_processed"],
                      calls, caps.throttling(node.group))
