"""A tensor-parallel worker as a real process (`python -m worker --tensor-parallel 2`: two gloo ranks
on the CPU, against a real redis-server): rank 1 killed mid-generation ends the worker at once,
non-zero, and another worker finishes its requests with one rank's tokens. (Rank 0's end taking
rank 1 with it: tests/engine/test_tensor_parallel.py.)"""

import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

from producer.protocol import Request
from tests.waiting import START_TIMEOUT_S, wait_for
from worker.engine.parallel import EXIT_RANK_LOST

from .conftest import (
    MODEL,
    NUM_BLOCKS,
    assert_numbered,
    backlog,
    greedy,
    is_finished,
    is_ready,
    offline,
    prompts_of,
    replay,
    run_until,
    submit,
    tokens_of,
)


@pytest.fixture
def spawn(redis_url, tmp_path, launch):
    def start(name: str, *flags: str):
        return launch([sys.executable, "-m", "worker", "--redis-url", redis_url, "--model", MODEL, "--name", name,
                       "--num-blocks", str(NUM_BLOCKS), "--threads", "1", "--heartbeat-interval", "0.3",
                       "--tensor-parallel", "2", *flags], tmp_path / f"{name}.log")

    return start


def rank_pids(log: Path) -> list[int]:
    """Ranks 1.. of a started worker, from the start-up phase that names them."""
    for line in log.read_text().splitlines():
        event = json.loads(line) if line.startswith("{") else {}
        if event.get("event") == "worker.phase" and event["phase"].startswith("waiting for the other tensor-parallel"):
            return [int(pid) for pid in re.search(r"pids ([\d, ]+)", event["phase"]).group(1).split(", ")]
    raise AssertionError("the worker named no tensor-parallel ranks")


def test_rank_1_killed_mid_generation_ends_the_worker_and_another_finishes_its_requests(
        spawn, client, model, make_worker, tmp_path):
    worker = spawn("tp", "--reclaim-idle-ms", "1500")
    wait_for(lambda: is_ready(client, "tp"), START_TIMEOUT_S, "the tensor-parallel worker did not start")
    (rank_1,) = rank_pids(tmp_path / "tp.log")
    ids, prompts = [f"tp{i}" for i in range(4)], prompts_of(4, seed=5)
    for request_id, prompt in zip(ids, prompts):
        submit(client, Request(id=request_id, prompt_ids=prompt, params=greedy(900)))
    wait_for(lambda: all(len(replay(client, request_id)) >= 3 for request_id in ids), message="no tokens")

    os.kill(rank_1, signal.SIGKILL)
    killed = time.monotonic()
    assert worker.wait(timeout=10) == EXIT_RANK_LOST
    assert time.monotonic() - killed < 3, "the worker outlived its rank"
    unfinished = [request_id for request_id in ids if not is_finished(client, request_id)]
    assert unfinished == ids, "the worker finished requests before its rank was killed"

    survivor = make_worker("one-rank", reclaim_idle_ms=1500)
    run_until([survivor], lambda: backlog(client) == 0, timeout=60)
    # two ranks' tokens up to the kill, one rank's after: the same as one rank's throughout
    for request_id, tokens in zip(ids, offline(model, prompts, [greedy(900)] * len(ids))):
        events = replay(client, request_id)
        assert_numbered(events)
        assert tokens_of(events) == tokens, request_id
        assert events[-1].attempt == 2

