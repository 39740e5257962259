"""Prometheus metrics with vLLM-style names under `streambatch:`, in a registry of their own
per worker (a process may hold several, as the tests do), served on the metrics port with the
worker's health checks:

- /metrics: the Prometheus text format (any path other than the two below, as before);
- /healthz: liveness. 200 while the loop turns: a turn completed in the last --stall-timeout
  (a failing turn counts: a Redis outage is not cured by a restart), or the loop has not
  started yet (the engine is loading); 503 once the loop is stuck (a hung step, a deadlock),
  at which point the worker also exits by itself (step_watch.py): compose and systemd restart
  a process that exits, not one that is merely unhealthy;
- /readyz: readiness. 200 only once the engine is loaded (the model, and the native kernels or
  the torch fallback), the latest turn reached Redis, the loop is not stuck and the worker is
  not draining; 503 otherwise. The gauge `worker_ready` says the same.
Each answers a small JSON object: its verdict, the worker's state, and on a 503 the reason.

Request latencies are measured from the moment this worker took the request from Redis and
labelled with the request's lane; counters of the engine's own totals (preemptions, prefix cache)
advance by the difference since the previous step (totals start again from 0 after the engine
recovers from a failed step).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections import Counter as Tally
from dataclasses import dataclass
from http import HTTPStatus
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from producer.protocol import LANES, WorkerState
from worker.config import DEFAULT_STALL_TIMEOUT_S
from worker.engine.engine import Engine
from worker.engine.outputs import RequestOutput
from worker.flight import Flight

PREFIX = "streambatch:"
FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                       10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
INTER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                       1.0, 2.5, 5.0, 10.0)
REQUEST_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                   120.0, 240.0, 480.0, 960.0, 1920.0)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)


def kv_usage(engine: Engine) -> float:
    """Share of KV blocks held by sequences (cached-free blocks count as free)."""
    return 1 - engine.pool.num_free_blocks / engine.pool.num_blocks


@dataclass
class Health:
    """What /healthz and /readyz answer; the worker's loop keeps it current (service.py)."""
    state: WorkerState = "starting"  # "ready" once the engine is loaded, "draining" after SIGTERM
    last_turn: float | None = None  # time.monotonic() when the loop last completed a turn
    # The latest turn's Redis error: the turn after a failed one starts with housekeeping, so a
    # turn that succeeds has reached Redis.
    redis_error: str | None = None
    stall_timeout: float = DEFAULT_STALL_TIMEOUT_S  # WorkerConfig.stall_timeout
    failing_since: float | None = None  # time.monotonic() of the first of the failed turns in a row, if failing

    def stall(self) -> str | None:
        """Why the loop counts as stuck, if it does (the worker then ends itself, step_watch.py)."""
        if self.last_turn is None:
            return None  # not started: the engine is loading
        since = time.monotonic() - self.last_turn
        if since <= self.stall_timeout:
            return None
        return f"the loop has not completed a turn for {since:.0f} s (limit {self.stall_timeout:.0f} s)"

    def failing(self) -> str | None:
        """Why the worker serves nobody though its loop turns, if so: every turn has failed for longer
        than the stall timeout (a lane stream overwritten with another type, say). Reported, so that
        an orchestrator restarts it; not a reason to end itself, as Redis being away for a while is."""
        if self.failing_since is None or time.monotonic() - self.failing_since <= self.stall_timeout:
            return None
        return (f"every turn of the loop has failed for {time.monotonic() - self.failing_since:.0f} s "
                f"(limit {self.stall_timeout:.0f} s): {self.redis_error or 'see the log'}")

    def unready(self) -> str | None:
        """Why the worker is not ready, if it is not."""
        if self.state == "starting":
            return "loading the engine (native kernels, model, KV cache)"
        if self.state == "draining":
            return "draining: finishing the requests it holds, taking no new ones"
        if self.redis_error is not None:
            return f"Redis unreachable: {self.redis_error}"
        return self.stall() or self.failing()

    def liveness(self) -> tuple[HTTPStatus, dict]:
        reason = self.stall() or self.failing()
        if reason is not None:
            return HTTPStatus.SERVICE_UNAVAILABLE, {"alive": False, "state": self.state, "reason": reason}
        return HTTPStatus.OK, {"alive": True, "state": self.state}

    def readiness(self) -> tuple[HTTPStatus, dict]:
        reason = self.unready()
        if reason is not None:
            return HTTPStatus.SERVICE_UNAVAILABLE, {"ready": False, "state": self.state, "reason": reason}
        return HTTPStatus.OK, {"ready": True, "state": self.state}


