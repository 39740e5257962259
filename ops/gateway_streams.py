"""python -m ops.gateway_streams: many SSE streams open at once on one gateway process.

    python -m ops.gateway_streams [--streams 1000] [--max-tokens 16] [--model random:llama] [--json F]

Starts a private redis-server, one worker on --model and one gateway process, then opens
--streams streaming completions on the gateway at once (the openai package's async client, one
connection each) and, for a sample of them, follows the same request directly from Redis with
the producer (producer/gateway's own path minus the gateway). It prints, in one table:
- how many streams completed, with every token, and how long they took;
- the gateway process's peak resident memory, and per open stream;
- the gateway's added latency per token event: the client's arrival of an event through the
  gateway minus a direct consumer's arrival of the same event (P50 / P99, events after each
  sampled stream's first few, when the direct consumer has caught up), and the gateway's own time
  per event from its /metrics histogram.
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
import queue
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

from ops.demo import DemoError, redis_at, running_gateway, running_process, wait_until_ready
from ops.percentile import percentile
from ops.tool import run_tool
from producer import AsyncProducer, TokenEvent

SAMPLED = 10  # streams also followed directly from Redis
SKIPPED_EVENTS = 3  # of each sampled stream: the direct consumer may still be reading the replay
CONNECTIONS_PER_CLIENT = 1000
ID_WAIT_S = 120  # for a sampled stream's first chunk
BULK_NICENESS = 10


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ops.gateway_streams", description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=16)
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
        raise DemoError(f"{figures['failed']} of {args.streams} streams failed")


def _streams(base: str, redis_url: str, args: argparse.Namespace) -> dict:
    """All the streams at once, from three processes: the sampled ones, their direct consumers,
    and the rest (niced), so that neither side of the comparison waits behind the parsing of the
    other streams (monotonic clocks agree across processes)."""
    model = openai.OpenAI(base_url=base + "/v1", api_key="none").models.list().data[0].id
    sampled = min(SAMPLED, args.streams)
    spawn = multiprocessing.get_context("spawn")
    ids, outcomes = spawn.Queue(), spawn.Queue()
    processes = [spawn.Process(target=_direct_consumers, args=(redis_url, sampled, ids, outcomes)),
                 spawn.Process(target=_sampled_streams, args=(base, model, args, sampled, ids, outcomes)),
                 spawn.Process(target=_bulk_streams, args=(base, model, args, range(sampled, args.streams), outcomes))]
    started = time.monotonic()
    for process in processes:
        process.start()
    found = {outcome.kind: outcome for outcome in (outcomes.get(timeout=args.timeout) for _ in processes)}
    for process in processes:
        process.join()
    direct, through_gateway, bulk = found["direct"], found["sampled"], found["bulk"]
    wall = time.monotonic() - started
    durations = bulk.durations + through_gateway.durations
    failures = bulk.failures + through_gateway.failures
    added = [arrivals[seq] - at for request_id, arrivals in through_gateway.arrivals.items()
             for seq, at in direct.direct.get(request_id, {}).items() if seq >= SKIPPED_EVENTS and seq in arrivals]
    return {"streams": args.streams, "completed": len(durations), "failed": len(failures),
            "failures": failures[:5], "wall_s": round(wall, 2),
            "stream_p50_s": round(percentile(durations, 0.5) or 0, 3),
            "stream_p99_s": round(percentile(durations, 0.99) or 0, 3),
            "added_latency_events": len(added),
            "added_latency_p50_ms": round(1e3 * (percentile(added, 0.5) or 0), 2),
            "added_latency_p99_ms": round(1e3 * (percentile(added, 0.99) or 0), 2)}


@dataclass
class Outcome:
    kind: str = "bulk"  # bulk, sampled or direct
    durations: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    arrivals: dict[str, dict[int, float]] = field(default_factory=dict)  # request id -> seq -> when
    direct: dict[str, dict[int, float]] | None = None  # the same, read from Redis directly


def _sampled_streams(base: str, model: str, args: argparse.Namespace, count: int, ids, outcomes) -> None:
    outcomes.put(dataclasses.replace(asyncio.run(_group(base, model, args, range(count), ids)), kind="sampled"))


def _bulk_streams(base: str, model: str, args: argparse.Namespace, indices: range, outcomes) -> None:
    # These clients are the harness, not the system: they yield the CPU to the measuring
    # processes and the gateway (2 cores are shared by all of them).
    os.nice(BULK_NICENESS)
    outcomes.put(asyncio.run(_group(base, model, args, indices)))


def _direct_consumers(redis_url: str, count: int, ids, outcomes) -> None:
    async def follow(producer: AsyncProducer, request_id: str, seen: dict) -> None:
        seen[request_id] = {}
        async for event in producer.stream(request_id):
            if isinstance(event, TokenEvent):
                seen[request_id][event.seq] = time.monotonic()

    async def run() -> Outcome:
        seen: dict[str, dict[int, float]] = {}
        async with AsyncProducer(redis_url) as producer:
            # a sampled stream that fails before its first chunk sends no id: stop waiting for it
            following = []
            for _ in range(count):
                try:
                    request_id = await asyncio.to_thread(ids.get, timeout=ID_WAIT_S)
                except queue.Empty:
                    break
                following.append(asyncio.ensure_future(follow(producer, request_id, seen)))
            await asyncio.gather(*following)
        return Outcome(kind="direct", direct=seen)

    outcomes.put(asyncio.run(run()))


async def _group(base: str, model: str, args: argparse.Namespace, indices: range, ids=None) -> Outcome:
    """Streams for `indices`, each recording when its token events arrived; with `ids`, each
    request id is put there as its stream starts (for the direct consumers)."""
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
                if ids is not None and not arrivals and chunk.id not in outcome.arrivals:
                    ids.put(chunk.id)
                    outcome.arrivals[chunk.id] = arrivals
                if chunk.choices and chunk.choices[0].finish_reason is None:
                    arrivals[len(arrivals)] = time.monotonic()
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
