"""/healthz and /readyz on the metrics port, over real HTTP: each state of the health they
serve, then a worker that answers "starting" while its engine loads, "ready" once loaded, not
ready while Redis fails its turns, and (a real process) "draining" after SIGTERM while alive."""

import json
import signal
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest
import redis
from msgspec.structs import replace

from producer import Producer
from producer.protocol import DoneEvent, Request
from tests.waiting import START_TIMEOUT_S, wait_for
from worker.config import DEFAULT_STALL_TIMEOUT_S
from worker.engine.engine import Engine
from worker.metrics import MAX_CONNECTIONS, Health, Metrics, QuietHandler
from worker.service import Worker

from .conftest import KEYS, greedy, is_finished, replay, submit
from .test_metrics import scrape
from .test_processes import spawn  # noqa: F401 (a fixture)
from .test_startup import config

STARTING = "loading the engine (native kernels, model, KV cache)"
DRAINING = "draining: finishing the requests it holds, taking no new ones"
STALLED = "the loop has not completed a turn for "
ALIVE, READY = (200, {"alive": True, "state": "ready"}), (200, {"ready": True, "state": "ready"})


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def probe(port: int, path: str) -> tuple[int, dict] | None:
    """(status, JSON body) of a GET, or None while nothing listens on the port."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())
    except urllib.error.URLError:
        return None


def checks(port: int) -> tuple[tuple[int, dict], tuple[int, dict]]:
    return probe(port, "/healthz"), probe(port, "/readyz")


def without_reason(answer: tuple[int, dict]) -> tuple[int, dict]:
    status, body = answer
    return status, {key: value for key, value in body.items() if key != "reason"}


def stalled() -> Health:
    return Health("ready", last_turn=time.monotonic() - DEFAULT_STALL_TIMEOUT_S - 100)


@pytest.mark.parametrize("health, healthz, readyz", [  # each made when the test runs: a turn just now
    (lambda: Health(), (200, {"alive": True, "state": "starting"}),
     (503, {"ready": False, "state": "starting", "reason": STARTING})),
    (lambda: Health("ready", last_turn=time.monotonic()), ALIVE, READY),
    (lambda: Health("ready", last_turn=time.monotonic(), redis_error="Connection refused"), ALIVE,
     (503, {"ready": False, "state": "ready", "reason": "Redis unreachable: Connection refused"})),
    (lambda: Health("draining", last_turn=time.monotonic()), (200, {"alive": True, "state": "draining"}),
     (503, {"ready": False, "state": "draining", "reason": DRAINING})),
], ids=["starting", "ready", "redis unreachable", "draining"])
def test_each_state_answers_its_status_and_body_and_the_ready_gauge_agrees(health, healthz, readyz):
    metrics = Metrics(health())
    server = metrics.serve("127.0.0.1", 0)
    try:
        assert checks(server.server_port) == (healthz, readyz)
        assert scrape(server.server_port)["streambatch:worker_ready"] == (1 if readyz[0] == 200 else 0)
    finally:
        server.shutdown()
        server.server_close()


def test_a_loop_that_stopped_turning_is_neither_alive_nor_ready():
    server = Metrics(stalled()).serve("127.0.0.1", 0)
    try:
        (live_status, live), (ready_status, ready) = checks(server.server_port)
        assert (live_status, live["alive"], live["state"]) == (503, False, "ready")
        assert (ready_status, ready["ready"], ready["state"]) == (503, False, "ready")
        assert live["reason"].startswith(STALLED) and ready["reason"] == live["reason"]
    finally:
        server.shutdown()
        server.server_close()


def test_while_the_engine_loads_readyz_says_starting_then_ready(redis_url, model, monkeypatch):
    loaded = threading.Event()

    def slow_engine(engine_config, on_phase):
        on_phase("converting the model")
        assert loaded.wait(10)
        return Engine(engine_config, model=model)

    monkeypatch.setattr("worker.service.Engine", slow_engine)
    port = free_port()
    workers = []
    loading = threading.Thread(target=lambda: workers.append(Worker(replace(config(redis_url), metrics_port=port))))
    loading.start()
    try:
        wait_for(lambda: probe(port, "/readyz") is not None, message="the metrics port was not served")
        assert checks(port) == ((200, {"alive": True, "state": "starting"}),
                                (503, {"ready": False, "state": "starting", "reason": STARTING}))
        loaded.set()
        loading.join()
        assert probe(port, "/readyz") == READY
        workers[0].turn()
        assert checks(port) == (ALIVE, READY)
    finally:
        loaded.set()
        loading.join()
        for worker in workers:
            worker.close()


def test_a_worker_is_not_ready_while_its_turns_fail_on_redis_and_a_stall_ends_with_a_turn(make_worker, monkeypatch):
    worker = make_worker(metrics_port=0)
    port = worker.metrics_server.server_port
    worker.turn()
    assert probe(port, "/readyz") == READY

    monkeypatch.setattr("worker.service.TURN_RETRY_S", 0)

    def refused(*_):
        raise redis.ConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")

    monkeypatch.setattr(worker.intake, "read", refused)
    worker.turn()
    assert checks(port) == (ALIVE,  # a restart would not bring Redis back
                            (503, {"ready": False, "state": "ready", "reason": "Redis unreachable: Error 111 "
                                   "connecting to 127.0.0.1:6379. Connection refused."}))
    assert scrape(port)["streambatch:worker_ready"] == 0
    monkeypatch.undo()
    worker.turn()
    assert probe(port, "/readyz") == READY

    stalls = []
    monkeypatch.setattr(worker.step_watch, "on_stall", stalls.append)  # the process would end (test_watchdog.py)
    worker.health.last_turn = stalled().last_turn  # as if the last turn ended long ago
    assert without_reason(probe(port, "/healthz")) == (503, {"alive": False, "state": "ready"})
    worker.turn()
    assert checks(port) == (ALIVE, READY)


def test_a_worker_whose_every_turn_fails_for_the_stall_timeout_is_reported_dead(make_worker, client, monkeypatch):
    """The red team's wedge: a lane stream overwritten with a string fails every turn, and /healthz
    stayed 200, so nothing restarted the worker. Now it says so once that has lasted the stall
    timeout, and is alive again with the first turn that succeeds."""
    monkeypatch.setattr("worker.service.TURN_RETRY_S", 0)
    worker = make_worker(metrics_port=0, stall_timeout=1.0)
    port = worker.metrics_server.server_port
    worker.turn()
    stream = KEYS.requests("fast")
    client.delete(stream)
    client.set(stream, "not a stream")
    failing_until = time.monotonic() + 1.5
    while time.monotonic() < failing_until:
        worker.turn()
        assert worker.failed_turns > 0
    status, body = probe(port, "/healthz")
    assert status == 503 and body["reason"].startswith("every turn of the loop has failed for ")
    assert "WRONGTYPE" in body["reason"]
    client.delete(stream)
    worker.turn()
    worker.turn()
    assert checks(port) == (ALIVE, READY)


def test_the_metrics_port_listens_on_this_machine_only_unless_told(make_worker):
    assert make_worker(metrics_port=0).metrics_server.server_address[0] == "127.0.0.1"
    assert make_worker("w2", metrics_port=0, metrics_host="0.0.0.0").metrics_server.server_address[0] == "0.0.0.0"


def test_idle_connections_hold_neither_more_threads_than_the_cap_nor_longer_than_the_read_timeout(monkeypatch):
    """The red team's 800 idle connections made 804 threads, and at the file limit every turn of
    the loop failed until the attacker left."""
    monkeypatch.setattr(QuietHandler, "timeout", 0.5)
    server = Metrics(Health("ready", last_turn=time.monotonic())).serve("127.0.0.1", 0)
    before = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", server.server_port)) for _ in range(200)]
    try:
        time.sleep(0.3)
        assert threading.active_count() - before <= MAX_CONNECTIONS
        time.sleep(1.0)  # past the read timeout: the idle connections are closed, their slots free
        assert checks(server.server_port) == (ALIVE, READY)
    finally:
        for connection in idle:
            connection.close()
        server.shutdown()
        server.server_close()


def test_after_sigterm_readyz_says_draining_while_healthz_stays_200_until_the_drain_ends(spawn, client, redis_url):
    port = free_port()
    worker = spawn("a", "--metrics-port", str(port), "--drain-timeout", "120")
    wait_for(lambda: probe(port, "/readyz") == READY, START_TIMEOUT_S, "worker did not become ready")
    submit(client, Request(id="long", prompt_ids=[5, 6, 7], params=greedy(1000)))
    wait_for(lambda: len(replay(client, "long")) >= 2, message="the request did not start")

    worker.send_signal(signal.SIGTERM)
    wait_for(lambda: probe(port, "/readyz") != READY, message="still ready after SIGTERM")
    assert checks(port) == ((200, {"alive": True, "state": "draining"}),
                            (503, {"ready": False, "state": "draining", "reason": DRAINING}))
    assert not is_finished(client, "long"), "the request finished before the drain could be seen"

    Producer(redis_url).cancel("long")  # the drain ends with the last request held
    assert worker.wait(timeout=30) == 0
    last = replay(client, "long")[-1]
    assert isinstance(last, DoneEvent) and last.finish_reason == "cancelled"
    assert probe(port, "/healthz") is None
