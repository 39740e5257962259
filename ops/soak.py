"""Soak: steady load for a long time through the Producer, then what a leak or a drift shows.

    python -m ops.soak --duration 1800 --rate R [--workers N] [--redis-url URL] [--model M]
                       [--worker-args "..."] [trace options]

Starts a private redis-server unless one answers at --redis-url (ops/demo.py's redis_at) and N
`python -m worker` processes on it, drives a seeded Poisson trace of `duration x rate` requests
through them (ops/load: trace.py, runner.py), waits for the drain, and prints:
  KV blocks       per worker after the drain: blocks still referenced (the heartbeat's KV usage x
                  its pool; prefix-cached free blocks count as free), of which pinned (prefixes held
                  on purpose, --pin-prefix), and leaked = referenced - pinned, which must be 0;
  RSS             of each worker when ready, after the first 10 % of the run (warm), at the end,
                  and the growth over the warm part;
  latency drift   P50 / P99 TTFT and ITL of the requests submitted in the first 10 % of the run
                  against those of the last 10 % (client-side, ops/load/report.py's definitions);
  Redis memory    INFO memory used_memory before the load, at its peak, after the drain (finished
                  requests' events stay for the workers' --replay-ttl, 600 s by default: a run
                  shorter than that ends with all of them still there);
  counts          requests, completed, errors.
Exits 1 when a KV block leaked or a request did not complete.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import redis
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console, Group
from rich.table import Table

from ops.demo import free_port, redis_at, redis_client, running_process, use_cluster_option, wait_until_ready
from ops.load.report import Percentiles, latencies, lane_report
from ops.load.runner import RequestRecord, run as run_trace
from ops.load.trace import TraceRequest, generate
from ops.tool import ToolError, run_tool
from producer import Producer
from producer.connect import add_cluster_flag
from producer.protocol import Keys

SAMPLE_INTERVAL_S = 1.0  # RSS and Redis memory samples
HEARTBEAT_INTERVAL_S = 0.5  # of the soak's workers: the drain is seen this soon
SHARE = 0.1  # the first and last share of the run that the drift compares
SHARED_PREFIX_TOKENS = 64  # of each shared system prompt: 4 KV blocks of 16


@dataclass
class SoakWorker:
    name: str
    process: subprocess.Popen
    log: Path
    metrics_url: str
    num_blocks: int = 0  # its KV pool, known once it is ready
    rss_kib: list[tuple[float, int]] = field(default_factory=list)  # (perf_counter, VmRSS)
    kv_used: list[int] = field(default_factory=list)  # KV blocks referenced, one per sample of its heartbeat

    def read_num_blocks(self) -> None:
        """From the worker's `worker.ready` log line."""
        for line in self.log.read_text(errors="replace").splitlines():
            if line.startswith("{") and (event := json.loads(line)).get("event") == "worker.ready":
                self.num_blocks = event["num_blocks"]
                return
        raise ToolError(f"worker {self.name} logged no worker.ready line")

    def rss_at(self, at: float) -> int:
        """RSS at the first sample from `at` on (the last one if none is that late)."""
        return next((rss for when, rss in self.rss_kib if when >= at), self.rss_kib[-1][1])

    def blocks(self, beat: dict) -> int:
        """KV blocks referenced (prefix-cached free ones count as free), from a heartbeat's usage."""
        return round(beat["kv_usage"] * self.num_blocks)


@dataclass
class KvBlocks:
    referenced: int
    pinned: int

    @property
    def leaked(self) -> int:
        return self.referenced - self.pinned


@dataclass
class Soak:
    records: list[RequestRecord]
    started: float  # perf_counter, when the load started
    duration: float
    workers: list[SoakWorker]
    kv: dict[str, KvBlocks]
    redis_memory: list[tuple[float, int]]  # (perf_counter, used_memory), from before the load to after the drain

    @property
    def completed(self) -> int:
        return lane_report(self.records).finished

    @property
    def ok(self) -> bool:
        return all(blocks.leaked == 0 for blocks in self.kv.values()) and self.completed == len(self.records)



