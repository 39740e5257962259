"""The intake overlapped with the engine's step (worker/step_intake.py): a request sent while a
step runs is claimed during it and starts as it ends; on one node the step's end cuts the blocking
read short, where on a cluster the reads wait on across steps (no unblock per step) until the
worker turns idle; nothing is left pending that the worker does not hold; a failure of the
intake's thread fails the turn as a failed read did."""

import time

import pytest
import redis

from producer.connect import connect, is_cluster
from producer.protocol import GROUP, LANES, Request
from tests.worker.conftest import KEYS, blocked_clients, greedy, offline, paced, submit, tokens_of, replay


@pytest.fixture(params=["node", "cluster"])
def backend(request):
    """-> (a client, the worker's connection options), a clean database either way."""
    cluster = request.param == "cluster"
    url = request.getfixturevalue("cluster_url" if cluster else "redis_url")
    client = connect(url, cluster=cluster)
    yield client, {"redis_url": url, "redis_cluster": cluster}
    client.close()


def names(worker) -> set[str]:
    return {name.rpartition("/")[2] for name in worker.flights}


def test_a_request_sent_during_a_step_is_claimed_during_it_and_starts_as_it_ends(make_worker, backend, model):
    client, options = backend
    worker = make_worker(**options)
    first, second = [5, 6, 7, 8], [9, 10, 11]
    submit(client, Request(id="first", prompt_ids=first, params=greedy(12)))
    worker.poll()
    assert names(worker) == {"first"}

    step, seen = worker.engine.step, {}

    def step_with_an_arrival():
        submit(client, Request(id="second", prompt_ids=second, params=greedy(12)))
        deadline = time.monotonic() + 10
        while client.get(KEYS.attempt("second")) is None and time.monotonic() < deadline:
            time.sleep(0.002)
        seen["claimed during the step"] = client.get(KEYS.attempt("second")) is not None
        seen["in the engine during the step"] = any(name.endswith("/second") for name in worker.engine.requests)
        return step()

    worker.engine.step = step_with_an_arrival
    worker.poll()
    worker.engine.step = step
    assert seen == {"claimed during the step": True, "in the engine during the step": False}
    assert names(worker) == {"first", "second"}
    assert any(name.endswith("/second") for name in worker.engine.requests)
    while worker.flights:
        worker.poll()
    assert [tokens_of(replay(client, "first")), tokens_of(replay(client, "second"))] == \
        offline(model, [first, second], [greedy(12), greedy(12)])


def calls(client, command: str) -> int:
    """How often Redis has run `command` (on a cluster, on every master)."""
    if is_cluster(client):
        found = client.info("commandstats", target_nodes=client.PRIMARIES).values()
    else:
        found = [client.info("commandstats")]
    return sum(stats.get(f"cmdstat_{command}", {}).get("calls", 0) for stats in found)


def test_the_steps_end_leaves_nothing_unheld_and_an_idle_worker_no_read_waiting(make_worker, backend):
    """One node: the step's end cuts the blocking read short. A cluster: the reads wait on, one per
    lane stream, across the steps, with no CLIENT UNBLOCK each step nor a read by the step's pass
    (a stream with a read waiting has no entry to give), and bring what comes between steps at the
    next; an idle worker cuts them short."""
    client, options = backend
    worker = paced(make_worker(heartbeat_interval=5.0, **options), step_s=0.02)  # its reads block for up to 1 s
    assert worker.config.block_ms == 1000
    submit(client, Request(id="long", prompt_ids=[5, 6, 7], params=greedy(40)))
    worker.poll()
    standing = len(worker.intake.streams.names) if is_cluster(client) else 0
    unblocks, reads = calls(client, "client|unblock"), calls(client, "xreadgroup")
    started = time.monotonic()
    for _ in range(10):
        worker.poll()
        assert blocked_clients(client) == standing
    assert time.monotonic() - started < 5, "each step waited for its intake's read to time out"
    if is_cluster(client):  # at most a read sent again per stream, should one's BLOCK time end
        assert calls(client, "client|unblock") == unblocks and calls(client, "xreadgroup") - reads <= standing
    # a request sent between steps comes with the next one, and every pending entry is held
    submit(client, Request(id="late", prompt_ids=[8, 9], params=greedy(4)))
    worker.poll()
    assert names(worker) == {"long", "late"}
    pending = sum(client.xpending(KEYS.requests(lane), GROUP)["pending"] for lane in LANES)
    assert pending == len(worker.flights)
    while worker.flights:
        worker.poll()
    # idle now: a request sent at once is not left in a read that no step takes
    submit(client, Request(id="after", prompt_ids=[8, 9], params=greedy(2)))
    worker.poll()
    assert names(worker) == {"after"}
    while worker.flights:
        worker.poll()
    worker.poll()
    assert blocked_clients(client) == 0


def test_a_failure_of_the_intakes_thread_fails_the_turn(make_worker, client, monkeypatch):
    monkeypatch.setattr("worker.service.TURN_RETRY_S", 0)
    worker = make_worker()
    submit(client, Request(id="running", prompt_ids=[5, 6, 7], params=greedy(30)))
    worker.turn()
    assert names(worker) == {"running"} and worker.failed_turns == 0

    def refused(*_):
        raise redis.ConnectionError("Error 111 connecting to 127.0.0.1:6379. Connection refused.")

    monkeypatch.setattr(worker.intake, "read", refused)
    worker.turn()
    assert worker.failed_turns == 1 and not worker.flights  # dropped, to be taken back
    monkeypatch.undo()
    deadline = time.monotonic() + 10
    while names(worker) != {"running"} and time.monotonic() < deadline:
        worker.turn()
    assert names(worker) == {"running"} and worker.failed_turns == 0
