"""The fault campaign's pieces (tests/worker/test_faults.py): a restartable redis-server, real
worker processes, a load driver that submits mixed requests through the Producer with a live
consumer per request, and the checker that holds what they saw against an undisturbed run."""

from __future__ import annotations

import itertools
import json
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import redis

from ops.demo import free_port
from ops.soak import rss_kib
from producer import Producer
from producer.connect import connect
from producer.errors import EventsLost, ProtocolViolation, QueueFull, UnknownRequest
from producer.protocol import (FIELD, GROUP, LANES, TERMINAL, DoneEvent, Event, SamplingParams, TokenEvent,
                               decode_event, decode_request)
from tests.waiting import START_TIMEOUT_S, wait_for
from worker.heartbeat import worker_of

from .conftest import KEYS, MODEL, NUM_BLOCKS, offline, tokens_of

ROOT = Path(__file__).resolve().parents[2]
CLIENT_RETRY_S = 0.1  # a load client's pause before it tries Redis again
LATE_CONSUMERS = 8  # threads that stream the requests not followed live, once the load stops
SYSTEM_PROMPTS = [[(7 * i + 11 * k) % 480 + 2 for k in range(length)] for i, length in enumerate((32, 48, 40))]


# --- Redis ---------------------------------------------------------------------------------
class RedisServer:
    """A redis-server of one test's own with its AOF on (appendfsync everysec), restartable on the
    same port and directory: a SIGTERM writes the AOF out; crash() loses the last writes."""

    def __init__(self, workdir: Path) -> None:
        self.binary = shutil.which("redis-server")
        assert self.binary is not None, "redis-server is not installed: run `make setup`"
        self.workdir, self.port = workdir, free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen | None = None
        self.log = workdir / "redis.log"

    def start(self) -> None:
        self.process = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "yes",
             "--appendfsync", "everysec", "--dir", str(self.workdir), "--logfile", str(self.log)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        probe = redis.Redis.from_url(self.url, socket_connect_timeout=1, socket_timeout=1)

        def answers() -> bool:
            assert self.process.poll() is None, f"redis-server exited: {self.log.read_text()[-2000:]}"
            try:
                return probe.ping()
            except redis.BusyLoadingError:
                return False  # still loading its AOF
            except redis.ConnectionError:
                return False

        wait_for(answers, 30, "redis-server did not start")
        probe.close()

    def stop(self, sig: signal.Signals = signal.SIGTERM) -> None:
        self.process.send_signal(sig)
        self.process.wait(timeout=30)

    def aof_size(self) -> int:
        return self.incremental_aof().stat().st_size

    def crash(self, aof_size: int) -> int:
        """SIGKILL it and cut its AOF back to `aof_size` (taken a moment before): what appendfsync
        everysec may lose when the machine goes down (a killed process alone loses nothing: its
        writes are in the page cache by then). -> bytes of AOF cut."""
        self.stop(signal.SIGKILL)
        aof = self.incremental_aof()
        cut = aof.stat().st_size - aof_size
        with aof.open("r+b") as file:
            file.truncate(aof_size)  # a command cut in half is dropped at load (aof-load-truncated)
        return cut

    def incremental_aof(self) -> Path:
        """The multi-part AOF's file that takes new writes (Redis 7)."""
        manifest = (self.workdir / "appendonlydir").glob("*.manifest")
        lines = next(manifest).read_text().splitlines()
        name = [line.split()[1] for line in lines if line.split()[-1] == "i"][-1]
        return self.workdir / "appendonlydir" / name

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url)


