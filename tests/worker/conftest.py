"""Worker test helpers: in-process workers on the tiny random model (requests use prompt_ids),
driven turn by turn with `poll()`, and readers of what they wrote to Redis."""

import json
import random
import time

import fakeredis
import pytest
import redis
import structlog

from producer.connect import is_cluster
from producer.protocol import FIELD, LANES, TERMINAL, Keys, Request, SamplingParams, decode_event, encode
from worker.claims import Claims
from worker.config import WorkerConfig
from worker.engine.config import EngineConfig
from worker.engine.engine import Engine
from worker.engine.models import load_model
from worker.intake import Intake
from worker.metrics import Health, Metrics
from worker.service import Worker
from worker.tenants import LaneStreams

MODEL = "random:llama"
NUM_BLOCKS = 256
KEYS = Keys("sb")


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def prompts_of(count: int, seed: int = 0, low: int = 3, high: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 500) for _ in range(rng.randint(low, high))] for _ in range(count)]


@pytest.fixture(scope="module")
def model(one_thread):
    return load_model(MODEL)[0]


@pytest.fixture
def client(redis_url):
    connection = redis.Redis.from_url(redis_url)
    yield connection
    connection.close()


@pytest.fixture(params=["redis-server", "fakeredis"])
def any_client(request, redis_url):
    """For unit tests that must hold on a real server and on fakeredis alike."""
    if request.param == "fakeredis":
        return fakeredis.FakeRedis()
    return redis.Redis.from_url(redis_url)


@pytest.fixture
def make_worker(redis_url, model):
    """Workers sharing the loaded model; each with its own engine, closed after the test."""
    workers = []

    def make(name: str = "w1", engine_options: dict | None = None, **options) -> Worker:
        options = {"heartbeat_interval": 0.2, "reclaim_idle_ms": 60_000} | options
        engine = EngineConfig.from_options(MODEL, **{"num_blocks": NUM_BLOCKS} | (engine_options or {}))
        config = WorkerConfig(engine=engine, name=name, **{"redis_url": redis_url} | options)
        worker = Worker(config, engine=Engine(engine, model=model))
        workers.append(worker)
        return worker

    yield make
    for worker in workers:
        worker.close()


def killed(worker: Worker) -> None:
    """What kill -9 leaves of an in-process worker: its threads and connections stop, and nothing a
    clean exit does (handing back, leaving the group, clearing the heartbeat) is done."""
    worker.step_watch.close()
    worker.cancels.close()
    worker.intake.blocking.close()
    worker.client.close()


def paced(worker: Worker, step_s: float = 0.01) -> Worker:
    """Every engine step of `worker` takes at least `step_s`: a test that needs a request still
    running a while later must not depend on how fast this machine runs the tiny model."""
    step = worker.engine.step

    def paced_step():
        time.sleep(step_s)
        return step()

    worker.engine.step = paced_step
    return worker


def offline(model, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    """Greedy tokens of the engine run directly, without Redis."""
    engine = Engine(EngineConfig.from_options(MODEL, num_blocks=NUM_BLOCKS), model=model)
    for i, (prompt, request_params) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), prompt_ids=prompt, params=request_params)
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_unfinished:
        for output in engine.step():
            tokens[output.request_id] += output.token_ids
    return [tokens[str(i)] for i in range(len(prompts))]


def make_intake(client, streams: LaneStreams, keys: Keys = KEYS) -> Intake:
    """An intake of consumer "me" on `client`, with the claims and metrics a worker gives it."""
    claims = Claims(client, keys, streams, "me", replay_ttl=60, reclaim_idle_ms=60_000)
    return Intake(client, client, keys, streams, "me", 60, claims, Metrics(Health()), structlog.get_logger())


def submit(client, request: Request, lane: str = "normal", keys: Keys = KEYS) -> str:
    return client.xadd(keys.requests(lane), {FIELD: encode(request)}).decode()


def replay(client, request_id: str, keys: Keys = KEYS) -> list:
    return [decode_event(fields[FIELD]) for _, fields in client.xrange(keys.replay(request_id))]


def is_finished(client, request_id: str, keys: Keys = KEYS) -> bool:
    events = replay(client, request_id, keys)
    return bool(events) and isinstance(events[-1], TERMINAL)


def blocked_clients(client) -> int:
    """Readers waiting in Redis (on a cluster, on every master)."""
    if is_cluster(client):
        return sum(node["blocked_clients"] for node in client.info("clients", target_nodes=client.PRIMARIES).values())
    return client.info("clients")["blocked_clients"]


def is_ready(client, name: str) -> bool:
    value = client.get(KEYS.worker(name))
    return value is not None and json.loads(value)["state"] == "ready"


def backlog(client, keys: Keys = KEYS) -> int:
    return sum(client.xlen(keys.requests(lane)) for lane in LANES)


def tokens_of(events: list) -> list[int]:
    return [token for event in events if hasattr(event, "ids") for token in event.ids]


def assert_numbered(events: list) -> None:
    """seq 0..n, each once, in order; the last event and only the last is terminal."""
    assert [event.seq for event in events] == list(range(len(events)))
    assert [isinstance(event, TERMINAL) for event in events] == [False] * (len(events) - 1) + [True]


def run_until(workers: list[Worker], done, timeout: float = 30.0, survive: bool = False) -> None:
    """Poll the workers in turn until `done()`; with `survive`, each turns as Worker.run does (a
    failed turn is survived) instead of polling (where a failure raises)."""
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "timed out"
        for worker in workers:
            worker.turn() if survive else worker.poll()
