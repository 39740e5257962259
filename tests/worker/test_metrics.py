"""/metrics serves the vLLM-style names with values that follow the work done, request
latencies by lane; the heartbeat key carries the worker's live stats with a TTL."""

import json
import urllib.request

import msgspec

from producer.protocol import Request, Tenant, encode

from .conftest import KEYS, backlog, greedy, run_until, submit

NAMES = [
    'streambatch:time_to_first_token_seconds_count{lane="fast"}',
    'streambatch:inter_token_latency_seconds_count{lane="normal"}',
    'streambatch:e2e_request_latency_seconds_count{lane="fast"}',
    'streambatch:request_queue_time_seconds_count{lane="normal"}', "streambatch:step_time_seconds_count", 'streambatch:num_requests_running{lane="fast"}',
    'streambatch:num_requests_waiting{lane="normal"}', "streambatch:kv_cache_usage_perc",
    "streambatch:num_preemptions_total", "streambatch:prefix_cache_queries_total",
    "streambatch:prefix_cache_hits_total", "streambatch:prompt_tokens_total", "streambatch:generation_tokens_total",
    'streambatch:request_success_total{finished_reason="length"}', 'streambatch:queue_backlog{lane="fast"}',
    'streambatch:queue_pending{lane="normal"}', 'streambatch:queue_lag{lane="fast"}',
    "streambatch:worker_ready", "streambatch:reclaimed_requests_total", "streambatch:dead_letters_total",
]


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {name: float(value) for name, value in
            (line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))}


def test_metrics_endpoint_and_heartbeat(make_worker, client):
    worker = make_worker(metrics_port=0)
    shared = list(range(2, 40))  # the second request finds the first's full blocks in the prefix cache
    submit(client, Request(id="a", prompt_ids=shared + [7], params=greedy(6)), "fast")
    run_until([worker], lambda: backlog(client) == 0)
    submit(client, Request(id="b", prompt_ids=shared + [8], params=greedy(6)), "fast")
    submit(client, Request(id="c", prompt_ids=[5, 6], params=greedy(500)))
    run_until([worker], lambda: client.xlen(KEYS.requests("fast")) == 0)
    submit(client, Request(id="d", prompt_ids=[5, 6], params=greedy(6)))  # not read by the worker: lag
    worker.housekeeping()

    metrics = scrape(worker.metrics_server.server_port)
    assert [name for name in NAMES if name not in metrics] == []
    assert metrics['streambatch:time_to_first_token_seconds_count{lane="fast"}'] == 2
    assert metrics['streambatch:time_to_first_token_seconds_count{lane="normal"}'] == 1
    assert metrics['streambatch:e2e_request_latency_seconds_count{lane="fast"}'] == 2
    assert metrics['streambatch:e2e_request_latency_seconds_count{lane="normal"}'] == 0
    assert metrics['streambatch:inter_token_latency_seconds_count{lane="fast"}'] == 2 * 5
    assert metrics['streambatch:request_queue_time_seconds_count{lane="fast"}'] == 2
    assert metrics["streambatch:prompt_tokens_total"] == 2 * 39
    assert metrics["streambatch:prefix_cache_hits_total"] == 32  # two full blocks of 16
    assert metrics['streambatch:num_requests_running{lane="normal"}'] == 1
    assert metrics['streambatch:queue_backlog{lane="normal"}'] == 2
    assert metrics['streambatch:queue_pending{lane="normal"}'] == 1
    assert metrics['streambatch:queue_lag{lane="normal"}'] == 1
    assert metrics['streambatch:queue_lag{lane="fast"}'] == 0
    assert metrics["streambatch:worker_ready"] == 1
    assert 0 < metrics["streambatch:kv_cache_usage_perc"] < 1

    stats = json.loads(client.get(KEYS.worker("w1")))
    assert stats["name"] == "w1" and stats["model"] == "random:llama" and stats["running"] == 1
    assert stats["in_flight"] == 1 and stats["waiting"] == 0 and 0 < stats["kv_usage"] < 1
    assert stats["tokens_per_s"] > 0 and (stats["state"], stats["phase"]) == ("ready", "")
    assert 0 < client.pttl(KEYS.worker("w1")) <= worker.config.heartbeat_ttl_ms


def test_metrics_and_the_heartbeat_carry_no_request_text_id_or_tenant_secret(make_worker, client):
    """Anyone on the metrics port's network may scrape it: it holds counts, never what was asked."""
    api_key_sha256 = "ab" * 32
    client.hset(KEYS.tenants, "team-a", msgspec.json.encode(Tenant(api_key_sha256=api_key_sha256)))
    client.hset(KEYS.pins, "pin-secret-name", encode(Request(prompt="pin-secret-text")))
    worker = make_worker(metrics_port=0)
    submit(client, Request(id="id-secret-1", prompt_ids=list(range(5, 40)), params=greedy(4)), keys=KEYS.of("team-a"))
    submit(client, Request(id="id-secret-2", prompt="text-secret", params=greedy(4)))  # refused: no tokenizer
    run_until([worker], lambda: backlog(client) == 0 and backlog(client, KEYS.of("team-a")) == 0
              and not worker.flights)
    worker.housekeeping()
    with urllib.request.urlopen(f"http://127.0.0.1:{worker.metrics_server.server_port}/metrics", timeout=5) as reply:
        exposed = reply.read().decode() + client.get(KEYS.worker("w1")).decode()
    assert scrape(worker.metrics_server.server_port)["streambatch:prompt_tokens_total"] == 35
    assert "secret" not in exposed and api_key_sha256 not in exposed
