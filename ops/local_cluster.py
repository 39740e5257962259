"""A Redis Cluster of redis-server processes on loopback (3 masters, each with a replica), for the
cluster tests and ops tools (ops/fleet): started with `redis-cli --cluster create`, a short
cluster-node-timeout so that a dead master's replica takes over within seconds, ready once every
replica has synced (so that a WAIT is answered at once, not after its timeout), stopped (killed)
on the way out."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Collection
from pathlib import Path

import redis

from ops.demo import free_port


class MissingRedis(RuntimeError):
    """redis-server or redis-cli is not installed."""


def free_node_port(taken: Collection[int] = ()) -> int:
    """A free loopback port for a cluster node, not in `taken`: below 55535, as a node also listens
    on its port + 10000 (the cluster bus) and refuses to start past 65535."""
    while (port := free_port()) in taken or port >= 55535:
        pass
    return port


class LocalCluster:
    """A Redis Cluster of redis-server processes on loopback: 3 masters, each with a replica."""

    NODE_TIMEOUT_MS = 1000  # how soon a dead master's replica takes over (plus an election)

    def __init__(self, workdir: Path, options: tuple[str, ...] = (), node_timeout_ms: int = NODE_TIMEOUT_MS) -> None:
        self.workdir, self.options, self.node_timeout_ms = workdir, options, node_timeout_ms
        self.binary = shutil.which("redis-server")
        if self.binary is None or shutil.which("redis-cli") is None:
            raise MissingRedis("redis-server is not installed: run `make setup` (Debian package redis-server)")
        self.ports: list[int] = []
        while len(self.ports) < 6:
            self.ports.append(free_node_port(self.ports))
        self.processes: dict[int, subprocess.Popen] = {}

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def live_url(self) -> str:
        """A URL naming a node that runs (after one was killed)."""
        port = next(port for port, process in self.processes.items() if process.poll() is None)
        return f"redis://127.0.0.1:{port}/0"

    def start_node(self, port: int) -> None:
        directory = self.workdir / str(port)
        directory.mkdir(parents=True, exist_ok=True)
        self.processes[port] = subprocess.Popen(
            [self.binary, "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
             "--cluster-config-file", str(directory / "nodes.conf"), "--cluster-node-timeout",
             str(self.node_timeout_ms), "--save", "", "--appendonly", "no", "--dir", str(directory),
             "--repl-diskless-sync-delay", "0", *self.options],  # a replica syncs at once, not 5 s later
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def __enter__(self) -> LocalCluster:
        for port in self.ports:
            self.start_node(port)
        for port in self.ports:
            self.wait(lambda: redis.Redis(port=port).ping(), f"node {port} up")
        subprocess.run(["redis-cli", "--cluster", "create", *(f"127.0.0.1:{port}" for port in self.ports),
                        "--cluster-replicas", "1", "--cluster-yes"], check=True, capture_output=True, timeout=60)
        self.wait(self.healthy, "the cluster's slots covered, and every master with a synced replica")
        time.sleep(0.2)
        return self

    def __exit__(self, *exc) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()
                process.wait()

    @staticmethod
    def wait(condition, what: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if condition():
                    return
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out waiting for {what}")
            time.sleep(0.1)

    def nodes(self) -> list[dict]:
        """CLUSTER NODES as seen from a live node: {port, id, master (bool), master_id, slots, alive}."""
        for port, process in self.processes.items():
            if process.poll() is None:
                text = redis.Redis(port=port, decode_responses=True).execute_command("CLUSTER", "NODES")
                break
        found = []
        for line in (text if isinstance(text, str) else "").splitlines():
            fields = line.split()
            found.append({"id": fields[0], "port": int(fields[1].split("@")[0].rsplit(":", 1)[1]),
                          "master": "master" in fields[2], "master_id": fields[3],
                          "alive": "fail" not in fields[2] and fields[7] == "connected", "slots": fields[8:]})
        return found

    def healthy(self) -> bool:
        nodes = self.nodes()
        masters = [node for node in nodes if node["master"] and node["alive"] and node["slots"]]
        replicated = {node["master_id"] for node in nodes if not node["master"] and node["alive"]}
        return (len(masters) == 3 and all(master["id"] in replicated for master in masters)
                and all(redis.Redis(port=node["port"]).cluster("info")["cluster_state"] == "ok"
                        for node in nodes if node["alive"])
                and all(redis.Redis(port=node["port"]).info("replication").get("master_link_status") == "up"
                        for node in nodes if node["alive"] and not node["master"]))

    def masters(self) -> list[int]:
        return [node["port"] for node in self.nodes() if node["master"] and node["alive"] and node["slots"]]

    def flush(self) -> None:
        for port in self.masters():
            redis.Redis(port=port).flushall()