def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ops.soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=1800, help="seconds of load")
    parser.add_argument("--rate", type=float, default=2.0, help="mean arrivals per second (Poisson)")
    parser.add_argument("--workers", type=int, default=1, help="worker processes to start")
    parser.add_argument("--redis-url", help="use this Redis if it answers (default: a private redis-server)")
    add_cluster_flag(parser)
    parser.add_argument("--model", default="smollm2-135m", help="the workers' model")
    parser.add_argument("--worker-args", default="", help="the workers' other flags, as one string")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompt-lengths", default="lognormal:64,0.8,512", help="normal lane's prompt tokens")
    parser.add_argument("--output-lengths", default="lognormal:24,1.2,256", help="normal lane's output tokens")
    parser.add_argument("--fast-share", type=float, default=0.25, help="share of requests in the fast lane")
    parser.add_argument("--shared-prefix-share", type=float, default=0.5,
                        help="share of requests that start with a shared system prompt")
    parser.add_argument("--pin-prefixes", action="store_true",
                        help="pin the shared system prompts in every worker for the run (Producer.pin)")
    parser.add_argument("--drain-timeout", type=float, default=300, help="seconds the drain may take")
    parser.add_argument("--stall-timeout", type=float, default=600,
                        help="give up on a starting worker that shows no progress for this many seconds")
    args = parser.parse_args(argv)
    use_cluster_option(parser, args)
    console = Console()
    trace = generate(max(1, round(args.duration * args.rate)), args.rate, seed=args.seed,
                     prompt_lengths=args.prompt_lengths, output_lengths=args.output_lengths,
                     fast_share=args.fast_share, shared_prefix_share=args.shared_prefix_share, num_prefixes=4,
                     shared_prefix_tokens=SHARED_PREFIX_TOKENS)
    def soak() -> None:
        result = run(console, trace, redis_url=args.redis_url, workers=args.workers,
                     worker_command=[sys.executable, "-m", "worker", "--model", args.model,
                                     *shlex.split(args.worker_args)],
                     duration=args.duration, drain_timeout=args.drain_timeout, stall_timeout=args.stall_timeout,
                     pins=shared_prefixes(trace) if args.pin_prefixes else {})
        console.print(tables(result))
        if not result.ok:
            raise ToolError("the table above says what did not hold")
    return run_tool("soak", soak, console)


def shared_prefixes(trace: list[TraceRequest]) -> dict[str, list[int]]:
    """Pin name -> token ids of each shared system prompt of a trace made with SHARED_PREFIX_TOKENS."""
    return {f"soak-prefix-{request.prefix_id}": request.prompt_ids[:SHARED_PREFIX_TOKENS]
            for request in trace if request.prefix_id is not None}


def run(console: Console, trace: list[TraceRequest], *, redis_url: str | None, workers: int,
        worker_command: list[str], duration: float, drain_timeout: float, stall_timeout: float = 600,
        pins: dict[str, list[int]] | None = None) -> Soak:
    """`worker_command` gets `--name NAME --metrics-port P --heartbeat-interval S` (and the Redis URL,
    see ops.demo.running_process).
    `pins` (name -> prompt ids) are published for every worker before the load, unpublished after."""
    with tempfile.TemporaryDirectory(prefix="streambatch-soak-") as scratch, contextlib.ExitStack() as stack:
        url = stack.enter_context(redis_at(redis_url, Path(scratch), console))
        started = [stack.enter_context(_worker(worker_command, url, f"soak-{os.getpid()}-{index}", Path(scratch)))
                   for index in range(workers)]
        for worker in started:
            took = wait_until_ready(url, worker.name, worker.process, worker.log, stall_timeout, console)
            console.print(f"[bold]worker:[/] {worker.name} is ready after {took:.1f} s")
            worker.read_num_blocks()
        client = redis_client(url)
        producer = stack.enter_context(Producer(url))
        for name, prompt_ids in (pins or {}).items():
            producer.pin(name, prompt_ids=prompt_ids)
            stack.callback(producer.unpin, name)
        redis_memory: list[tuple[float, int]] = []
        with _sampling(started, client, redis_memory):
            began = time.perf_counter()
            result = run_trace(trace, url, timeout=duration + drain_timeout, console=console)
            kv = _drained_kv(producer, client, started, drain_timeout)
        for worker in started:
            if worker.process.poll() is not None:
                raise ToolError(f"worker {worker.name} exited with status {worker.process.returncode} during the soak")
        return Soak(result.requests, began, duration, started, kv, redis_memory)


@contextlib.contextmanager
def _worker(command: list[str], url: str, name: str, scratch: Path) -> Iterator[SoakWorker]:
    port = free_port()
    log = scratch / f"{name}.log"
    with running_process([*command, "--name", name, "--metrics-port", str(port),
                          "--heartbeat-interval", str(HEARTBEAT_INTERVAL_S)], log, url) as process:
        yield SoakWorker(name, process, log, f"http://127.0.0.1:{port}/metrics")


@contextlib.contextmanager
def _sampling(workers: list[SoakWorker], client: redis.Redis, redis_memory: list[tuple[float, int]]):
    """Sample each worker's RSS and Redis's used_memory every SAMPLE_INTERVAL_S meanwhile (and
    once at either end)."""
    stop, keys = threading.Event(), Keys()

    def sample() -> None:
        now = time.perf_counter()
        for worker in workers:
            worker.rss_kib.append((now, rss_kib(worker.process.pid)))
            beat = client.get(keys.worker(worker.name))
            if beat is not None:
                worker.kv_used.append(worker.blocks(json.loads(beat)))
        redis_memory.append((now, client.info("memory")["used_memory"]))

    def loop() -> None:
        while not stop.wait(SAMPLE_INTERVAL_S):
            sample()

    sample()
    sampler = threading.Thread(target=loop, name="soak-sampler", daemon=True)
    sampler.start()
    try:
        yield
    finally:
        stop.set()
        sampler.join()
        sample()


