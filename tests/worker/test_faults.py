"""The fault campaign: real redis-server and real `python -m worker` processes under a steady
load of mixed requests through the Producer, each followed live by a consumer; then faults:
kill -9 of workers mid-batch, Redis restarted (SIGTERM) and killed (SIGKILL), CLIENT PAUSE with
slow consumers, a worker stopped past the reclaim time, and overload. The promise held against
each: a request handed over is never lost, never delivered twice, and equals an undisturbed
run (the offline engine; seeded sampling is reproducible per (seed, position)).

Each test prints its figures; `pytest -s` shows them."""

import signal
import time

import pytest

from .faults import Load, RedisServer, Workers, check, dead_letters, expected_tokens, in_flight, mixed, wait_for


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(tmp_path)
    server.start()
    yield server
    if server.process.poll() is None:
        server.stop()


@pytest.fixture
def workers(redis_server, tmp_path):
    started = []

    def start(names, *flags: str) -> Workers:
        group = Workers(redis_server.url, tmp_path, *flags)
        started.append(group)
        for name in names:
            group.start(name)
        group.wait_ready(names)
        return group

    yield start
    for group in started:
        group.close()


def report(title: str, findings=None, **figures) -> None:
    print(f"\n[{title}] " + ", ".join(f"{name}={value}" for name, value in figures.items()))
    if findings is not None:
        print(f"[{title}] {findings.figures()}")
        for problem in findings.problems[:30]:
            print(f"[{title}]   {problem}")


def test_twenty_kill_9_mid_batch_lose_and_repeat_nothing(redis_server, workers, model):
    names = ("a", "b", "c")
    # Reclaims after kills raise the delivery count: keep the poison-pill limit out of the way.
    group = workers(names, "--max-deliveries", "100")
    client = redis_server.client()
    load = Load(redis_server.url, mixed("k"), rate=4.0).start()
    kills, interrupted = [], set()
    started = time.monotonic()
    for _ in range(20):
        def victim():
            held = in_flight(client)
            ready = [name for name in names if group.ready(name) and held.get(name)]
            return max(ready, key=lambda name: len(held[name])) if ready else None

        name = wait_for(victim, 60, "no worker in the middle of a batch to kill")
        caught = in_flight(client).get(name, [])
        group.kill(name)
        interrupted.update(caught)
        kills.append((name, len(caught)))
        group.start(name)
        print(f"kill {len(kills)} of {name} at {time.monotonic() - started:.1f} s: {len(caught)} in flight", flush=True)
        time.sleep(0.5)
    kill_phase_s = time.monotonic() - started
    load.stop(timeout=120)

    findings = check(client, load, expected_tokens(model, [f.spec for f in load.accepted]), load.producer)
    report("kill -9 x20", kills=len(kills), per_worker={n: sum(1 for k, _ in kills if k == n) for n in names},
           interrupted_requests=len(interrupted), kill_phase_s=round(kill_phase_s, 1),
           peak_consumers=load.peak_following, findings=findings)
    assert not findings.problems, findings.problems[:20]
    assert findings.resumed >= len(kills) // 2, "kills should have interrupted requests that later resumed"
    assert not dead_letters(client)
    assert all(group.alive().values())
