"""What a run measured, per lane and for all lanes together: JSON for machines, tables for people.

Latencies are the client's, from the moment it submitted a request (so they include the wait in
Redis):
  TTFT   submit -> first token event;
  ITL    per gap between a request's token events, the gap over the later event's tokens
         (ops/demo_view.py's definition), pooled over the lane's requests;
  e2e    submit -> terminal event;
  normalized  e2e / output tokens, per finished request (the vLLM paper's "normalized latency");
  queue  submit -> first scheduled in an engine: TTFT less the worker's own first-scheduled ->
         first-token time (its timings are durations, so no clocks need to agree).
Output tokens/s and effective concurrency are over the lane's span, from its first submit to its
last end: tokens delivered / span, and the time its requests spent in the system / span (Little's
law: the mean number of its requests submitted and not yet ended). The prefix hit rate is cached
prompt tokens / prompt tokens of its finished requests. Preemption rate (preemptions / requests
finished), the workers' prefix hit rate and KV usage are the workers', for all lanes: they come
from their counters and heartbeats. `waiting_share` is the share of samples in which requests
waited for a worker (in the engines or not yet taken from Redis): near 1, the run saturated them.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
from rich.console import Group
from rich.table import Table

from ops.percentile import percentile
from ops.load.runner import RequestRecord, RunResult
from producer import DoneEvent

ALL = "all"
COUNTER = "streambatch:{}_total"


class Percentiles(msgspec.Struct):
    p50: float | None
    p95: float | None
    p99: float | None

    @classmethod
    def of(cls, values: list[float]) -> Percentiles:
        return cls(percentile(values, 0.5), percentile(values, 0.95), percentile(values, 0.99))


class LaneReport(msgspec.Struct):
    requests: int
    finished: int  # ended with a done event that is not an error
    failed: int  # error events, refused, timed out, streams that failed
    ttft_s: Percentiles
    itl_s: Percentiles
    e2e_s: Percentiles
    normalized_s: Percentiles  # per output token
    queue_s: Percentiles
    output_tokens: int
    output_tokens_per_s: float
    effective_concurrency: float
    prefix_hit_rate: float | None


class Report(msgspec.Struct):
    duration_s: float
    offered_rate: float | None  # requests/s; None for a closed loop
    concurrency: int | None
    lanes: dict[str, LaneReport]  # "all", then each lane the requests went to
    preemptions: float | None
    preemption_rate: float | None
    worker_prefix_hit_rate: float | None
    kv_usage_mean: float | None
    kv_usage_max: float | None
    running_mean: float | None
    waiting_share: float | None


def latencies(records: list[RequestRecord]) -> dict[str, list[float]]:
    """The requests' TTFT, ITL, e2e and queue times in seconds (see the module docstring)."""
    done = [record for record in records if _finished(record)]
    return {
        "ttft": [record.ttft for record in records if record.ttft is not None],
        "itl": [gap for record in records for gap in record.inter_token_latencies],
        "e2e": [record.finished - record.submitted for record in done],
        "normalized": [(record.finished - record.submitted) / record.tokens for record in done if record.tokens],
        "queue": [record.ttft - (record.end.timings.ttft - record.end.timings.queued)
                  for record in done if record.ttft is not None],
    }


def summarize(result: RunResult) -> Report:
    lanes = {ALL: result.requests} | {lane: [r for r in result.requests if r.lane == lane]
                                      for lane in sorted({record.lane for record in result.requests})}
    finished, preemptions, queries, hits = (result.metrics.get(COUNTER.format(name)) for name in (
        "request_success", "num_preemptions", "prefix_cache_queries", "prefix_cache_hits"))
    samples = result.samples
    usages = [sample.kv_usage for sample in samples if sample.kv_usage is not None]
    return Report(
        duration_s=result.ended - result.started, offered_rate=result.offered_rate, concurrency=result.concurrency,
        lanes={lane: lane_report(records) for lane, records in lanes.items()},
        preemptions=preemptions,
        preemption_rate=preemptions / finished if preemptions is not None and finished else None,
        worker_prefix_hit_rate=hits / queries if hits is not None and queries else None,
        kv_usage_mean=sum(usages) / len(usages) if usages else None, kv_usage_max=max(usages, default=None),
        running_mean=sum(sample.running for sample in samples) / len(samples) if samples else None,
        waiting_share=sum(1 for sample in samples if sample.waiting > 0) / len(samples) if samples else None)