MAX_CONNECTIONS = 32  # served at once; more are closed at once (a scraper and a probe need two)
READ_TIMEOUT_S = 5.0  # a connection that sends nothing (or too slowly) for this long is closed


class QuietHandler(WSGIRequestHandler):
    timeout = READ_TIMEOUT_S  # the socket's: an idle connection no longer holds its thread for ever

    def log_message(self, format: str, *args: object) -> None:
        """No line per request: an orchestrator probes every few seconds, Prometheus scrapes as often."""


class BoundedServer(ThreadingWSGIServer):
    """A thread per connection, at most MAX_CONNECTIONS of them: the red team's 800 idle
    connections made 804 threads, and at the file limit every turn of the loop failed."""

    # The listen backlog: with socketserver's 5, a flood of connections overflows it and a probe's
    # SYN is dropped, to be sent again 1, 2, 4, ... s later; they are accepted (or closed) at once.
    request_queue_size = 1024

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

    def process_request(self, request, client_address) -> None:
        if not self.slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def handle_error(self, request, client_address) -> None:
        """A connection that timed out or went away is closed without a traceback on stderr (an
        idle flood would print one each); anything else is printed as socketserver does."""
        if not isinstance(sys.exc_info()[1], OSError):
            super().handle_error(request, client_address)