def _drained_kv(producer: Producer, client: redis.Redis, workers: list[SoakWorker],
                timeout: float) -> dict[str, KvBlocks]:
    """Once nothing waits or runs anywhere, each worker's KV blocks from a heartbeat beaten after that."""
    deadline = time.monotonic() + timeout
    while True:
        stats = producer.stats()
        beats = {worker.name: worker for worker in stats.workers}
        idle = all(lane.backlog == 0 for lane in stats.lanes.values()) and all(
            (beat := beats.get(worker.name)) is not None and beat.raw.get("in_flight") == 0
            and beat.running == 0 and beat.waiting == 0 for worker in workers)
        if idle:
            break
        if time.monotonic() > deadline:
            raise ToolError(f"the workers did not drain within {timeout:.0f} s")
        time.sleep(HEARTBEAT_INTERVAL_S / 2)
    drained_at, keys, kv = time.time(), Keys(), {}
    for worker in workers:
        while (beat := json.loads(client.get(keys.worker(worker.name)) or b"{}")).get("updated_at", 0) <= drained_at:
            if time.monotonic() > deadline:
                raise ToolError(f"worker {worker.name} did not beat after the drain")
            time.sleep(HEARTBEAT_INTERVAL_S / 4)
        kv[worker.name] = KvBlocks(worker.blocks(beat), _pinned_blocks(worker.metrics_url))
    return kv


def _pinned_blocks(metrics_url: str) -> int:
    with urllib.request.urlopen(metrics_url, timeout=5) as response:
        text = response.read().decode()
    for family in text_string_to_metric_families(text):
        if family.name == "streambatch:pinned_kv_blocks":
            return int(family.samples[0].value)
    return 0  # a worker from before pinned prefixes


def rss_kib(pid: int) -> int:
    """Resident memory of a process (VmRSS), in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise ValueError(f"no VmRSS for pid {pid}")


# --- the report ----------------------------------------------------------------------------
def tables(soak: Soak) -> Group:
    warm = soak.started + SHARE * soak.duration
    workers = Table("worker", "RSS ready", "warm", "end", "growth", "KV peak", "KV used", "pinned", "leaked",
                    title="workers: RSS in MiB (growth: warm -> end); KV blocks of its pool: peak during the "
                          "load, used and pinned after the drain, leaked = used - pinned (must be 0)",
                    title_justify="left")
    for worker in soak.workers:
        ready, warmed, end = worker.rss_kib[0][1], worker.rss_at(warm), worker.rss_kib[-1][1]
        blocks = soak.kv[worker.name]
        workers.add_row(worker.name, _mib(ready), _mib(warmed), _mib(end), _mib(end - warmed, signed=True),
                        f"{max(worker.kv_used, default=0)}/{worker.num_blocks}", str(blocks.referenced),
                        str(blocks.pinned),
                        f"[{'green' if blocks.leaked == 0 else 'red'}]{blocks.leaked}[/]")
    ordered = sorted(soak.records, key=lambda record: record.submitted)
    tail = max(1, round(SHARE * len(ordered)))
    first, last = latencies(ordered[:tail]), latencies(ordered[-tail:])
    drift = Table("latency (s)", f"first {SHARE:.0%}", f"last {SHARE:.0%}", "drift",
                  title=f"latency drift ({tail} requests each)", title_justify="left")
    for name in ("ttft", "itl"):
        early, late = Percentiles.of(first[name]), Percentiles.of(last[name])
        for quantile in ("p50", "p99"):
            before, after = getattr(early, quantile), getattr(late, quantile)
            drift.add_row(f"{name.upper()} {quantile.upper()}", _seconds(before), _seconds(after),
                          "-" if before is None or after is None else f"{after - before:+.4f}")
    memory = [used for _, used in soak.redis_memory]
    errors = len(soak.records) - soak.completed
    summary = Table("", "value", title="Redis and requests", title_justify="left")
    summary.add_row("Redis used_memory before (MiB)", _mib(memory[0] // 1024))
    summary.add_row("Redis used_memory peak (MiB)", _mib(max(memory) // 1024))
    summary.add_row("Redis used_memory after the drain (MiB)", _mib(memory[-1] // 1024))
    summary.add_row("Redis growth (MiB)", _mib((memory[-1] - memory[0]) // 1024, signed=True))
    summary.add_row("requests", str(len(soak.records)))
    summary.add_row("completed", str(soak.completed))
    summary.add_row("errors", f"[{'green' if errors == 0 else 'red'}]{errors}[/]")
    return Group(workers, drift, summary)


def _mib(kib: int, signed: bool = False) -> str:
    return f"{kib / 1024:+.1f}" if signed else f"{kib / 1024:.1f}"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


if __name__ == "__main__":
    sys.exit(main())
