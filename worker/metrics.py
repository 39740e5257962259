"""Prometheus metrics with vLLM-style names under `streambatch:`, in a registry of their own
per worker (a process may hold several, as the tests do).

Request latencies are measured from the moment this worker took the request from Redis;
counters of the engine's own totals (preemptions, prefix cache) advance by the difference
since the previous step (totals start again from 0 after the engine recovers from a failed step).
"""

from __future__ import annotations

from collections import Counter as Tally
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from producer.protocol import LANES
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


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()

        def histogram(name: str, documentation: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(PREFIX + name, documentation, buckets=buckets, registry=self.registry)

        def gauge(name: str, documentation: str, labels: tuple[str, ...] = ()) -> Gauge:
            return Gauge(PREFIX + name, documentation, labels, registry=self.registry)

        def counter(name: str, documentation: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(PREFIX + name, documentation, labels, registry=self.registry)

        self.time_to_first_token = histogram("time_to_first_token_seconds", "Taken from Redis -> first token.",
                                             FIRST_TOKEN_BUCKETS)
        self.inter_token_latency = histogram("inter_token_latency_seconds", "Gap between a request's tokens.",
                                             INTER_TOKEN_BUCKETS)
        self.e2e_request_latency = histogram("e2e_request_latency_seconds", "Taken from Redis -> finished.",
                                             REQUEST_BUCKETS)
        self.request_queue_time = histogram("request_queue_time_seconds", "Time waiting in the engine.",
                                            REQUEST_BUCKETS)
        self.step_time = histogram("step_time_seconds", "Duration of one engine step.", STEP_BUCKETS)
        self.running = gauge("num_requests_running", "Requests running in the engine.", ("lane",))
        self.waiting = gauge("num_requests_waiting", "Requests waiting in the engine.", ("lane",))
        self.kv_cache_usage = gauge("kv_cache_usage_perc", "Share of KV-cache blocks in use (0-1).")
        self.preemptions = counter("num_preemptions", "Sequences preempted (recomputed later).")
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.request_success = counter("request_success", "Finished requests by reason.", ("finished_reason",))
        self.queue_backlog = gauge("queue_backlog", "Entries in the lane stream (XLEN).", ("lane",))
        self.queue_pending = gauge("queue_pending", "Entries delivered to a worker, not yet acked.", ("lane",))
        self.reclaimed = counter("reclaimed_requests", "Requests taken over from an idle (dead) worker.")
        self.dead_letters = counter("dead_letters", "Entries moved to the dead-letter stream.")
        self.failed_steps = counter("engine_failed_steps", "Engine steps that raised (the engine recovered).")
        self._engine_totals: dict[Counter, int] = {}

    def serve(self, port: int) -> WSGIServer:
        """Serve /metrics in a daemon thread; port 0 picks a free one (`server.server_port`)."""
        server, _ = start_http_server(port, registry=self.registry)
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
        if output.token_ids:
            self.generation_tokens.inc(len(output.token_ids))
            if flight.last_token is not None:
                self.inter_token_latency.observe(now - flight.last_token)
            elif not flight.resumed:
                self.time_to_first_token.observe(now - flight.received)
        if output.finished:
            self.request_success.labels(output.finish_reason).inc()
            self.e2e_request_latency.observe(now - flight.received)
            self.prompt_tokens.inc(output.usage.prompt_tokens)
            self.request_queue_time.observe(output.timings.queued)

    def observe_queue(self, backlog: dict[str, int], pending: dict[str, int]) -> None:
        for lane in LANES:
            self.queue_backlog.labels(lane).set(backlog[lane])
            self.queue_pending.labels(lane).set(pending[lane])
