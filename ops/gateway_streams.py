"""python -m ops.gateway_streams: many SSE streams open at once on one gateway process.

    python -m ops.gateway_streams [--streams 1000] [--max-tokens 32] [--model random:llama] [--json F]

Starts a private redis-server, one worker on --model and one gateway process, then opens
--streams streaming completions on the gateway at once (the openai package's async client, one
connection each) and, for a sample of them, follows the same request directly from Redis with
the producer, in the same process (producer/gateway's own path minus the gateway). It prints, in
one table:
- how many streams completed, with every token, and how long they took;
- the gateway process's peak resident memory, and per open stream;
- the gateway's added latency per token event: the client's arrival of an event through the
  gateway minus the direct consumer's arrival of the same event (P50 / P99, over the events
  written after the direct consumer subscribed, which is when it can first be waiting for one);
  each path's delay from the event's write in Redis (its replay entry's id, a millisecond clock);
  and the gateway's own time per event from its /metrics histogram.
Exits 1 if any stream fails.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import multiprocessing
import os
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import openai
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.table import Table

from ops.demo import redis_at, running_gateway, running_process, wait_until_ready
from ops.percentile import percentile
from ops.tool import ToolError, run_tool
from producer import AsyncProducer, TokenEvent
from producer.protocol import FIELD, decode_event

SAMPLED = 20  # streams also followed directly from Redis
CONNECTIONS_PER_CLIENT = 1000
BULK_NICENESS = 10


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ops.gateway_streams", description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--model", default="random:llama")
    parser.add_argument("--timeout", type=float, default=600, help="seconds the whole run may take")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    console = Console()
    return run_tool("gateway streams", lambda: measure(console, args), console)


def measure(console: Console, args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="streambatch-streams-") as scratch, contextlib.ExitStack() as stack:
        scratch = Path(scratch)
        url = stack.enter_context(redis_at(None, scratch, console))
        worker = stack.enter_context(running_process(
            [sys.executable, "-m", "worker", "--model", args.model, "--name", "streams-worker",
             "--heartbeat-interval", "0.5", "--intake-ahead", "256", "--log-level", "warning"],
            scratch / "worker.log", url))
        wait_until_ready(url, "streams-worker", worker, scratch / "worker.log", 600, console)
        gateway, base_url = running_gateway(stack, url, scratch)
        base = base_url.removesuffix("/v1")
        peak = PeakMemory(gateway.pid)
        with peak:
            figures = _streams(base, url, args)
        figures["gateway_peak_rss_mb"] = round(peak.peak_kib / 1024, 1)
        figures["gateway_rss_per_stream_kib"] = round((peak.peak_kib - peak.first_kib) / args.streams, 1)
        figures |= _gateway_time_per_event(base)
    console.print(_table(figures))
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=2))
    if figures["failed"]:
        raise ToolError(f"{figures['failed']} of {args.streams} streams failed")


def _streams(base: str, redis_url: str, args: argparse.Namespace) -> dict:
    """All the streams at once, from two processes: the sampled ones, each followed also directly
    from Redis in the same process (so both sides of the comparison run under the same load),
    and the rest, niced, so that the measuring process does not wait behind their parsing."""
    model = openai.OpenAI(base_url=base + "/v1", api_key="none").models.list().data[0].id
    sampled = min(SAMPLED, args.streams)
    spawn = multiprocessing.get_context("spawn")
    outcomes = spawn.Queue()
    processes = [spawn.Process(target=_sampled_streams, args=(base, redis_url, model, args, sampled, outcomes)),
                 spawn.Process(target=_bulk_streams, args=(base, model, args, range(sampled, args.streams), outcomes))]
    started = time.monotonic()
    for process in processes:
        process.start()
    found = {outcome.kind: outcome for outcome in (outcomes.get(timeout=args.timeout) for _ in processes)}
    for process in processes:
        process.join()
    through_gateway, bulk = found["sampled"], found["bulk"]
    wall = time.monotonic() - started
    durations = bulk.durations + through_gateway.durations
    failures = bulk.failures + through_gateway.failures
    compared = through_gateway.compared
    added = [gateway - direct for gateway, direct, _ in compared]
    via_gateway = [gateway - written for gateway, _, written in compared]
    direct = [direct - written for _, direct, written in compared]

    def ms(values: list[float], q: float) -> float:
        return round(1e3 * (percentile(values, q) or 0), 2)
    return {"streams": args.streams, "completed": len(durations), "failed": len(failures),
            "failures": failures[:5], "wall_s": round(wall, 2),
            "stream_p50_s": round(percentile(durations, 0.5) or 0, 3),
            "stream_p99_s": round(percentile(durations, 0.99) or 0, 3),
            "added_latency_events": len(added),
            "added_latency_p50_ms": ms(added, 0.5), "added_latency_p99_ms": ms(added, 0.99),
            "written_to_client_p50_ms": ms(via_gateway, 0.5), "written_to_client_p99_ms": ms(via_gateway, 0.99),
            "written_to_direct_p50_ms": ms(direct, 0.5), "written_to_direct_p99_ms": ms(direct, 0.99)}


@dataclass
class Outcome:
    kind: str = "bulk"  # bulk or sampled
    durations: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    # sampled: per token event (arrival through the gateway, direct arrival, its write in Redis), unix seconds
    compared: list[tuple[float, float, float]] = field(default_factory=list)


def _sampled_streams(base: str, redis_url: str, model: str, args: argparse.Namespace, count: int,
                     outcomes) -> None:
    async def run() -> Outcome:
        async with AsyncProducer(redis_url) as producer:
            followed: dict[str, Followed] = {}

            def first_chunk(request_id: str, arrivals: dict[int, float]) -> None:
                followed[request_id] = Followed(arrivals, asyncio.ensure_future(_follow(producer, request_id)))

            outcome = await _group(base, model, args, range(count), first_chunk)
            for request_id, one in followed.items():
                subscribed_at, direct = await one.task
                written = await _written(producer, request_id)
                # Events written before the direct consumer subscribed reach it from the replay
                # stream at once: compare only those it could have been waiting for.
                outcome.compared += [(one.arrivals[seq], direct[seq], written[seq]) for seq in sorted(direct)
                                     if seq in one.arrivals and seq in written and written[seq] > subscribed_at]
            return dataclasses.replace(outcome, kind="sampled")

    outcomes.put(asyncio.run(run()))


@dataclass
class Followed:
    arrivals: dict[int, float]  # through the gateway: token event seq -> when
    task: asyncio.Future  # the direct consumer: -> (when it subscribed, seq -> when)


async def _follow(producer: AsyncProducer, request_id: str) -> tuple[float, dict[int, float]]:
    subscribed_at, seen = time.time(), {}
    async for event in producer.stream(request_id):
        if isinstance(event, TokenEvent):
            seen[event.seq] = time.time()
    return subscribed_at, seen


async def _written(producer: AsyncProducer, request_id: str) -> dict[int, float]:
    """seq -> when the worker wrote the event, from its replay stream's entry id (Redis's clock, ms)."""
    entries = await producer.redis.xrange(producer.keys.replay(request_id))
    return {decode_event(fields[FIELD]).seq: int(entry_id.split(b"-")[0]) / 1e3 for entry_id, fields in entries}


def _bulk_streams(base: str, model: str, args: argparse.Namespace, indices: range, outcomes) -> None:
    # These clients are the harness, not the system: they yield the CPU to the measuring
    # process and the gateway (2 cores are shared by all of them).
    os.nice(BULK_NICENESS)
    outcomes.put(asyncio.run(_group(base, model, args, indices)))


async def _group(base: str, model: str, args: argparse.Namespace, indices: range, first_chunk=None) -> Outcome:
    """Streams for `indices`; with `first_chunk`, each stream's request id and its arrivals (token
    event seq -> when, filled as they come) are handed to it as the stream starts."""
    outcome = Outcome()
    # one connection per stream: a client's pool holds up to 1,000 (the openai package's default)
    clients = [openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=args.timeout)
               for _ in range(-(-len(indices) // CONNECTIONS_PER_CLIENT))]

    async def one(position: int, index: int) -> None:
        started = time.monotonic()
        arrivals: dict[int, float] = {}
        try:
            stream = await clients[position // CONNECTIONS_PER_CLIENT].completions.create(
                model=model, prompt=[5 + index % 50, 6, 7], stream=True, max_tokens=args.max_tokens,
                temperature=0, extra_body={"ignore_eos": True})
            async for chunk in stream:
                if first_chunk is not None and not arrivals:
                    first_chunk(chunk.id, arrivals)
                if chunk.choices and chunk.choices[0].finish_reason is None:
                    arrivals[len(arrivals)] = time.time()
            if len(arrivals) != args.max_tokens:
                outcome.failures.append(f"stream {index}: {len(arrivals)} tokens, not {args.max_tokens}")
            outcome.durations.append(time.monotonic() - started)
        except openai.APIError as error:
            outcome.failures.append(f"stream {index}: {error}")

    await asyncio.gather(*(one(position, index) for position, index in enumerate(indices)))
    for client in clients:
        await client.close()
    return outcome


def _gateway_time_per_event(base: str) -> dict:
    """The gateway's own time per event (arrival from Redis to its SSE write), from its histogram:
    the upper bounds of the buckets holding the median and the 99th percentile."""
    with urllib.request.urlopen(base + "/metrics", timeout=5) as reply:
        families = {family.name: family for family in text_string_to_metric_families(reply.read().decode())}
    buckets = [(float(sample.labels["le"]), sample.value) for sample in
               families["streambatch:gateway_event_latency_seconds"].samples if sample.name.endswith("_bucket")]
    total = buckets[-1][1] or 1

    def bound(q: float) -> float:
        return next(le for le, count in buckets if count >= q * total)
    return {"gateway_time_per_event_p50_ms_at_most": bound(0.5) * 1e3,
            "gateway_time_per_event_p99_ms_at_most": bound(0.99) * 1e3}


class PeakMemory:
    """The highest resident set size of a process, sampled every 50 ms while in the `with` block."""

    def __init__(self, pid: int) -> None:
        self.pid, self.first_kib, self.peak_kib = pid, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _rss_kib(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        return 0

    def _sample(self) -> None:
        while not self._stop.wait(0.05):
            self.peak_kib = max(self.peak_kib, self._rss_kib())

    def __enter__(self) -> PeakMemory:
        self.first_kib = self.peak_kib = self._rss_kib()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def _table(figures: dict) -> Table:
    table = Table("", "", title="SSE streams on one gateway process")
    rows = [
        ("streams completed / opened", f"{figures['completed']} / {figures['streams']}"),
        ("failed", str(figures["failed"])),
        ("wall time", f"{figures['wall_s']} s"),
        ("stream duration P50 / P99", f"{figures['stream_p50_s']} / {figures['stream_p99_s']} s"),
        ("gateway peak RSS", f"{figures['gateway_peak_rss_mb']} MB"),
        ("gateway RSS per open stream", f"{figures['gateway_rss_per_stream_kib']} KiB"),
        ("added latency per event P50 / P99 (client via gateway - direct consumer)",
         f"{figures['added_latency_p50_ms']} / {figures['added_latency_p99_ms']} ms "
         f"({figures['added_latency_events']} events)"),
        ("event written -> client via gateway P50 / P99 (Redis's ms clock)",
         f"{figures['written_to_client_p50_ms']} / {figures['written_to_client_p99_ms']} ms"),
        ("event written -> direct consumer P50 / P99",
         f"{figures['written_to_direct_p50_ms']} / {figures['written_to_direct_p99_ms']} ms"),
        ("gateway's own time per event P50 / P99 (at most)",
         f"{figures['gateway_time_per_event_p50_ms_at_most']:g} / "
         f"{figures['gateway_time_per_event_p99_ms_at_most']:g} ms"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    for failure in figures["failures"]:
        table.add_row("[red]failure[/]", failure)
    return table


if __name__ == "__main__":
    sys.exit(main())
