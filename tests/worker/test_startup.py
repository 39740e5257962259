"""Start-up: while the engine loads, the heartbeat says "starting" and what the worker is doing,
refreshed all along; then "ready", and "draining" after SIGTERM. A load that fails leaves no
heartbeat behind."""

import json
import threading
import time

import pytest
import structlog

from producer.protocol import Request
from worker.config import WorkerConfig
from worker.engine.config import EngineConfig
from worker.engine.engine import Engine
from worker.service import Worker

from .conftest import KEYS, MODEL, NUM_BLOCKS, greedy, offline, replay, run_until, submit, tokens_of
from .faults import RedisServer


def config(redis_url: str) -> WorkerConfig:
    return WorkerConfig(engine=EngineConfig.from_options(MODEL, num_blocks=NUM_BLOCKS), redis_url=redis_url,
                        name="w1", heartbeat_interval=0.2, reclaim_idle_ms=60_000)


def heartbeat(client) -> dict | None:
    value = client.get(KEYS.worker("w1"))
    return None if value is None else json.loads(value)


def wait_for_phase(client, phase: str, timeout: float = 10) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = heartbeat(client)
        if stats is not None and stats["phase"] == phase:
            return stats
        assert time.monotonic() < deadline, f"never saw phase {phase!r}; last: {stats}"
        time.sleep(0.01)


def test_the_heartbeat_follows_each_start_up_phase_then_says_ready_and_draining(redis_url, client, model,
                                                                                 monkeypatch):
    proceed = [threading.Event(), threading.Event()]

    def slow_engine(engine_config, on_phase):
        on_phase("building the native kernels")
        proceed[0].wait(10)
        on_phase("converting the model")
        proceed[1].wait(10)
        return Engine(engine_config, model=model)

    monkeypatch.setattr("worker.service.Engine", slow_engine)
    workers = []
    loading = threading.Thread(target=lambda: workers.append(Worker(config(redis_url))))
    loading.start()
    try:
        first = wait_for_phase(client, "building the native kernels")
        assert first["state"] == "starting" and first["model"] == MODEL and first["running"] == 0
        time.sleep(0.5)  # the phase goes on; the beat keeps the key alive
        again = heartbeat(client)
        assert again["phase"] == first["phase"] and again["updated_at"] > first["updated_at"]
        assert 0 < client.pttl(KEYS.worker("w1")) <= config(redis_url).heartbeat_ttl_ms
        proceed[0].set()
        assert wait_for_phase(client, "converting the model")["state"] == "starting"
        proceed[1].set()
        loading.join(10)
        worker = workers[0]
        worker.poll()  # the loop's first beat
        assert (heartbeat(client)["state"], heartbeat(client)["phase"]) == ("ready", "")
        worker.stop()
        worker.poll()
        worker.housekeeping()
        assert heartbeat(client)["state"] == "draining"
        worker.close()
        assert heartbeat(client) is None
    finally:
        for event in proceed:
            event.set()
        loading.join(10)


def test_a_load_that_fails_leaves_no_heartbeat(redis_url, client, monkeypatch):
    def broken_engine(engine_config, on_phase):
        on_phase("loading the model")
        time.sleep(0.3)
        raise OSError("no such model")

    monkeypatch.setattr("worker.service.Engine", broken_engine)
    with pytest.raises(OSError, match="no such model"):
        Worker(config(redis_url))
    assert heartbeat(client) is None


def test_a_worker_whose_redis_is_not_up_yet_waits_for_it_then_serves(tmp_path, model):
    server = RedisServer(tmp_path)
    later = threading.Timer(1.0, server.start)
    later.start()
    try:
        with structlog.testing.capture_logs() as logs:
            worker = Worker(config(server.url), engine=Engine(config(server.url).engine, model=model))
        later.join()
        assert [entry["event"] for entry in logs if "redis" in entry["event"]] == ["worker.waiting_for_redis"]
        client = server.client()
        submit(client, Request(id="after", prompt_ids=[5, 6, 7], params=greedy(3)))
        run_until([worker], lambda: not client.xlen(KEYS.requests("normal")) and not worker.flights)
        assert tokens_of(replay(client, "after")) == offline(model, [[5, 6, 7]], [greedy(3)])[0]
        worker.close()
    finally:
        later.cancel()
        later.join()
        if server.process is not None and server.process.poll() is None:
            server.stop()
