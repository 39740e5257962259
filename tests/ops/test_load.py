"""ops/load: trace generation, the report's arithmetic on made-up runs, the comparison's ratios and
targets, and the CLI end to end against private deployments on the tiny random model."""

import io
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from ops.demo import free_port, wait_until_ready
from ops.percentile import percentile
from ops.load.__main__ import COMPARE_WORKER_ARGS, build_parser
from ops.load.compare import compare
from ops.load.report import ALL, LaneReport, Percentiles, Report, latencies, summarize, write_requests
from ops.load.slo import compare_slo
from ops.load.runner import RequestRecord, RunResult, WorkerSample
from ops.load.trace import (TOKEN_IDS, arrival_times, at_rate, generate, offered_rate, parse_lengths, read_trace,
                            write_trace)
from producer import DoneEvent
from producer.protocol import Timings, Usage

ROOT = Path(__file__).resolve().parents[2]
PNG = b"\x89PNG\r\n\x1a\n"


# --- traces ------------------------------------------------------------------------------
def test_the_same_seed_gives_the_same_trace_and_another_seed_another():
    options = dict(fast_share=0.3, shared_prefix_share=0.5, output_lengths="lognormal:16,1.5,512")
    assert generate(50, 4.0, seed=7, **options) == generate(50, 4.0, seed=7, **options)
    assert generate(50, 4.0, seed=7, **options) != generate(50, 4.0, seed=8, **options)


def test_the_comparisons_defaults_stay_its_own():
    parser = build_parser()
    parse = parser.parse_args
    compared = parse(["compare"])
    assert compared.rate is None and compared.worker_args == COMPARE_WORKER_ARGS
    for others in (["trace", "--out", "t.jsonl"], ["run"], ["sweep", "--rates", "1,2"]):
        options = parse(others)
        assert options.rate == 6.0, others
        assert getattr(options, "worker_args", "") == "", others

def test_poisson_arrivals_come_at_the_rate_with_exponential_gaps():
    import random

    times = arrival_times(4000, 5.0, random.Random(1))
    gaps = [later - earlier for earlier, later in zip([0.0, *times], times)]
    assert times == sorted(times)
    assert statistics.mean(gaps) == pytest.approx(0.2, rel=0.05)
    assert statistics.stdev(gaps) == pytest.approx(0.2, rel=0.1)  # exponential: stdev = mean