def lane_report(records: list[RequestRecord]) -> LaneReport:
    done = [record for record in records if _finished(record)]
    ended = [record for record in records if record.end is not None or record.error is not None]
    measured = latencies(records)
    span = (max(record.finished for record in done) - min(record.submitted for record in records)) if done else 0.0
    tokens = sum(record.tokens for record in records)
    prompt_tokens = sum(record.end.usage.prompt_tokens for record in done)
    return LaneReport(
        requests=len(records), finished=len(done), failed=len(ended) - len(done),
        ttft_s=Percentiles.of(measured["ttft"]), itl_s=Percentiles.of(measured["itl"]),
        e2e_s=Percentiles.of(measured["e2e"]), normalized_s=Percentiles.of(measured["normalized"]),
        queue_s=Percentiles.of(measured["queue"]),
        output_tokens=tokens, output_tokens_per_s=tokens / span if span > 0 else 0.0,
        effective_concurrency=sum(measured["e2e"]) / span if span > 0 else 0.0,
        prefix_hit_rate=sum(record.end.usage.cached_tokens for record in done) / prompt_tokens
        if prompt_tokens else None)


def _finished(record: RequestRecord) -> bool:
    return isinstance(record.end, DoneEvent) and record.end.finish_reason != "error"


def to_json(value) -> bytes:
    return msgspec.json.format(msgspec.json.encode(value), indent=2)


class RequestRow(msgspec.Struct):
    """One request of a run, its times in seconds from the run's start (None: never happened)."""
    index: int  # in the trace
    request_id: str
    lane: str
    arrival_s: float  # submitted
    first_token_s: float | None
    finish_s: float | None  # its terminal event
    output_tokens: int
    token_events: list[tuple[float, int]]  # (arrival, tokens) of each token event
    finish_reason: str | None
    error: str | None


def request_rows(result: RunResult) -> list[RequestRow]:
    def since(at: float | None) -> float | None:
        return None if at is None else at - result.started
    rows = []
    for record in result.requests:
        end = record.end
        rows.append(RequestRow(
            record.index, record.label, record.lane, since(record.submitted),
            since(record.arrivals[0][0]) if record.arrivals else None, since(record.finished), record.tokens,
            [(at - result.started, count) for at, count in record.arrivals],
            getattr(end, "finish_reason", None), record.error or getattr(end, "message", None)))
    return rows


def write_requests(path: Path, result: RunResult) -> Path:
    """The run's requests as JSON lines (RequestRow) at `path`; -> path."""
    encoder = msgspec.json.Encoder()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(encoder.encode(row) + b"\n" for row in request_rows(result)))
    return path


def report_table(report: Report, title: str = "load") -> Group:
    lanes = list(report.lanes)
    table = Table("", *lanes, title=f"{title}: {_load(report)}", title_justify="left")
    rows = [("requests (failed)", lambda lane: f"{lane.requests} ({lane.failed})")]
    for name, attribute in (("TTFT", "ttft_s"), ("ITL", "itl_s"), ("e2e", "e2e_s"),
                            ("normalized (s/token)", "normalized_s"), ("queue", "queue_s")):
        for quantile in ("p50", "p95", "p99"):
            rows.append((f"{name} {quantile} (s)",
                         lambda lane, a=attribute, q=quantile: _seconds(getattr(getattr(lane, a), q))))
    rows += [("output tokens/s", lambda lane: f"{lane.output_tokens_per_s:.1f}"),
             ("effective concurrency", lambda lane: f"{lane.effective_concurrency:.1f}"),
             ("prefix hit rate", lambda lane: _share(lane.prefix_hit_rate))]
    for name, show in rows:
        table.add_row(name, *(show(report.lanes[lane]) for lane in lanes))
    workers = (f"workers: preemption rate {_share(report.preemption_rate)} "
               f"({'-' if report.preemptions is None else int(report.preemptions)} preemptions), "
               f"prefix hit rate {_share(report.worker_prefix_hit_rate)}, "
               f"KV usage mean {_share(report.kv_usage_mean)} max {_share(report.kv_usage_max)}, "
               f"running mean {'-' if report.running_mean is None else f'{report.running_mean:.1f}'}, "
               f"requests waiting in {_share(report.waiting_share)} of samples")
    return Group(table, workers)


def sweep_table(points: list[Report]) -> Table:
    table = Table("offered req/s", "output tokens/s", "P99 TTFT (s)", "P99 ITL (s)", "failed", "waiting share",
                  title="throughput and P99 latency against offered load (all lanes)", title_justify="left")
    for report in points:
        lane = report.lanes[ALL]
        table.add_row("-" if report.offered_rate is None else f"{report.offered_rate:.2f}",
                      f"{lane.output_tokens_per_s:.1f}", _seconds(lane.ttft_s.p99),
                      _seconds(lane.itl_s.p99), str(lane.failed), _share(report.waiting_share))
    return table


def _load(report: Report) -> str:
    if report.offered_rate is None:
        return f"closed loop, concurrency {report.concurrency}"
    return f"{report.offered_rate:.2f} req/s offered"


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _share(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"
