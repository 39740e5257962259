"""Drive a trace through the real path: producer -> Redis -> worker(s) -> streams.

Open loop by default: each request is submitted at its arrival_s, whether or not earlier ones have
finished (so a slow worker cannot slow the offered load down). With `concurrency=N` it is a closed
loop instead: N clients, each submitting its next request when its previous one ends.

Per request it records what the client saw (perf_counter seconds): when it was submitted, when each
token event arrived and with how many tokens, when it ended and how, the worker's usage and timings.
Meanwhile it samples the workers' heartbeats (KV usage, running, waiting) and the lane streams'
backlog, and, given the workers' /metrics URLs, reads their counters (preemptions, prefix cache,
requests) before and after, so that the report can say what this run cost them.

`private_deployment()` starts a deployment of its own (a redis-server and one `python -m worker`,
as ops/demo.py does) for a run that must not share the workers with anybody.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import openai
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console
from rich.live import Live

from ops.demo import free_port, redis_at, running_process, wait_until_ready
from ops.demo_view import Watched
from ops.load.progress import progress_view
from ops.load.trace import TraceRequest, offered_rate
from ops.tool import ToolError
from producer import AsyncProducer, ProducerError, TokenEvent, pick_lane
from producer.protocol import LANES

SAMPLE_INTERVAL_S = 0.5
HEARTBEAT_INTERVAL_S = 0.5  # of a private worker: the samples see its stats this fresh
METRICS_TIMEOUT_S = 5.0


@dataclass
class RequestRecord(Watched):
    """One request of the trace as the client saw it; `label` is its request id."""

    index: int = 0  # in the trace
    prefix_id: int | None = None  # the trace's: which shared system prompt it starts with
    finished: float | None = None  # when its terminal event arrived
    error: str | None = None  # why it has no terminal event: refused, timed out, stream failed
    via: str = "producer"  # or "gateway"


@dataclass
class WorkerSample:
    at: float  # perf_counter
    kv_usage: float | None  # mean over the ready workers
    running: int
    waiting: int  # in the engines, plus what no worker has taken from the lane streams yet


@dataclass
class RunResult:
    requests: list[RequestRecord]  # in the order they were submitted
    started: float  # perf_counter
    ended: float
    offered_rate: float | None  # requests/s of the open-loop trace; None for a closed loop
    concurrency: int | None = None
    samples: list[WorkerSample] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)  # the workers' counters: after - before
    total: int = 0  # requests in the trace


def run(trace: list[TraceRequest], redis_url: str, *, concurrency: int | None = None, timeout: float = 600.0,
        metrics_urls: Sequence[str] = (), prefix: str = "sb", console: Console | None = None,
        gateway_url: str | None = None, gateway_every: int = 1) -> RunResult:
    """Run the trace; `timeout` bounds the whole run: what has not ended by then is cancelled and
    recorded as timed out. With a console, a live progress view shows while it runs. With
    `gateway_url` (its /v1 base), every `gateway_every`-th request of the trace (all of them by
    default) goes through the OpenAI gateway instead of the producer (a streamed completion of its
    token ids, with the openai package): 2 interleaves the two paths in one run."""
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    return asyncio.run(_run(trace, redis_url, concurrency, timeout, list(metrics_urls), prefix, console, gateway_url,
                            gateway_every))


async def _run(trace, redis_url, concurrency, timeout, metrics_urls, prefix, console, gateway_url,
               gateway_every) -> RunResult:
    before = await asyncio.to_thread(read_counters, metrics_urls)
    order = sorted(range(len(trace)), key=lambda index: trace[index].arrival_s)
    result = RunResult([], time.perf_counter(), 0.0, None if concurrency else offered_rate(trace),
                       concurrency, total=len(trace))
    deadline = result.started + timeout
    run_id = uuid.uuid4().hex[:8]
    gateway = None if gateway_url is None else openai.AsyncOpenAI(base_url=gateway_url, api_key="none",
                                                                  max_retries=0, timeout=timeout)
    model = None if gateway is None else (await gateway.models.list()).data[0].id
    async with AsyncProducer(redis_url, prefix=prefix) as producer:
        async def one(index: int) -> None:
            request = trace[index]
            # the producer's lane rule, until the producer says (a refused request never does)
            lane = pick_lane(len(request.prompt_ids), request.max_tokens, request.lane)
            record = RequestRecord(label=f"load-{run_id}-{index}", lane=lane, submitted=time.perf_counter(),
                                   index=index, prefix_id=request.prefix_id)
            result.requests.append(record)
            if gateway is not None and index % gateway_every == 0:
                record.via = "gateway"
                await _follow_gateway(gateway, model, producer, request, record, deadline)
            else:
                await _follow(producer, request, record, deadline)

        if concurrency is None:
            clients = [_open_loop(trace, order, result.started, one)]
        else:
            queue = iter(order)
            clients = [_closed_loop(queue, one) for _ in range(concurrency)]
        driving = asyncio.ensure_future(asyncio.gather(*clients))
        with contextlib.ExitStack() as stack:
            live = None if console is None else stack.enter_context(
                Live(progress_view(result), console=console, auto_refresh=False, transient=True))
            while not driving.done():
                await asyncio.wait([driving], timeout=SAMPLE_INTERVAL_S)
                result.samples.append(await _sample(producer))
                if live is not None:
                    live.update(progress_view(result), refresh=True)
        driving.result()
    if gateway is not None:
        await gateway.close()
    result.ended = time.perf_counter()
    after = await asyncio.to_thread(read_counters, metrics_urls)
    result.metrics = {name: value - before.get(name, 0.0) for name, value in after.items()}
    return result


async def _open_loop(trace: list[TraceRequest], order: list[int], started: float, one) -> None:
    tasks = []
    for index in order:
        delay = started + trace[index].arrival_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.ensure_future(one(index)))
    await asyncio.gather(*tasks)


async def _closed_loop(queue: Iterator[int], one) -> None:
    for index in queue:  # the clients share the iterator: each takes the next request
        await one(index)


async def _follow(producer: AsyncProducer, request: TraceRequest, record: RequestRecord, deadline: float) -> None:
    params = {"max_tokens": request.max_tokens, "temperature": request.temperature, "seed": request.seed,
              "ignore_eos": request.ignore_eos}
    try:
        handle = await producer.submit(prompt_ids=request.prompt_ids, params=params, lane=request.lane,
                                       request_id=record.label)
    except ProducerError as error:  # QueueFull, InvalidRequest, Disconnected
        record.error = f"refused: {error}"
        return
    record.lane = handle.lane
    try:
        async for event in handle.stream(timeout=max(0.001, deadline - time.perf_counter())):
            if isinstance(event, TokenEvent):
                record.arrivals.append((time.perf_counter(), len(event.ids)))
            else:
                record.end, record.finished = event, time.perf_counter()
    except TimeoutError:
        record.error = "timed out"
        await producer.cancel(record.label)  # or the worker goes on with it after the run
    except ProducerError as error:
        record.error = f"stream failed: {error}"


async def _follow_gateway(gateway: openai.AsyncOpenAI, model: str, producer: AsyncProducer, request: TraceRequest,
                          record: RequestRecord, deadline: float) -> None:
    """As _follow, through the gateway: one streamed completion (a chunk per token event; the lane
    is the gateway's rule's, OpenAI's API names none); the request's own end (usage, the
    worker's timings) is then read from Redis by the id it got."""
    request_id = None
    try:
        stream = await gateway.completions.create(
            model=model, prompt=request.prompt_ids, max_tokens=request.max_tokens, temperature=request.temperature,
            seed=request.seed, stream=True, extra_body={"ignore_eos": request.ignore_eos},
            timeout=max(0.001, deadline - time.perf_counter()))
        async for chunk in stream:
            request_id = chunk.id
            if chunk.choices and chunk.choices[0].finish_reason is None:
                record.arrivals.append((time.perf_counter(), 1))
        record.finished = time.perf_counter()
        record.label = request_id
        record.end = (await producer.events(request_id))[-1]
    except openai.APITimeoutError:
        record.error = "timed out"
    except openai.APIError as error:
        record.error = f"refused: {error}" if request_id is None else f"stream failed: {error}"


async def _sample(producer: AsyncProducer) -> WorkerSample:
    stats = await producer.stats()
    ready = [worker for worker in stats.workers if worker.state == "ready"]
    usages = [worker.kv_usage for worker in ready if worker.kv_usage is not None]
    not_taken = sum(max(0, stats.lanes[lane].backlog - stats.lanes[lane].pending) for lane in LANES)
    return WorkerSample(at=time.perf_counter(), kv_usage=sum(usages) / len(usages) if usages else None,
                        running=sum(worker.running or 0 for worker in ready),
                        waiting=sum(worker.waiting or 0 for worker in ready) + not_taken)


def read_counters(metrics_urls: Sequence[str]) -> dict[str, float]:
    """Every counter the workers export (`..._total`, summed over labels and workers)."""
    totals: dict[str, float] = {}
    for url in metrics_urls:
        with urllib.request.urlopen(url, timeout=METRICS_TIMEOUT_S) as response:
            text = response.read().decode()
        for family in text_string_to_metric_families(text):
            if family.type == "counter":
                for sample in family.samples:
                    if sample.name.endswith("_total"):
                        totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


@contextlib.contextmanager
def private_deployment(worker_args: Sequence[str] = (), model: str = "smollm2-135m", *,
                       console: Console | None = None, stall_timeout: float = 600,
                       name: str = "load-worker") -> Iterator[tuple[str, str]]:
    """A private redis-server and one `python -m worker --model MODEL *worker_args` on it, ready;
    yields (redis_url, metrics_url) and stops both on the way out."""
    console = console or Console(file=io.StringIO())
    with tempfile.TemporaryDirectory(prefix="streambatch-load-") as scratch, contextlib.ExitStack() as stack:
        url = stack.enter_context(redis_at(None, Path(scratch), console))
        port = free_port()
        log = Path(scratch) / "worker.log"
        command = [sys.executable, "-m", "worker", "--model", model, "--name", name,
                   "--metrics-port", str(port), "--heartbeat-interval", str(HEARTBEAT_INTERVAL_S), *worker_args]
        console.print(f"[bold]worker:[/] starting {' '.join(['python', *command[1:]])}")
        worker = stack.enter_context(running_process(command, log, url))
        took = wait_until_ready(url, name, worker, log, stall_timeout, console)
        console.print(f"[bold]worker:[/] ready after {took:.1f} s")
        yield url, f"http://127.0.0.1:{port}/metrics"
        if worker.poll() is not None:
            raise ToolError(f"the worker exited with status {worker.returncode} during the run")