def test_bursty_arrivals_average_the_rate_with_the_peak_to_trough_ratio():
    import random

    period, on_share = 10.0, 0.25
    times = arrival_times(8000, 4.0, random.Random(2), "bursty", peak_to_trough=10.0, burst_period_s=period,
                          burst_on_share=on_share)
    cycles = int(times[-1] // period)
    kept = [t for t in times if t < cycles * period]
    on = sum(1 for t in kept if t % period < on_share * period) / (cycles * period * on_share)
    off = sum(1 for t in kept if t % period >= on_share * period) / (cycles * period * (1 - on_share))
    assert len(kept) / (cycles * period) == pytest.approx(4.0, rel=0.05)
    assert on / off == pytest.approx(10.0, rel=0.15)


def test_lengths_by_name():
    import random

    rng = random.Random(3)
    assert {parse_lengths("fixed:7")(rng) for _ in range(20)} == {7}
    uniform = [parse_lengths("uniform:3,5")(rng) for _ in range(300)]
    assert set(uniform) == {3, 4, 5}
    capped = [parse_lengths("lognormal:50,2,80")(rng) for _ in range(2000)]
    assert min(capped) >= 1 and max(capped) == 80


def test_a_lognormal_with_sigma_2_is_heavy_tailed():
    import random

    rng, lengths = random.Random(4), parse_lengths("lognormal:16,2,100000")
    samples = [lengths(rng) for _ in range(20000)]
    assert percentile(samples, 0.99) > 10 * statistics.mean(samples)


@pytest.mark.parametrize("spec", ["fixed:0", "uniform:9,3", "lognormal:16", "gamma:1,2", "fixed:x"])
def test_a_bad_length_spec_is_refused_with_the_forms_it_takes(spec):
    with pytest.raises(ValueError, match=f"lengths '{spec}'"):
        parse_lengths(spec)


def test_lane_and_shared_prefix_shares():
    trace = generate(2000, 10.0, seed=5, fast_share=0.3, fast_prompt_lengths="uniform:4,8",
                     fast_output_lengths="fixed:5", prompt_lengths="uniform:40,60", output_lengths="uniform:20,30",
                     shared_prefix_share=0.4, shared_prefix_tokens=16, num_prefixes=2)
    fast = [request for request in trace if request.lane == "fast"]
    assert len(fast) / len(trace) == pytest.approx(0.3, abs=0.03)
    assert {request.lane for request in trace} == {"fast", "normal"}
    assert all(request.max_tokens == 5 and 4 <= len(request.prompt_ids) - (16 if request.prefix_id is not None
                                                                           else 0) <= 8 for request in fast)
    shared = [request for request in trace if request.prefix_id is not None]
    assert len(shared) / len(trace) == pytest.approx(0.4, abs=0.03)
    prefixes = {request.prefix_id: request.prompt_ids[:16] for request in shared}
    assert set(prefixes) == {0, 1} and prefixes[0] != prefixes[1]
    assert all(request.prompt_ids[:16] == prefixes[request.prefix_id] for request in shared)
    assert all(token in TOKEN_IDS for request in trace for token in request.prompt_ids)
    assert all(request.ignore_eos and request.temperature == 0.0 for request in trace)


def test_a_trace_survives_its_jsonl_file_and_a_bad_line_is_named(tmp_path):
    trace = generate(20, 3.0, seed=6, fast_share=0.5, shared_prefix_share=0.5)
    write_trace(tmp_path / "trace.jsonl", trace)
    assert read_trace(tmp_path / "trace.jsonl") == trace
    (tmp_path / "bad.jsonl").write_text('{"arrival_s": 0, "prompt_ids": [5], "max_tokens": 3}\n\n{"arrival_s": 1}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:3: .*prompt_ids"):
        read_trace(tmp_path / "bad.jsonl")


def test_the_same_requests_at_another_offered_load():
    trace = generate(200, 2.0, seed=7)
    faster = at_rate(trace, 3.0)
    assert offered_rate(faster) == pytest.approx(3 * offered_rate(trace))
    assert [request.prompt_ids for request in faster] == [request.prompt_ids for request in trace]


# --- the report --------------------------------------------------------------------------
def done(prompt: int, completion: int, cached: int, queued: float, ttft: float) -> DoneEvent:
    return DoneEvent(seq=0, attempt=1, finish_reason="length", usage=Usage(prompt, completion, cached),
                     timings=Timings(queued=queued, ttft=ttft, total=ttft + 1))


def made_up_run() -> RunResult:
    fast = RequestRecord(label="a", lane="fast", submitted=0.0, arrivals=[(0.5, 1), (0.7, 1), (1.0, 2)],
                         end=done(10, 4, 5, queued=0.1, ttft=0.3), finished=1.0)
    normal = RequestRecord(label="b", lane="normal", submitted=1.0, arrivals=[(2.0, 1), (2.5, 1)],
                           end=done(20, 2, 0, queued=0.5, ttft=0.8), finished=3.0)
    refused = RequestRecord(label="c", lane="normal", submitted=1.5, error="refused: the normal lane is full")
    samples = [WorkerSample(at=0.5, kv_usage=0.2, running=1, waiting=0),
               WorkerSample(at=1.0, kv_usage=0.4, running=2, waiting=3)]
    metrics = {"streambatch:num_preemptions_total": 1.0, "streambatch:request_success_total": 2.0,
               "streambatch:prefix_cache_queries_total": 30.0, "streambatch:prefix_cache_hits_total": 5.0}
    return RunResult([fast, normal, refused], started=0.0, ended=3.0, offered_rate=1.0, samples=samples,
                     metrics=metrics, total=3)


def test_percentiles_are_the_demos():
    values = [float(v) for v in range(1, 101)]
    assert Percentiles.of(values) == Percentiles(p50=50.0, p95=95.0, p99=99.0)  # nearest rank
    assert Percentiles.of([]) == Percentiles(None, None, None)


def test_the_report_per_lane():
    run = made_up_run()
    report = summarize(run)
    assert list(report.lanes) == [ALL, "fast", "normal"]
    fast, normal, both = report.lanes["fast"], report.lanes["normal"], report.lanes[ALL]
    assert (both.requests, both.finished, both.failed) == (3, 2, 1)
    assert (normal.requests, normal.finished, normal.failed) == (2, 1, 1)
    assert fast.ttft_s.p50 == pytest.approx(0.5)
    # gaps of 0.2 s before one token, then 0.3 s before two: 0.15 s each
    assert sorted(latencies(run.requests[:1])["itl"]) == pytest.approx([0.15, 0.2])
    assert (fast.itl_s.p50, normal.itl_s.p50) == pytest.approx((0.15, 0.5))  # nearest rank of two
    assert fast.e2e_s.p50 == pytest.approx(1.0) and normal.e2e_s.p50 == pytest.approx(2.0)
    # submit -> first scheduled: the client's TTFT less the worker's first-scheduled -> first-token time
    assert fast.queue_s.p50 == pytest.approx(0.5 - 0.2) and normal.queue_s.p50 == pytest.approx(1.0 - 0.3)
    # over each lane's span: fast 0 -> 1 s, normal 1 -> 3 s, all 0 -> 3 s
    assert (fast.output_tokens_per_s, normal.output_tokens_per_s, both.output_tokens_per_s) == pytest.approx(
        (4.0, 1.0, 2.0))
    assert (fast.effective_concurrency, normal.effective_concurrency, both.effective_concurrency) == pytest.approx(
        (1.0, 1.0, 1.0))
    assert (fast.prefix_hit_rate, normal.prefix_hit_rate, both.prefix_hit_rate) == pytest.approx((0.5, 0.0, 5 / 30))


def test_the_report_of_the_workers():
    report = summarize(made_up_run())
    assert report.duration_s == 3.0 and report.offered_rate == 1.0
    assert report.preemptions == 1 and report.preemption_rate == pytest.approx(0.5)
    assert report.worker_prefix_hit_rate == pytest.approx(5 / 30)
    assert (report.kv_usage_mean, report.kv_usage_max) == pytest.approx((0.3, 0.4))
    assert report.running_mean == pytest.approx(1.5) and report.waiting_share == pytest.approx(0.5)


def test_without_metrics_the_worker_counters_are_unknown_not_zero():
    result = made_up_run()
    result.metrics = {}
    report = summarize(result)
    assert (report.preemptions, report.preemption_rate, report.worker_prefix_hit_rate) == (None, None, None)


def test_the_plots_of_a_run_and_of_a_sweep(tmp_path):
    from ops.load import plots

    run = made_up_run()
    points = [summarize(run), summarize(run)]
    points[1].offered_rate = 2.0
    written = [plots.latency_cdfs({"one": run, "two": run}, tmp_path / "cdfs.png"),
               plots.token_timeline({"one": run, "two": run}, tmp_path / "timeline.png"),
               plots.load_curve(points, tmp_path / "curve.png")]
    assert all(path.read_bytes().startswith(PNG) for path in written)


# --- the comparison ----------------------------------------------------------------------
def lane(tokens_per_s: float, ttft_p99: float = 1.0, itl_p99: float = 0.1, e2e_p99: float = 1.0,
         normalized_p99: float = 0.1, itl_p50: float = 0.0) -> LaneReport:
    return LaneReport(requests=10, finished=10, failed=0, ttft_s=Percentiles(0.0, 0.0, ttft_p99),
                      itl_s=Percentiles(itl_p50, 0.0, itl_p99), e2e_s=Percentiles(0.0, 0.0, e2e_p99),
                      normalized_s=Percentiles(0.0, 0.0, normalized_p99), queue_s=Percentiles(0.0, 0.0, 1.0),
                      output_tokens=100, output_tokens_per_s=tokens_per_s, effective_concurrency=1.0,
                      prefix_hit_rate=None)


def report(lanes: dict[str, LaneReport], waiting_share: float = 0.9) -> Report:
    return Report(duration_s=10.0, offered_rate=5.0, concurrency=None, lanes=lanes, preemptions=0.0,
                  preemption_rate=0.0, worker_prefix_hit_rate=None, kv_usage_mean=0.1, kv_usage_max=0.2,
                  running_mean=4.0, waiting_share=waiting_share)


def reports(waiting_share: float = 0.9) -> tuple[Report, Report, Report, Report]:
    continuous = report({ALL: lane(100.0, ttft_p99=1.0, itl_p99=0.05, e2e_p99=2.0, normalized_p99=0.1)},
                        waiting_share=0.1)
    static = report({ALL: lane(50.0, ttft_p99=4.0, itl_p99=0.1, e2e_p99=7.0, normalized_p99=0.25)})
    saturated = report({ALL: lane(100.0), "fast": lane(10.0, ttft_p99=0.2), "normal": lane(90.0, ttft_p99=1.0)},
                       waiting_share)
    normal_alone = report({ALL: lane(95.0), "normal": lane(95.0)})
    return continuous, static, saturated, normal_alone


def test_the_ratios_and_which_targets_they_meet():
    comparison = compare(*reports())
    assert comparison.throughput_ratio == pytest.approx(2.0)
    assert comparison.ttft_p99_ratio == pytest.approx(4.0)
    assert comparison.itl_p99_ratio == pytest.approx(2.0)
    assert comparison.e2e_p99_ratio == pytest.approx(3.5)
    assert comparison.normalized_p99_ratio == pytest.approx(2.5)
    assert comparison.fast_to_normal_ttft_p99 == pytest.approx(0.2)
    assert comparison.normal_loss == pytest.approx(1 - 90 / 95)
    assert comparison.total_to_normal_alone == pytest.approx(100 / 95)
    assert comparison.saturated and not comparison.same_throughput  # static fell behind: 2x
    assert compare(continuous_at(52.0), *reports()[1:]).same_throughput  # 52 against static's 50
    assert comparison.targets == {  # ITL has no target; normalized latency is only 2.5x better
        "P99 TTFT at least 3x better": True, "P99 normalized latency at least 3x better": False,
        "fast-lane P99 TTFT at most 1/4 of the normal lane's, saturated": True,
        "normal lane loses at most 10% throughput": True}


def continuous_at(tokens_per_s: float) -> Report:
    return report({ALL: lane(tokens_per_s, ttft_p99=1.0, itl_p99=0.05, e2e_p99=2.0, normalized_p99=0.1)})


def test_the_itl_slo_against_none_and_its_targets():
    without = report({ALL: lane(100.0, itl_p99=0.9, itl_p50=0.05)})
    within = report({ALL: lane(95.0, itl_p99=0.14, itl_p50=0.05)})
    comparison = compare_slo(without, within, 0.1)
    assert comparison.throughput_loss == pytest.approx(0.05)
    assert comparison.without_slo.itl_p99_to_median == pytest.approx(18.0)
    assert comparison.with_slo.itl_p99_to_median == pytest.approx(2.8)
    assert list(comparison.targets.values()) == [True, True, True]
    over = compare_slo(without, report({ALL: lane(85.0, itl_p99=0.16, itl_p50=0.05)}), 0.1)
    assert list(over.targets.values()) == [False, False, False]  # 1.6x the SLO, 3.2x the median, 15% lost


def test_normalized_latency_and_the_request_rows_a_figure_is_recomputed_from(tmp_path):
    run = made_up_run()
    report = summarize(run)
    # e2e / tokens: 1 s / 4 tokens, 2 s / 2 tokens
    assert (report.lanes["fast"].normalized_s.p50, report.lanes["normal"].normalized_s.p50) == pytest.approx((0.25, 1.0))
    write_requests(tmp_path / "run.requests.jsonl", run)
    rows = [json.loads(line) for line in (tmp_path / "run.requests.jsonl").read_text().splitlines()]
    assert [row["request_id"] for row in rows] == ["a", "b", "c"]
    fast, normal, refused = rows
    assert (fast["lane"], fast["arrival_s"], fast["first_token_s"], fast["finish_s"], fast["output_tokens"]) == \
        ("fast", 0.0, 0.5, 1.0, 4)
    assert fast["token_events"] == [[0.5, 1], [0.7, 1], [1.0, 2]] and fast["finish_reason"] == "length"
    assert (refused["first_token_s"], refused["finish_s"], refused["error"]) == (None, None,
                                                                               "refused: the normal lane is full")
    recomputed = [(row["finish_s"] - row["arrival_s"]) / row["output_tokens"] for row in (fast, normal)]
    assert recomputed == pytest.approx([report.lanes["fast"].normalized_s.p50, report.lanes["normal"].normalized_s.p50])


def test_the_fast_lane_target_needs_a_saturated_worker():
    comparison = compare(*reports(waiting_share=0.2))
    assert not comparison.saturated
    assert comparison.fast_to_normal_ttft_p99 == pytest.approx(0.2)
    assert not comparison.targets["fast-lane P99 TTFT at most 1/4 of the normal lane's, saturated"]


def test_without_a_fast_lane_its_targets_are_not_met():
    continuous, static, saturated, normal_alone = reports()
    del saturated.lanes["fast"]
    comparison = compare(continuous, static, saturated, normal_alone)
    assert comparison.fast_to_normal_ttft_p99 is None
    assert not comparison.targets["fast-lane P99 TTFT at most 1/4 of the normal lane's, saturated"]


# --- the CLI, end to end -----------------------------------------------------------------
TINY = ["--model", "random:llama", "--worker-args", "--threads 1 --num-blocks 256 --max-num-seqs 4 --intake-ahead 4",
        "--prompt-lengths", "uniform:8,24", "--output-lengths", "uniform:4,12", "--fast-prompt-lengths", "uniform:4,8",
        "--fast-output-lengths", "fixed:4", "--timeout", "120"]


def load(*arguments: str) -> str:
    done = subprocess.run([sys.executable, "-m", "ops.load", *arguments], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_a_live_deployment_in_a_closed_loop_end_to_end(redis_url, launch, tmp_path):
    port = free_port()
    worker = launch([sys.executable, "-m", "worker", "--model", "random:llama", "--redis-url", redis_url,
                     "--name", "live", "--metrics-port", str(port), "--threads", "1", "--num-blocks", "256",
                     "--heartbeat-interval", "0.5"], tmp_path / "worker.log")
    wait_until_ready(redis_url, "live", worker, tmp_path / "worker.log", 60, Console(file=io.StringIO()))
    load("run", *TINY, "--redis-url", redis_url, "--metrics-url", f"http://127.0.0.1:{port}/metrics", "--count", "6",
         "--concurrency", "2", "--out", str(tmp_path))
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["concurrency"] == 2 and report["offered_rate"] is None
    assert (report["lanes"]["all"]["requests"], report["lanes"]["all"]["failed"]) == (6, 0)
    assert report["preemptions"] == 0 and report["preemption_rate"] == 0  # read from the worker's counters


def test_an_open_loop_burst_with_a_shared_prefix_end_to_end(tmp_path):
    """40 requests submitted at once, one running at a time."""
    out = load("run", *TINY, "--worker-args", "--threads 1 --num-blocks 256 --max-num-seqs 1", "--count", "40",
               "--rate", "1000", "--fast-share", "0.25", "--shared-prefix-share", "1", "--shared-prefix-tokens", "32",
               "--out", str(tmp_path))
    assert "output tokens/s" in out and "preemption rate" in out
    report = json.loads((tmp_path / "report.json").read_text())
    assert (report["lanes"]["all"]["requests"], report["lanes"]["all"]["failed"]) == (40, 0)
    assert set(report["lanes"]) == {"all", "fast", "normal"}
    # every prompt starts with the same two blocks: all but the first find them cached
    assert report["lanes"]["all"]["prefix_hit_rate"] > 0 and report["worker_prefix_hit_rate"] > 0
    for plot in ("latency_cdfs.png", "token_timeline.png"):
        assert (tmp_path / plot).read_bytes().startswith(PNG)


def test_a_sweep_end_to_end(tmp_path):
    out = load("sweep", *TINY, "--count", "6", "--rates", "5,50", "--out", str(tmp_path))
    assert "throughput and P99 latency against offered load" in out
    points = json.loads((tmp_path / "sweep.json").read_text())
    assert [point["offered_rate"] for point in points] == pytest.approx([5, 50])
    assert all(point["lanes"]["all"]["requests"] == 6 and point["lanes"]["all"]["failed"] == 0 for point in points)
    assert (tmp_path / "load_curve.png").read_bytes().startswith(PNG)


@pytest.mark.long
def test_compare_runs_both_policies_and_the_fast_lane_saturated_and_not(tmp_path):
    # No --rate: the policies get half of the capacity the saturated static run measured.
    out = load("compare", *TINY, "--count", "10", "--saturated-rate", "40", "--fast-share", "0.3",
               "--load-share", "0.5", "--out", str(tmp_path))
    assert "continuous vs static" in out and "target: P99 TTFT at least 3x better" in out
    assert "target: P99 normalized latency at least 3x better" in out
    written = json.loads((tmp_path / "compare.json").read_text())
    runs = written["runs"]
    assert list(runs) == ["saturated", "saturated, normal lane alone", "static, saturated", "continuous", "static"]
    assert [runs[name]["lanes"]["all"]["requests"] for name in ("continuous", "static", "saturated",
                                                                "static, saturated")] == [10] * 4
    assert all(run["lanes"]["all"]["failed"] == 0 for run in runs.values())
    assert runs["saturated"]["offered_rate"] == runs["static, saturated"]["offered_rate"] == pytest.approx(40)
    capacity = runs["static, saturated"]["lanes"]["all"]["finished"] / runs["static, saturated"]["duration_s"]
    assert runs["continuous"]["offered_rate"] == pytest.approx(0.5 * capacity)
    assert runs["static"]["offered_rate"] == pytest.approx(0.5 * capacity)
    for name in ("saturated", "saturated-normal-lane-alone", "static-saturated", "continuous", "static"):
        rows = [json.loads(line) for line in (tmp_path / f"{name}.requests.jsonl").read_text().splitlines()]
        assert len(rows) == 10 - (name == "saturated-normal-lane-alone") * runs["saturated"]["lanes"]["fast"]["requests"]
    alone = runs["saturated, normal lane alone"]["lanes"]
    assert list(alone) == ["all", "normal"] and alone["normal"]["requests"] == runs["saturated"]["lanes"]["normal"][
        "requests"]
    assert written["comparison"]["throughput_ratio"] > 0 and written["comparison"]["ttft_p99_ratio"] > 0
    for plot in ("latency_cdfs.png", "token_timeline.png"):
        assert (tmp_path / plot).read_bytes().startswith(PNG)


def test_slo_runs_the_worker_with_and_without_it_at_the_same_load(tmp_path):
    # --rate given: no saturated run to measure the capacity (compare's test covers that path)
    out = load("slo", *TINY, "--itl-slo-ms", "50", "--count", "8", "--rate", "20", "--out", str(tmp_path))
    assert "the ITL SLO against none" in out and "target: P99 ITL at most 1.5x the SLO" in out
    written = json.loads((tmp_path / "slo.json").read_text())
    runs = written["runs"]
    assert list(runs) == ["no SLO", "SLO"]
    assert all(run["lanes"]["all"]["failed"] == 0 and run["lanes"]["all"]["requests"] == 8 for run in runs.values())
    assert runs["no SLO"]["offered_rate"] == runs["SLO"]["offered_rate"]
    assert written["comparison"]["itl_slo_s"] == 0.05 and set(written["comparison"]["targets"]) == {
        "P99 ITL at most 1.5x the SLO", "P99 ITL at most 3x the median ITL", "at most 10% of the throughput lost"}
    assert all((tmp_path / f"{name}.requests.jsonl").exists() for name in ("no-slo", "slo"))


def test_each_request_direct_and_through_the_gateway_end_to_end(tmp_path):
    out = load("gateway", *TINY, "--count", "8", "--rate", "20", "--out", str(tmp_path))
    assert "direct vs through the gateway" in out and "gateway / direct" in out
    reports = json.loads((tmp_path / "gateway.json").read_text())
    for via in ("direct", "gateway"):  # each request once each way
        assert (reports[via]["lanes"]["all"]["finished"], reports[via]["lanes"]["all"]["failed"]) == (8, 0), via
    assert reports["gateway"]["lanes"]["all"]["output_tokens"] == reports["direct"]["lanes"]["all"]["output_tokens"]