class Metrics:
    def __init__(self, health: Health) -> None:
        self.registry = CollectorRegistry()
        self.health = health

        def histogram(name: str, documentation: str, buckets: tuple[float, ...],
                      labels: tuple[str, ...] = ()) -> Histogram:
            return Histogram(PREFIX + name, documentation, labels, buckets=buckets, registry=self.registry)

        def gauge(name: str, documentation: str, labels: tuple[str, ...] = ()) -> Gauge:
            return Gauge(PREFIX + name, documentation, labels, registry=self.registry)

        def counter(name: str, documentation: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, documentation, labels, registry=self.registry)

        self.time_to_first_token = histogram("time_to_first_token_seconds", "Taken from Redis -> first token.",
                                             FIRST_TOKEN_BUCKETS, ("lane",))
        self.inter_token_latency = histogram("inter_token_latency_seconds", "Gap between a request's tokens.",
                                             INTER_TOKEN_BUCKETS, ("lane",))
        self.e2e_request_latency = histogram("e2e_request_latency_seconds", "Taken from Redis -> finished.",
                                             REQUEST_BUCKETS, ("lane",))
        self.request_queue_time = histogram("request_queue_time_seconds", "Time waiting in the engine.",
                                            REQUEST_BUCKETS, ("lane",))
        for lane in LANES:  # a series per lane from the start, at 0, rather than absent until used
            for latency in (self.time_to_first_token, self.inter_token_latency, self.e2e_request_latency,
                            self.request_queue_time):
                latency.labels(lane)
        self.step_time = histogram("step_time_seconds", "Duration of one engine step.", STEP_BUCKETS)
        self.running = gauge("num_requests_running", "Requests running in the engine.", ("lane",))
        self.waiting = gauge("num_requests_waiting", "Requests waiting in the engine.", ("lane",))
        self.kv_cache_usage = gauge("kv_cache_usage_perc", "Share of KV-cache blocks in use (0-1).")
        self.pinned_blocks = gauge("pinned_kv_blocks", "KV blocks of pinned prefixes resident (computed) now.")
        self.preemptions = counter("num_preemptions", "Sequences preempted (recomputed later).")
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.request_success = counter("request_success", "Finished requests by reason.", ("finished_reason",))
        self.queue_backlog = gauge("queue_backlog", "Entries in the lane stream (XLEN).", ("lane",))
        self.queue_pending = gauge("queue_pending", "Entries delivered to a worker, not yet acked.", ("lane",))
        self.queue_lag = gauge("queue_lag", "Entries no worker has taken yet (backlog - pending).", ("lane",))
        self.worker_ready = gauge("worker_ready", "1 when /readyz answers 200, else 0.")
        self.worker_ready.set_function(lambda: health.unready() is None)
        self.reclaimed = counter("reclaimed_requests", "Requests taken over from an idle (dead) worker.")
        self.dead_letters = counter("dead_letters", "Entries moved to the dead-letter stream.")
        self.failed_steps = counter("engine_failed_steps", "Engine steps that raised (the engine recovered).")
        self._engine_totals: dict[Counter, int] = {}

    def serve(self, host: str, port: int) -> WSGIServer:
        """Serve /metrics, /healthz and /readyz on `host` in a daemon thread (a thread per
        connection, BoundedServer); port 0 picks a free one (`server.server_port`)."""
        metrics_app = make_wsgi_app(self.registry)
        checks = {"/healthz": self.health.liveness, "/readyz": self.health.readiness}

        def app(environ, start_response):
            check = checks.get(environ["PATH_INFO"])
            if check is None:
                return metrics_app(environ, start_response)
            status, body = check()
            start_response(f"{status.value} {status.phrase}", [("Content-Type", "application/json")])
            return [json.dumps(body).encode()]

        server = make_server(host, port, app, BoundedServer, handler_class=QuietHandler)
        threading.Thread(target=server.serve_forever, name="metrics-server", daemon=True).start()
        return server

    def observe_engine(self, engine: Engine) -> None:
        scheduler, pool = engine.scheduler, engine.pool
        running = Tally(seq.lane for seq in scheduler.running)
        for lane in LANES:
            self.running.labels(lane).set(running[lane])
            self.waiting.labels(lane).set(len(scheduler.waiting[lane]))
        self.kv_cache_usage.set(kv_usage(engine))
        for counter, total in ((self.preemptions, scheduler.num_preemptions),
                               (self.prefix_cache_queries, pool.prefix_queries),
                               (self.prefix_cache_hits, pool.prefix_hits),
                               (self.failed_steps, engine.num_failed_steps)):
            previous = self._engine_totals.get(counter, 0)
            counter.inc(total - previous if total >= previous else total)  # the engine restarted its count
            self._engine_totals[counter] = total

    def observe_output(self, flight: Flight, output: RequestOutput, now: float) -> None:
        """Before `flight.last_token` moves to `now`."""
        lane = flight.sequence.lane
        if output.token_ids:
            self.generation_tokens.inc(len(output.token_ids))
            if flight.last_token is not None:
                self.inter_token_latency.labels(lane).observe(now - flight.last_token)
            elif not flight.resumed:
                self.time_to_first_token.labels(lane).observe(now - flight.received)
        if output.finished:
            self.request_success.labels(output.finish_reason).inc()
            self.e2e_request_latency.labels(lane).observe(now - flight.received)
            self.prompt_tokens.inc(output.usage.prompt_tokens)
            self.request_queue_time.labels(lane).observe(output.timings.queued)

    def observe_queue(self, backlog: dict[str, int], pending: dict[str, int], lag: dict[str, int]) -> None:
        for lane in LANES:
            self.queue_backlog.labels(lane).set(backlog[lane])
            self.queue_pending.labels(lane).set(pending[lane])
            self.queue_lag.labels(lane).set(lag[lane])
