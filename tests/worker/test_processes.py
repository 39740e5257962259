"""Workers as real processes (`python -m worker`): kill -9 one mid-generation; SIGTERM one."""

import json
import signal
import subprocess
import sys
from collections import defaultdict

import pytest

from producer.protocol import FIELD, GROUP, Request, decode_event, decode_request
from tests.waiting import START_TIMEOUT_S, wait_for
from worker.heartbeat import worker_of

from .conftest import (
    KEYS,
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
    def start(name: str, *flags: str) -> subprocess.Popen:
        return launch([sys.executable, "-m", "worker", "--redis-url", redis_url, "--model", MODEL, "--name", name,
                       "--num-blocks", str(NUM_BLOCKS), "--threads", "1", "--heartbeat-interval", "0.3", *flags],
                      tmp_path / f"{name}.log")

    return start


def owners(client) -> dict[str, list[str]]:
    """Worker name -> ids of the requests whose entries it holds."""
    stream = KEYS.requests("normal")
    request_ids = {entry_id: decode_request(fields[FIELD]).id for entry_id, fields in client.xrange(stream)}
    held = defaultdict(list)
    for entry in client.xpending_range(stream, GROUP, "-", "+", 100):
        held[worker_of(entry["consumer"].decode())].append(request_ids[entry["message_id"]])
    return held


@pytest.mark.long
def test_kill_9_mid_generation_the_other_worker_finishes_every_request_exactly_once(spawn, client, model):
    workers = {name: spawn(name, "--reclaim-idle-ms", "1500") for name in ("a", "b")}
    wait_for(lambda: all(is_ready(client, name) for name in workers), START_TIMEOUT_S, "workers did not start")
    listener = client.pubsub()
    listener.psubscribe(KEYS.tokens("*"))
    listener.get_message(timeout=1)
    ids, prompts, params = [f"k{i}" for i in range(8)], prompts_of(8, seed=2), greedy(900)  # long enough to be killed mid-way on a fast machine
    for request_id, prompt in zip(ids, prompts):
        submit(client, Request(id=request_id, prompt_ids=prompt, params=params))

    wait_for(lambda: sum(map(len, owners(client).values())) == len(ids), message="requests not taken")
    victim, victim_ids = max(owners(client).items(), key=lambda item: len(item[1]))
    wait_for(lambda: all(len(replay(client, request_id)) >= 3 for request_id in victim_ids))
    workers[victim].kill()
    workers[victim].wait()
    unfinished = [request_id for request_id in victim_ids if not is_finished(client, request_id)]
    assert unfinished, "the victim finished its requests before it was killed"

    wait_for(lambda: backlog(client) == 0, timeout=60, message="the survivor did not finish")
    published = defaultdict(list)
    while (message := listener.get_message(timeout=0.1)) is not None:
        published[message["channel"].decode()].append(decode_event(message["data"]))
    for request_id, tokens in zip(ids, offline(model, prompts, [params] * len(ids))):
        events = replay(client, request_id)
        assert_numbered(events)
        assert tokens_of(events) == tokens, request_id
        assert published[KEYS.tokens(request_id)] == events, "each consumer sees every event once, in order"
        assert events[-1].attempt == (2 if request_id in unfinished else 1)
    assert workers["b" if victim == "a" else "a"].poll() is None


def test_a_started_worker_logs_each_start_up_phase_and_its_time(spawn, client, tmp_path):
    worker = spawn("a")
    wait_for(lambda: is_ready(client, "a"), START_TIMEOUT_S, "worker did not start")
    events = [json.loads(line) for line in (tmp_path / "a.log").read_text().splitlines() if line.startswith("{")]
    phases = [event["phase"] for event in events if event["event"] == "worker.phase"]
    assert phases[:2] == ["loading the native kernels", f"loading the model {MODEL}"]
    assert phases[2].startswith(f"allocating the KV cache ({NUM_BLOCKS} blocks of 16 tokens")
    assert phases[-1] == "preparing the model's linear layers"
    loaded = next(event for event in events if event["event"] == "worker.loaded")
    assert loaded["previous"] == phases[-1] and 0 < loaded["startup_s"] < 60
    assert [event["event"] for event in events].index("worker.ready") > events.index(loaded)
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(timeout=10) == 0


@pytest.mark.long
def test_sigterm_hands_the_unfinished_back_at_once_and_exits_0(spawn, client, model, make_worker):
    worker = spawn("a", "--drain-timeout", "0.3", "--reclaim-idle-ms", "60000")
    wait_for(lambda: is_ready(client, "a"), START_TIMEOUT_S, "worker did not start")
    prompts = prompts_of(2, seed=3)
    for i, prompt in enumerate(prompts):
        submit(client, Request(id=f"t{i}", prompt_ids=prompt, params=greedy(900)))
    wait_for(lambda: all(len(replay(client, f"t{i}")) >= 2 for i in range(2)))

    worker.send_signal(signal.SIGTERM)
    assert worker.wait(timeout=10) == 0
    assert not any(is_finished(client, f"t{i}") for i in range(2))
    assert client.get(KEYS.worker("a")) is None
    pending = client.xpending_range(KEYS.requests("normal"), GROUP, "-", "+", 10)
    assert len(pending) == 2 and all(entry["time_since_delivered"] > 10**9 for entry in pending)

    successor = make_worker("b")  # its reclaim threshold is 60 s: only a hand-back is taken at once
    run_until([successor], lambda: backlog(client) == 0, timeout=20)
    for i, tokens in enumerate(offline(model, prompts, [greedy(900)] * 2)):
        events = replay(client, f"t{i}")
        assert_numbered(events)
        assert tokens_of(events) == tokens and events[-1].attempt == 2


@pytest.mark.parametrize("flags, said", [
    (["--model", "random:nope"], "unknown random model 'nope'"),
    (["--model", MODEL, "--dtype", "float8"], "unknown dtype 'float8'"),
    (["--model", MODEL, "--redis-url", "foo://x"], "Redis URL must specify one of the following schemes"),
])
def test_what_a_worker_cannot_start_with_is_one_line_and_status_1(redis_url, flags, said):
    result = subprocess.run([sys.executable, "-m", "worker", "--redis-url", redis_url, *flags],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr
    assert f"python -m worker: error: {said}" in result.stderr
    assert "Traceback" not in result.stdout + result.stderr