# --- workers -------------------------------------------------------------------------------
class Workers:
    """`python -m worker` processes on the tiny model, one log each; a name restarted keeps its
    name (and heartbeat key; its consumer in the group is new) and gets a fresh log."""

    def __init__(self, url: str, logdir: Path, *flags: str, cluster: bool = False) -> None:
        self.url, self.logdir = url, logdir
        self.flags = (*flags, "--redis-cluster") if cluster else flags
        self.processes: dict[str, subprocess.Popen] = {}
        self.starts: defaultdict[str, int] = defaultdict(int)
        self.client = connect(url, cluster=cluster)

    def start(self, name: str) -> subprocess.Popen:
        self.starts[name] += 1
        with open(self.log_of(name, self.starts[name]), "wb") as log:
            self.processes[name] = subprocess.Popen(
                [sys.executable, "-m", "worker", "--redis-url", self.url, "--model", MODEL, "--name", name,
                 "--num-blocks", str(NUM_BLOCKS), "--threads", "1", "--heartbeat-interval", "0.3",
                 "--reclaim-idle-ms", "1500", *self.flags],
                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        return self.processes[name]

    def log_of(self, name: str, start: int) -> Path:
        return self.logdir / f"{name}.{start}.log"

    def log_events(self, name: str) -> list[dict]:
        """Every JSON log line of every start of `name`."""
        lines = [line for start in range(1, self.starts[name] + 1)
                 for line in self.log_of(name, start).read_text(errors="replace").splitlines()]
        return [json.loads(line) for line in lines if line.startswith("{")]

    def signal(self, name: str, sig: signal.Signals) -> None:
        self.processes[name].send_signal(sig)

    def kill(self, name: str) -> None:
        self.processes[name].kill()
        self.processes[name].wait()

    def ready(self, name: str) -> bool:
        """The current process of `name` beats "ready" (a dead predecessor's beat does not count)."""
        try:
            value = self.client.get(KEYS.worker(name))
        except redis.RedisError:
            return False
        if value is None:
            return False
        beat = json.loads(value)
        return beat["state"] == "ready" and beat["pid"] == self.processes[name].pid

    def wait_ready(self, names: Iterable[str], timeout: float = START_TIMEOUT_S) -> None:
        names = list(names)
        wait_for(lambda: all(self.ready(name) for name in names), timeout, f"workers {names} did not start")

    def rss_kib(self, name: str) -> int:
        return rss_kib(self.processes[name].pid)

    def alive(self) -> dict[str, bool]:
        return {name: process.poll() is None for name, process in self.processes.items()}

    def close(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()
                process.wait()
        self.client.close()


def in_flight(client: redis.Redis, active_ms: int = 1000) -> dict[str, list[str]]:
    """Worker name -> ids of the requests it is serving now: pending entries it refreshed within
    `active_ms` (a dead worker's go stale) whose replay stream has tokens and no end yet."""
    held = defaultdict(list)
    for lane in LANES:
        stream = KEYS.requests(lane)
        pending = [entry for entry in client.xpending_range(stream, GROUP, "-", "+", 1000)
                   if entry["time_since_delivered"] < active_ms]
        if not pending:
            continue
        entries = {entry_id: fields for entry_id, fields in client.xrange(stream)}
        for entry in pending:
            fields = entries.get(entry["message_id"])
            if fields is not None:
                request_id = decode_request(fields[FIELD]).id
                events = replay(client, request_id)
                if events and not isinstance(events[-1], TERMINAL):
                    held[worker_of(entry["consumer"].decode())].append(request_id)
    return held


def token_times(client: redis.Redis, request_ids: Iterable[str]) -> list[tuple[int, int]]:
    """(Redis server ms of the write, tokens) of every token event of these requests, from the
    ids of their replay-stream entries: what the workers served, as Redis clocked it."""
    pipe = client.pipeline(transaction=False)
    for request_id in request_ids:
        pipe.xrange(KEYS.replay(request_id))
    times = []
    for entries in pipe.execute():
        for entry_id, fields in entries:
            event = decode_event(fields[FIELD])
            if isinstance(event, TokenEvent):
                times.append((int(entry_id.split(b"-")[0]), len(event.ids)))
    return times


def server_ms(client: redis.Redis) -> int:
    seconds, microseconds = client.time()
    return seconds * 1000 + microseconds // 1000


def replay(client: redis.Redis, request_id: str) -> list[Event]:
    return [decode_event(fields[FIELD]) for _, fields in client.xrange(KEYS.replay(request_id))]


# --- requests ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Spec:
    """One request as the load submits it."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    deadline_s: float | None = None  # the request's deadline, this long after its submit

    @property
    def reproducible(self) -> bool:
        return self.params.temperature == 0.0 or self.params.seed is not None


def mixed(tag: str, seed: int = 0, normal_tokens: tuple[int, int] = (150, 450),
          deadline_share: float = 0.0, deadline_s: float = 2.0) -> Iterator[Spec]:
    """Endless mixed requests: fast and normal lane, greedy and seeded sampling (temperature > 0
    with a seed: reproducible across a resume), most behind one of three shared system prompts,
    a few with stop token ids (the tiny model has no tokenizer, hence no stop strings)."""
    rng = random.Random(seed)
    for index in itertools.count():
        prefix = rng.choice([[], *SYSTEM_PROMPTS, *SYSTEM_PROMPTS])
        prompt = prefix + [rng.randrange(2, 500) for _ in range(rng.randint(3, 40))]
        fast = rng.random() < 0.4
        sampling = ({"temperature": 0.0} if rng.random() < 0.5 else
                    {"temperature": 0.8, "top_p": 0.95, "seed": rng.randrange(2**32)})
        params = SamplingParams(max_tokens=rng.randint(16, 128) if fast else rng.randint(*normal_tokens),
                                stop_token_ids=[rng.randrange(2, 500)] if rng.random() < 0.2 else [],
                                ignore_eos=rng.random() < 0.7, **sampling)
        deadline = deadline_s if rng.random() < deadline_share else None
        yield Spec(f"{tag}{index}", prompt, params, deadline)


def expected_tokens(model, specs: list[Spec]) -> dict[str, list[int]]:
    """The undisturbed run: the offline engine, a pool's worth of requests at a time."""
    room = NUM_BLOCKS * 16 * 3 // 4
    expected, batch, size = {}, [], 0
    for spec in [*specs, None]:
        cost = 0 if spec is None else len(spec.prompt_ids) + spec.params.max_tokens
        if batch and (spec is None or size + cost > room):
            for done, tokens in zip(batch, offline(model, [s.prompt_ids for s in batch], [s.params for s in batch])):
                expected[done.request_id] = tokens
            batch, size = [], 0
        if spec is not None:
            batch.append(spec)
            size += cost
    return expected


# --- the load ------------------------------------------------------------------------------
@dataclass
class Followed:
    """One request as the load saw it: its submit, and each stream() its consumer ran (more
    than one when a Redis error broke a stream and the consumer streamed again)."""

    spec: Spec
    refused: bool = False  # QueueFull at submit
    submit_errors: list[str] = field(default_factory=list)
    streams: list[list[Event]] = field(default_factory=list)
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (monotonic time, tokens) per token event
    stream_errors: list[str] = field(default_factory=list)  # Redis errors that broke a stream
    end: str | None = None  # "done", or the error that ended the consumer
    end_message: str = ""

    @property
    def events(self) -> list[Event]:
        return self.streams[-1] if self.streams else []

    @property
    def finish_reason(self) -> str | None:
        last = self.events[-1] if self.events else None
        return last.finish_reason if isinstance(last, DoneEvent) else "error" if last is not None else None


class Load:
    """Submits specs at `rate` per second through one Producer. Every `live_every`-th accepted
    request gets a consumer thread that follows it live with stream() (streaming again after a
    Redis error, as a reconnecting consumer does; every `slow_every`-th of them sleeps
    `slow_consumer_s` after each event); the others are streamed late, once the load stops. A
    submit that meets a Redis error is retried with the same id (idempotent)."""

    def __init__(self, url: str, specs: Iterator[Spec], rate: float, stream_timeout: float = 120,
                 max_backlog: int = 10_000, live_every: int = 1, slow_consumer_s: float = 0.0,
                 slow_every: int = 0, cluster: bool = False) -> None:
        self.producer = Producer(url, max_backlog=max_backlog, cluster=cluster)
        self.specs, self.rate, self.stream_timeout = specs, rate, stream_timeout
        self.live_every, self.slow_consumer_s, self.slow_every = live_every, slow_consumer_s, slow_every
        self.followed: list[Followed] = []
        self.consumers: list[threading.Thread] = []
        self.late: list[Followed] = []  # accepted, streamed once the load stops
        self.stopping = threading.Event()
        self.following, self.peak_following = 0, 0  # consumers streaming now, and at most
        self.lock = threading.Lock()
        self.submitter = threading.Thread(target=self._submit_all, name="load-submitter", daemon=True)

    def start(self) -> Load:
        self.submitter.start()
        return self

    def wait_submitted(self) -> None:
        """Until a finite `specs` is all submitted."""
        self.submitter.join()

    def stop(self, timeout: float) -> None:
        """Stop submitting, stream the late ones, and wait for every consumer to end."""
        self.stopping.set()
        self.submitter.join()
        for start in range(LATE_CONSUMERS):
            self._consume(self.late[start::LATE_CONSUMERS], 0.0, f"late-{start}")
        deadline = time.monotonic() + timeout
        for consumer in self.consumers:
            consumer.join(max(0.0, deadline - time.monotonic()))
        hung = [thread.name for thread in self.consumers if thread.is_alive()]
        assert not hung, f"consumers still running {timeout} s after the load stopped: {hung[:10]}"

    @property
    def accepted(self) -> list[Followed]:
        return [followed for followed in self.followed if not followed.refused]

    def _submit_all(self) -> None:
        next_at, accepted = time.monotonic(), 0
        for spec in self.specs:
            if self.stopping.is_set():
                return
            time.sleep(max(0.0, next_at - time.monotonic()))
            next_at = max(next_at + 1 / self.rate, time.monotonic() - 1)  # no burst after a stall
            followed = Followed(spec)
            self.followed.append(followed)
            if not self._submit(followed):
                continue
            accepted += 1
            if accepted % self.live_every:
                self.late.append(followed)
                continue
            slow = self.slow_every and (accepted // self.live_every) % self.slow_every == 0
            self._consume([followed], self.slow_consumer_s if slow else 0.0, spec.request_id)

    def _consume(self, followed: list[Followed], pause_s: float, name: str) -> None:
        def run() -> None:
            for one in followed:
                self._follow(one, pause_s)

        consumer = threading.Thread(target=run, name=name, daemon=True)
        self.consumers.append(consumer)
        consumer.start()

    def _submit(self, followed: Followed) -> bool:
        spec = followed.spec
        while True:
            try:
                deadline = None if spec.deadline_s is None else time.time() + spec.deadline_s
                self.producer.submit(prompt_ids=spec.prompt_ids, params=spec.params, request_id=spec.request_id,
                                     deadline=deadline)
                return True
            except QueueFull:
                followed.refused = True
                return False
            except (redis.RedisError, ConnectionError) as error:  # ConnectionError: the producer's Disconnected
                followed.submit_errors.append(type(error).__name__)
                time.sleep(CLIENT_RETRY_S)

    def _follow(self, followed: Followed, pause_s: float) -> None:
        with self.lock:
            self.following += 1
            self.peak_following = max(self.peak_following, self.following)
        try:
            self._stream(followed, pause_s)
        finally:
            with self.lock:
                self.following -= 1

    def _stream(self, followed: Followed, pause_s: float) -> None:
        ends_at = time.monotonic() + self.stream_timeout
        while True:
            events: list[Event] = []
            followed.streams.append(events)
            followed.arrivals = []
            try:
                for event in self.producer.stream(followed.spec.request_id, max(0.1, ends_at - time.monotonic())):
                    events.append(event)
                    if not isinstance(event, TERMINAL):
                        followed.arrivals.append((time.monotonic(), len(event.ids)))
                    time.sleep(pause_s)
                followed.end = "done"
                return
            except (redis.RedisError, ConnectionError) as error:
                followed.stream_errors.append(type(error).__name__)
                time.sleep(CLIENT_RETRY_S)
            except (EventsLost, UnknownRequest, TimeoutError, ProtocolViolation) as error:
                followed.end, followed.end_message = type(error).__name__, str(error)
                return
            except Exception as error:  # noqa: BLE001 - anything else is a finding, not a dead thread
                followed.end, followed.end_message = type(error).__name__, repr(error)
                return


# --- the checker ---------------------------------------------------------------------------
@dataclass
class Findings:
    """What the checker found, counted and described."""

    requests: int = 0
    completed: int = 0
    refused: int = 0
    deadline: int = 0
    tokens_checked: int = 0
    duplicates: int = 0  # events seen twice by one consumer, or a seq written twice to a replay stream
    losses: int = 0  # requests that did not complete, or whose events are missing
    mismatches: int = 0  # tokens that differ from the undisturbed run
    resumed: int = 0  # requests finished by a later attempt than their first
    broken_streams: int = 0  # stream() calls a Redis error broke (the consumer streamed again)
    submit_retries: int = 0
    problems: list[str] = field(default_factory=list)

    def problem(self, kind: str, request_id: str, what: str) -> None:
        setattr(self, kind, getattr(self, kind) + 1)
        self.problems.append(f"{kind}: {request_id}: {what}")

    def figures(self) -> str:
        return ", ".join(f"{name}={value}" for name, value in vars(self).items() if name != "problems")


def check(client: redis.Redis, load: Load, expected: dict[str, list[int]], producer: Producer | None = None,
          allowed_ends: tuple[str, ...] = ("done",)) -> Findings:
    """Every accepted request: its consumer saw seq 0..n once each, in order, one terminal and
    last; every stream a Redis error broke is a prefix of the last; the tokens equal the
    undisturbed run (for the requests in `expected`); the replay stream holds each seq once, with
    attempts that never go back, and what the consumer saw; with `producer`, a late result()
    agrees. `allowed_ends`: how a consumer may end besides completing (after Redis lost writes:
    EventsLost, UnknownRequest); those are listed as "allowed: ..." and not counted as losses."""
    findings = Findings(requests=len(load.followed))
    for followed in load.followed:
        request_id = followed.spec.request_id
        findings.submit_retries += len(followed.submit_errors)
        findings.broken_streams += len(followed.stream_errors)
        if followed.refused:
            findings.refused += 1
            continue
        if followed.end in allowed_ends and followed.end != "done":
            findings.problems.append(f"allowed: {request_id}: {followed.end}: {followed.end_message}")
        elif followed.end != "done":
            findings.problem("losses", request_id, f"consumer ended with {followed.end}: {followed.end_message}")
        events = followed.events
        for seen in followed.streams:
            seqs = [event.seq for event in seen]
            if len(set(seqs)) != len(seqs):
                findings.problem("duplicates", request_id, f"a consumer saw seqs {seqs}")
            elif seqs != list(range(len(seqs))):
                findings.problem("losses", request_id, f"a consumer saw seqs {seqs} (a gap or out of order)")
            if any(isinstance(event, TERMINAL) for event in seen[:-1]):
                findings.problem("duplicates", request_id, "an event after the terminal one")
        for broken in followed.streams[:-1]:
            if list(map(content, broken)) != list(map(content, events[:len(broken)])):
                findings.problem("mismatches", request_id, "a broken stream is not a prefix of the last one")
        if followed.end != "done":
            continue
        findings.completed += 1
        stored = replay(client, request_id)
        if not stored and "UnknownRequest" in allowed_ends:
            findings.problems.append(f"allowed: {request_id}: gone from Redis after its consumer saw it complete")
            continue
        seqs = [event.seq for event in stored]
        if len(set(seqs)) != len(seqs):
            findings.problem("duplicates", request_id, f"replay stream holds seqs {seqs}")
        attempts = [event.attempt for event in stored]
        if attempts != sorted(attempts):
            findings.problem("mismatches", request_id, f"attempts go back in the replay stream: {attempts}")
        if list(map(content, stored)) != list(map(content, events)):
            differs = next((at for at, (a, b) in enumerate(zip(stored, events)) if content(a) != content(b)),
                           min(len(stored), len(events)))
            findings.problem("mismatches", request_id, f"the replay stream ({len(stored)} events, attempts "
                             f"{sorted(set(attempts))}) differs from what the consumer saw ({len(events)} events, "
                             f"attempts {sorted({event.attempt for event in events})}) from seq {differs} on")
        if events[-1].attempt > events[0].attempt:
            findings.resumed += 1
        if followed.finish_reason == "deadline":
            findings.deadline += 1
            if tokens_of(events):
                findings.problem("mismatches", request_id, "tokens before a deadline finish")
            continue
        if followed.finish_reason not in ("length", "stop"):
            findings.problem("losses", request_id, f"finished with {followed.finish_reason}: {events[-1]}")
            continue
        tokens = tokens_of(events)
        if followed.spec.reproducible and request_id in expected:  # `expected` may hold a sample
            findings.tokens_checked += len(tokens)
            if tokens != expected[request_id]:
                findings.problem("mismatches", request_id, f"tokens {tokens[:8]}... differ from the undisturbed "
                                                           f"{expected[request_id][:8]}...")
        if producer is not None:
            try:
                late = producer.result(request_id, timeout=10)
            except (EventsLost, UnknownRequest, TimeoutError) as error:
                if type(error).__name__ in allowed_ends:
                    findings.problems.append(f"allowed: {request_id}: a late result(): {type(error).__name__}: {error}")
                else:
                    findings.problem("losses", request_id, f"a late result(): {type(error).__name__}: {error}")
                continue
            if late.token_ids != tokens or late.finish_reason != followed.finish_reason:
                findings.problem("mismatches", request_id, "a late result() differs from the live stream")
    return findings


def content(event: Event) -> tuple:
    """What an event says, without who wrote it or when: a request re-run after Redis lost its
    last writes rewrites the same content with another attempt and other timings."""
    if isinstance(event, TokenEvent):
        return event.seq, "token", tuple(event.ids)
    if isinstance(event, DoneEvent):
        return event.seq, "done", event.finish_reason, event.usage.completion_tokens
    return event.seq, "error", event.code


def dead_letters(client: redis.Redis) -> list[dict]:
    return [{key.decode(): value for key, value in fields.items() if key != b"entry"}
            for _, fields in client.xrange(KEYS.dead_letters)]
