"""The simulator's cost model (worker/engine/cost_model.py), fitted to a real worker for the tuner.

`calibrate` runs the real Engine offline on the target model for a few hundred steps of varied
shapes (worker/engine/calibration.py, what an engine with an ITL SLO runs at its start-up) and fits
the step's terms: fixed, per token, per KV token read, per row that samples (lm_head, the sampler,
the outputs). Then it times the worker's publish round trip on a private redis-server: the outbox's
pipelined fenced writes of one token event for 1 to 128 requests, fitted the same way (the round
trip, and each row's share of it). So a simulated step costs what a worker's turn does, and the
tuner's simulator and the worker's scheduler under --itl-slo-ms use one model.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import structlog
from rich.console import Console

from worker.engine.calibration import measure
from worker.engine.cost_model import CostModel, StepSample, fit, mean_relative_error, with_publish

PUBLISH_ROWS = (1, 8, 32, 128)
PUBLISH_REPEATS = 20


class Calibration(msgspec.Struct, frozen=True):
    """What the tuner needs of the real worker: its turn's cost and its KV capacity."""
    model: str
    fixed_s: float
    per_token_s: float
    per_kv_read_s: float
    kv_tokens: int  # the KV pool in tokens (num_blocks x block_size): the same memory at any block size
    max_model_len: int
    num_samples: int
    mean_relative_error: float  # |predicted - measured| / measured on the engine's steps, averaged
    per_row_s: float = 0.0  # (defaults: a file from before these terms)
    publish_s: float = 0.0

    @property
    def cost(self) -> CostModel:
        return CostModel(self.fixed_s, self.per_token_s, self.per_kv_read_s, self.per_row_s, self.publish_s)


def measure_publish(redis_url: str, rows: tuple[int, ...] = PUBLISH_ROWS,
                    repeats: int = PUBLISH_REPEATS) -> list[StepSample]:
    """The outbox's round trip for one token event of each of `rows` requests, timed `repeats`
    times per count (samples of rows and seconds; no tokens, no KV)."""
    import redis

    from producer.protocol import Keys
    from worker.engine.outputs import RequestOutput
    from worker.entries import Entry
    from worker.flight import Flight
    from worker.outbox import Outbox

    client = redis.Redis.from_url(redis_url)
    outbox, keys = Outbox(client, replay_maxlen=10_000, replay_ttl=60), Keys("calibration")
    flights = [Flight(f"r{i}", keys, Entry("calibration", f"0-{i + 1}", {}), attempt=1, next_seq=0,
                      log=structlog.get_logger()) for i in range(max(rows))]
    for flight in flights:  # each holds its request: the fenced script writes
        client.set(keys.attempt(flight.request_id), flight.fence)
    samples = []
    for count in rows:
        for _ in range(repeats):
            for flight in flights[:count]:
                outbox.add_output(flight, RequestOutput(flight.name, [7], text="x"))
            started = time.perf_counter()
            written = outbox.flush(flights[:count])
            samples.append(StepSample(0, 0, count, time.perf_counter() - started))
            if not all(ok for _, ok in written):
                raise RuntimeError("the calibration's fenced writes were refused")
    client.close()
    return samples


def calibrate(config, *, threads: int | None = None, num_steps: int = 300, seed: int = 0,
              on_progress: Callable[[int], None] = lambda done: None) -> Calibration:
    """Load the engine the worker would run (`config`: an EngineConfig, as the worker's flags
    make it; its token budget bounds the prefill chunks measured) on `threads` torch threads,
    warm it up, measure `num_steps` steps and fit the step's terms; then the publish's, on a private
    redis-server."""
    import torch

    from ops.demo import redis_at
    from producer.protocol import SamplingParams
    from worker.engine.engine import Engine

    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        engine = Engine(config)
        engine.add_request("warm-up", prompt_ids=[1] * 64, params=SamplingParams(max_tokens=4, ignore_eos=True))
        while engine.has_unfinished:  # the first steps pay for allocations and kernel set-up
            engine.step()
        samples = measure(engine, num_steps, seed=seed, on_progress=on_progress)
    finally:
        torch.set_num_threads(before)
    steps = fit(samples)
    with tempfile.TemporaryDirectory(prefix="streambatch-calibration-") as scratch, \
            redis_at(None, Path(scratch), Console(quiet=True)) as redis_url:
        cost = with_publish(steps, measure_publish(redis_url))
    return Calibration(config.model, cost.fixed_s, cost.per_token_s, cost.per_kv_read_s,
                       kv_tokens=engine.num_blocks * config.block_size, max_model_len=engine.max_model_len,
                       num_samples=len(samples), mean_relative_error=mean_relative_error(steps, samples),
                       per_row_s=cost.per_row_s, publish_s=cost.publish_s)


def save(calibration: Calibration, path: Path) -> None:
    path.write_bytes(msgspec.json.encode(calibration))


def load(path: Path) -> Calibration:
    return msgspec.json.decode(path.read_bytes(), type=Calibration)
