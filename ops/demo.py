"""make demo: one worker on SmolLM2-135M behind Redis, a handful of chat prompts across
both lanes streamed live, then a TTFT / inter-token latency / throughput summary.

Starts a private redis-server on a free port unless one answers at --redis-url, starts
`python -m worker`, follows its start-up live (the phases its heartbeat reports: loading the
kernels, converting or loading the model, allocating the KV cache ...) until it is ready,
streams the prompts (ops/demo_view.py), and stops everything it started: the worker with
SIGTERM (it drains), then redis-server. It gives up on a worker that exits, or that shows no
progress (no new phase, no new output) for --stall-timeout seconds, and then prints the worker's
last output and keeps its whole log.

    python -m ops.demo [--redis-url URL] [--model smollm2-135m] [--stall-timeout S]
                       [--prompt TEXT ...] [--max-tokens N] [--serve]

With --prompt (repeatable) it streams your prompts instead of its own six. Then it starts the
OpenAI gateway (producer/gateway; requests without an API key are the default tenant's), sends it
one chat request with the openai package, and prints the curl and SDK lines that do the same;
with --serve it keeps everything running until Ctrl-C, so that they work.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import redis
from redis.exceptions import RedisClusterException
from rich.console import Console
from rich.markup import escape

from ops.demo_view import CHAT_PROMPTS, summary, watch_prompts
from ops.tool import ToolError, run_tool
from producer import AsyncProducer
from producer.connect import CLUSTER_ENV, add_cluster_flag, cluster_from_environment, connect
from producer.protocol import DEFAULT_TENANT, Keys, redacted
from producer.stats import parse_heartbeat


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--redis-url", help="use this Redis if it answers (default: a private redis-server)")
    add_cluster_flag(parser)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--name", default="demo-worker", help="the worker's name (its heartbeat key)")
    parser.add_argument("--stall-timeout", type=float, default=600,
                        help="give up on a starting worker that shows no progress for this many seconds")
    parser.add_argument("--timeout", type=float, default=600, help="seconds the prompts may take")
    parser.add_argument("--prompt", action="append", default=[],
                        help="a chat message of your own to stream (repeatable); replaces the demo's prompts")
    parser.add_argument("--max-tokens", type=int, default=160, help="the most tokens per --prompt")
    parser.add_argument("--serve", action="store_true",
                        help="then keep Redis, the worker and the OpenAI gateway running until Ctrl-C, so that the "
                             "printed curl and SDK snippets work")
    args = parser.parse_args(argv)
    if args.max_tokens < 1:
        parser.error("--max-tokens must be at least 1")
    use_cluster_option(parser, args)
    prompts = chosen_prompts(args.prompt, args.max_tokens)
    console = Console()
    return run_tool("demo", lambda: run(console, redis_url=args.redis_url, name=args.name,
                                        stall_timeout=args.stall_timeout, timeout=args.timeout,
                                        worker_command=[sys.executable, "-m", "worker", "--model", args.model],
                                        prompts=prompts, gateway=True, serve=args.serve), console)


def chosen_prompts(messages: list[str], max_tokens: int) -> list[tuple[str, str, dict]]:
    """The user's messages as prompts (label, message, params), or the demo's own when none."""
    return [(f"prompt {number}", message, {"max_tokens": max_tokens})
            for number, message in enumerate(messages, 1)] or CHAT_PROMPTS


def run(console: Console, *, redis_url: str | None, worker_command: list[str], name: str,
        stall_timeout: float, timeout: float, prompts: list[tuple[str, str, dict]] = CHAT_PROMPTS,
        gateway: bool = False, serve: bool = False) -> None:
    """`worker_command` gets `--name NAME` appended (and the Redis URL, see running_process);
    `prompts` as CHAT_PROMPTS. With `gateway`, then one request through the OpenAI gateway, and
    with `serve` everything kept running until Ctrl-C."""
    with tempfile.TemporaryDirectory(prefix="streambatch-demo-") as scratch, contextlib.ExitStack() as stack:
        url = stack.enter_context(redis_at(redis_url, Path(scratch), console))
        log = Path(scratch) / "worker.log"
        command = [*worker_command, "--name", name]
        console.print(f"[bold]worker:[/] starting {' '.join(['python', *command[1:]])}")
        worker = stack.enter_context(running_process(command, log, url))
        try:
            took = wait_until_ready(url, name, worker, log, stall_timeout, console)
            console.print(f"[bold]worker:[/] {name} is ready after {took:.1f} s; submitting {len(prompts)} prompts")
            watched, wall = asyncio.run(_watch_while_alive(url, worker, log, console, prompts, timeout))
        except ToolError as error:
            raise ToolError(f"{error}\nthe worker's whole log: {keep(log)}") from None
        console.print()
        console.print(summary(watched, wall))
        if gateway:
            through_the_gateway(console, stack, url, Path(scratch), name, worker, serve)


def through_the_gateway(console: Console, stack: contextlib.ExitStack, redis_url: str, scratch: Path,
                        worker_name: str, worker: subprocess.Popen, serve: bool) -> None:
    """Start the OpenAI gateway (the default tenant for requests without a key), send it one chat
    request with the openai package, and print the curl and SDK lines that do the same."""
    import openai

    gateway, base_url = running_gateway(stack, redis_url, scratch)
    log = scratch / "gateway.log"
    model = parse_heartbeat(worker_name, redis_client(redis_url).get(Keys().worker(worker_name))).model
    question = "Say hello in French."
    reply = openai.OpenAI(base_url=base_url, api_key="none").chat.completions.create(
        model=model, messages=[{"role": "user", "content": question}], max_tokens=32, temperature=0)
    console.print(f"[bold]gateway:[/] {base_url} answered {question!r} with "
                  f"{escape(repr(reply.choices[0].message.content))}")
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": 32})
    console.print(f"  curl -s {base_url}/chat/completions -H 'Content-Type: application/json' -d '{body}'",
                  soft_wrap=True, highlight=False, markup=False)
    console.print(f'  OpenAI(base_url="{base_url}", api_key="none").chat.completions.create(model="{model}", '
                  f'messages=[{{"role": "user", "content": "{question}"}}])', soft_wrap=True, highlight=False,
                  markup=False)
    if serve:
        console.print("[bold]serving[/] until Ctrl-C")
        while gateway.poll() is None:
            _check_alive(worker, scratch / "worker.log")
            time.sleep(1)
        raise ToolError(f"the gateway exited; its last output:\n{last_lines(log)}")


def running_gateway(stack: contextlib.ExitStack, redis_url: str, scratch: Path) -> tuple[subprocess.Popen, str]:
    """A gateway process on `redis_url` (requests without an API key are the default tenant's),
    logging to scratch/gateway.log, stopped when `stack` closes; -> (it, its base URL ending in /v1)
    once it says ready."""
    log, port = scratch / "gateway.log", free_port()
    command = [sys.executable, "-m", "producer.gateway", "--port", str(port), "--anonymous-tenant", DEFAULT_TENANT,
               "--log-level", "warning"]
    gateway = stack.enter_context(running_process(command, log, redis_url))
    base_url = f"http://127.0.0.1:{port}/v1"
    deadline = time.monotonic() + 60
    while not _ready(base_url):
        if gateway.poll() is not None or time.monotonic() > deadline:
            raise ToolError(f"the gateway did not start; its last output:\n{last_lines(log)}")
        time.sleep(0.2)
    return gateway, base_url


def _ready(base_url: str) -> bool:
    try:
        with urllib.request.urlopen(base_url.removesuffix("/v1") + "/readyz", timeout=2) as reply:
            return reply.status == 200
    except OSError:
        return False


@contextlib.contextmanager
def redis_at(url: str | None, scratch: Path, console: Console) -> Iterator[str]:
    """Yield a URL with a Redis behind it: `url` if it answers, else a private server."""
    if url is not None and _answers(url):
        console.print(f"[bold]redis:[/] using {redacted(url)}")
        yield url
        return
    binary = shutil.which("redis-server")
    if binary is None:
        raise ToolError("redis-server is not installed: run `make setup` (Debian package redis-server)")
    port = free_port()
    private = f"redis://127.0.0.1:{port}/0"
    with started([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                  "--dir", str(scratch)], grace=10, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) as process:
        deadline = time.monotonic() + 10
        while not _answers(private):
            if process.poll() is not None or time.monotonic() > deadline:
                raise ToolError(f"redis-server did not start on port {port}: "
                                f"{process.stderr.read().decode(errors='replace').strip()}")
            time.sleep(0.05)
        why = "" if url is None else f" (nothing answers at {redacted(url)})"
        console.print(f"[bold]redis:[/] started a private redis-server at {private}{why}")
        yield private


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def running_process(command: list[str], log: Path, redis_url: str) -> Iterator[subprocess.Popen]:
    """Run worker `command` on `redis_url` with its output in `log`; on the way out SIGTERM it (the
    worker drains on SIGTERM) and kill it if it is still there after the grace period. The URL goes
    in STREAMBATCH_REDIS_URL, not on the command line, where `ps` would show its password."""
    with log.open("wb") as output, started(command, grace=30, stdout=output, stderr=subprocess.STDOUT,
                                            env=os.environ | {"STREAMBATCH_REDIS_URL": redis_url}) as process:
        yield process


@contextlib.contextmanager
def started(command: list[str], grace: float, **popen) -> Iterator[subprocess.Popen]:
    """A process of `command` (subprocess.Popen's `popen` options), SIGTERMed on the way out and killed after
    `grace` seconds. Ctrl-C and SIGTERM wait while it starts: one that came between the fork and the
    clean-up's taking charge of the process would leave it running on its own (the demo's worker was left
    polling the demo's stopped Redis so, by a SIGTERM just as it started)."""
    process = None
    try:
        with _interrupts_held():
            process = subprocess.Popen(command, **popen)
        yield process
    finally:
        if process is not None:
            _stop(process, grace)


@contextlib.contextmanager
def _interrupts_held() -> Iterator[None]:
    """SIGINT and SIGTERM (which run_tool turns into KeyboardInterrupt) held back until the block has run,
    then raised as KeyboardInterrupt. The handlers are Python's: a child process starts with the default ones."""
    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread only
        yield
        return
    caught: list[int] = []
    held = (signal.SIGINT, signal.SIGTERM)
    previous = [signal.signal(number, lambda number, frame: caught.append(number)) for number in held]
    try:
        yield
    finally:
        for number, handler in zip(held, previous):
            signal.signal(number, handler)
    if caught:
        raise KeyboardInterrupt


def wait_until_ready(url: str, name: str, process: subprocess.Popen, log: Path, stall_timeout: float,
                     console: Console) -> float:
    """Show the worker's start-up phases live until its heartbeat says ready; -> seconds it took.
    Progress is a new phase or new output in its log; a worker that exits, or shows none for
    `stall_timeout` seconds, fails the demo."""
    client = redis_client(url)
    key = Keys().worker(name)
    started = last_progress = time.monotonic()
    phase, phase_started, log_size = None, started, -1
    with console.status("") as status:
        while True:
            _check_alive(process, log)
            value = client.get(key)
            info = parse_heartbeat(key, value) if value else None
            now = time.monotonic()
            if info is not None and info.state == "ready":
                if phase is not None:
                    console.print(f"  [green]✓[/] {escape(phase)} ({now - phase_started:.1f} s)")
                return now - started
            current = (info.phase or info.state or "starting") if info else "starting (importing torch)"
            if current != phase:
                if phase is not None:
                    console.print(f"  [green]✓[/] {escape(phase)} ({now - phase_started:.1f} s)")
                phase, phase_started, last_progress = current, now, now
            size = log.stat().st_size if log.exists() else 0
            if size != log_size:
                log_size, last_progress = size, now
            if now - last_progress > stall_timeout:
                raise ToolError(f"the worker made no progress for {stall_timeout:.0f} s (still {phase!r}); "
                                f"its last output:\n{last_lines(log)}\nRun `make setup` (it builds the kernels and "
                                "converts the model ahead, with timings), or start the worker by hand to watch it: "
                                "`.venv/bin/python -m worker --log-level debug`.")
            status.update(f"[bold]worker:[/] {escape(phase)} ({now - phase_started:.0f} s)")
            time.sleep(0.25)


def keep(log: Path) -> Path:
    """A copy of the worker's log that outlives the demo's scratch directory."""
    kept = Path(tempfile.gettempdir()) / "streambatch-demo-worker.log"
    if log.exists():
        shutil.copyfile(log, kept)
    return kept


async def _watch_while_alive(url: str, worker: subprocess.Popen, log: Path, console: Console,
                             prompts: list[tuple[str, str, dict]], timeout: float):
    """Stream the prompts; if the worker dies meanwhile, say so at once instead of
    waiting for the streams to time out."""
    async with AsyncProducer(url) as producer:
        watching = asyncio.ensure_future(watch_prompts(producer, prompts, console, timeout))
        while not watching.done():
            await asyncio.wait([watching], timeout=0.5)
            if not watching.done() and worker.poll() is not None:
                watching.cancel()
                _check_alive(worker, log)
        try:
            return watching.result()
        except TimeoutError as error:
            raise ToolError(f"{error}; the worker's last output:\n{last_lines(log)}") from None


def _check_alive(process: subprocess.Popen, log: Path) -> None:
    if process.poll() is not None:
        raise ToolError(f"the worker exited with status {process.returncode}; its last output:\n"
                        f"{last_lines(log)}")


def last_lines(log: Path, count: int = 20) -> str:
    lines = log.read_text(errors="replace").splitlines() if log.exists() else []
    return "\n".join(f"  | {line}" for line in lines[-count:]) or "  (no output)"


def _answers(url: str) -> bool:
    try:
        return redis_client(url).ping()
    except (redis.RedisError, RedisClusterException):
        return False


def use_cluster_option(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A tool's --redis-cluster: every client and producer it makes, and every process it starts
    (through $STREAMBATCH_REDIS_CLUSTER), in cluster mode; the cluster is the one --redis-url names
    (a private Redis started for a run is one node)."""
    if args.redis_cluster:
        if args.redis_url is None:
            parser.error("--redis-cluster needs --redis-url naming a node of the cluster")
        os.environ[CLUSTER_ENV] = "1"


def redis_client(url: str):
    """A client for a tool's own reads, on one node or a cluster ($STREAMBATCH_REDIS_CLUSTER)."""
    return connect(url, cluster=cluster_from_environment())


def _stop(process: subprocess.Popen, grace: float) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


if __name__ == "__main__":
    sys.exit(main())
