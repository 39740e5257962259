"""A stand-in for the worker, for producer tests: no model, but the same Redis traffic.

It reads requests through the consumer group, "generates" the words of the prompt back,
and writes every event the way the worker does: XADD to the replay stream (capped, with a
TTL) and PUBLISH of the same bytes, in one MULTI. Tests can also write events one by one,
replay-only or publish-only, to stage duplicates, lost publishes and gaps.

    python -m tests.producer.fake_worker [--redis-url URL] --name NAME [--startup-phase P ...]
    (the demo's stand-in)
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time
from dataclasses import dataclass

import msgspec
import redis

from producer.protocol import (FIELD, GROUP, LANES, DoneEvent, ErrorEvent, Event, Keys, Request,
                               Timings, TokenEvent, Usage, decode_request, encode, ensure_group)


def token(seq: int, text: str, attempt: int = 1) -> TokenEvent:
    return TokenEvent(seq=seq, attempt=attempt, ids=[seq], text=text)


def done(seq: int, reason: str = "stop", completion_tokens: int = 0, attempt: int = 1) -> DoneEvent:
    return DoneEvent(seq=seq, attempt=attempt, finish_reason=reason,
                     usage=Usage(prompt_tokens=3, completion_tokens=completion_tokens),
                     timings=Timings(queued=0.01, ttft=0.02, total=0.05))


def error(seq: int, code: str = "internal", message: str = "boom") -> ErrorEvent:
    return ErrorEvent(seq=seq, attempt=1, code=code, message=message)


@dataclass
class Taken:
    lane: str
    entry_id: bytes
    request: Request
    arrived: float


class FakeWorker:
    def __init__(self, url: str, prefix: str = "sb", name: str = "fake", step_delay: float = 0.0) -> None:
        self.redis = redis.Redis.from_url(url, socket_timeout=None)  # BLOCK reads
        self.keys = Keys(prefix)
        self.name = name
        self.step_delay = step_delay
        for lane in LANES:
            ensure_group(self.redis, self.keys.requests(lane))

    def take(self, block_ms: int | None = None, count: int = 10) -> list[Taken]:
        lanes = {self.keys.requests(lane): lane for lane in LANES}
        reply = self.redis.xreadgroup(GROUP, self.name, dict.fromkeys(lanes, ">"), count=count, block=block_ms)
        return [Taken(lanes[stream.decode()], entry_id, decode_request(fields[FIELD]), time.time())
                for stream, entries in reply for entry_id, fields in entries]

    def emit(self, request_id: str, *events: Event, replay: bool = True, publish: bool = True) -> None:
        pipe = self.redis.pipeline(transaction=True)
        for event in events:
            data = encode(event)
            if replay:
                pipe.xadd(self.keys.replay(request_id), {FIELD: data}, maxlen=1000, approximate=True)
                pipe.expire(self.keys.replay(request_id), 3600)
            if publish:
                pipe.publish(self.keys.tokens(request_id), data)
        pipe.execute()

    def finish(self, taken: Taken) -> None:
        stream = self.keys.requests(taken.lane)
        self.redis.xack(stream, GROUP, taken.entry_id)
        self.redis.xdel(stream, taken.entry_id)

    def serve(self, taken: Taken) -> None:
        """Generate the prompt's words back, one event per step, honouring max_tokens
        and cancellation like the worker."""
        request = taken.request
        source = request.prompt if request.prompt is not None else (
            request.messages[-1].content if request.messages else " ".join(map(str, request.prompt_ids)))
        words = [f"{word} " for word in source.split()] or ["? "]
        seq, reason = 0, "stop"
        for word in words:
            if seq == request.params.max_tokens:
                reason = "length"
                break
            if self.redis.exists(self.keys.cancelled(request.id)):
                reason = "cancelled"
                break
            self.emit(request.id, token(seq, word))
            seq += 1
            time.sleep(self.step_delay)
        now = time.time()
        final = DoneEvent(seq=seq, attempt=1, finish_reason=reason,
                          usage=Usage(prompt_tokens=len(words), completion_tokens=seq),
                          timings=Timings(queued=0.001, ttft=min(0.01, now - taken.arrived),
                                          total=now - taken.arrived))
        self.emit(request.id, final)
        self.finish(taken)

    def heartbeat(self, model: str = "fake-model", ttl: int = 10, state: str = "ready", phase: str = "") -> None:
        stats = {"name": self.name, "state": state, "phase": phase, "model": model, "running": 0, "waiting": 0,
                 "kv_usage": 0.0, "tokens_per_s": 0.0, "started_at": time.time()}
        self.redis.set(self.keys.worker(self.name), msgspec.msgpack.encode(stats), ex=ttl)

    def serve_forever(self, stop: threading.Event) -> None:
        while not stop.is_set():
            for taken in self.take(block_ms=50):
                self.serve(taken)


class running:
    """`with running(url) as worker:` serves requests on a thread until the block ends."""

    def __init__(self, url: str, **options) -> None:
        self.worker = FakeWorker(url, **options)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.worker.serve_forever, args=(self.stop,), daemon=True)

    def __enter__(self) -> FakeWorker:
        self.thread.start()
        return self.worker

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(timeout=10)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--redis-url", default=os.environ.get("STREAMBATCH_REDIS_URL"),
                        required="STREAMBATCH_REDIS_URL" not in os.environ,
                        help="as the worker's: the flag or the variable")
    parser.add_argument("--name", default="fake")
    parser.add_argument("--model", default="fake-model")
    parser.add_argument("--step-delay", type=float, default=0.01)
    parser.add_argument("--startup-phase", action="append", default=[],
                        help="beat 'starting' with this phase for --phase-seconds first, printing as it goes (repeatable)")
    parser.add_argument("--phase-seconds", type=float, default=0.3)
    args = parser.parse_args()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    worker = FakeWorker(args.redis_url, name=args.name, step_delay=args.step_delay)
    for phase in args.startup_phase:
        worker.heartbeat(args.model, state="starting", phase=phase)
        phase_ends = time.monotonic() + args.phase_seconds
        while time.monotonic() < phase_ends:
            print(f"still {phase}", flush=True)  # output, as a real worker's compiler or loader gives
            time.sleep(min(0.2, args.phase_seconds))
    while not stop.is_set():
        worker.heartbeat(args.model)
        for taken in worker.take(block_ms=100):
            worker.serve(taken)
    worker.redis.delete(worker.keys.worker(args.name))


if __name__ == "__main__":
    main()
