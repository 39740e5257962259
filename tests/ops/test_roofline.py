"""ops/roofline: a step's FLOPs and bytes from the geometry, its class, a class's figures against the
peaks on made-up steps, the workload kinds, and `python -m ops.roofline --quick` end to end on the tiny
random model (seconds)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ops.bench_offline import LONG_PROMPT_TOKENS, SYSTEM_PROMPT_LENGTH, synthetic_workload
from ops.roofline.costs import FULL_DECODE, Geometry, step_class, step_costs, summarize
from ops.roofline.steps import PARTS, Step, pair

ROOT = Path(__file__).resolve().parents[2]
GEOMETRY = Geometry(layer_weights=1000, head_weights=200, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                    itemsize=4)


def step(seqs, sampled, seconds=1.0, linear_s=0.4, attention_s=0.2, forward_s=0.8, sampling_s=0.1,
         plain_s=None) -> Step:
    return Step(seconds, seqs, sampled, linear_s, attention_s, forward_s, sampling_s,
                seconds if plain_s is None else plain_s)


def test_a_steps_flops_and_bytes_follow_the_geometry():
    # a 5-token prompt from scratch, and two decodes at positions 3 and 10; all three sample
    cost = step_costs(step([(0, 5), (3, 1), (10, 1)], sampled=3), GEOMETRY)
    assert cost.linear_flops == 2 * (1000 * 7 + 200 * 3)
    keys = (1 + 2 + 3 + 4 + 5) + 4 + 11  # causal: position p sees p + 1 keys
    assert cost.attention_flops == 4 * 2 * 4 * 8 * keys  # q.k and p.v, 2 FLOPs a multiply-add, per layer and head
    assert cost.weight_bytes == (1000 + 200) * 4
    kv_per_token = 2 * 2 * 2 * 8 * 4  # K and V, layers, KV heads, head_dim, bytes
    assert cost.kv_bytes == kv_per_token * ((5 + 5) + (4 + 1) + (11 + 1))  # each context read, new tokens written
    assert cost.flops == cost.linear_flops + cost.attention_flops and cost.bytes == cost.weight_bytes + cost.kv_bytes


def test_a_chunk_that_samples_nothing_skips_lm_head_and_a_sliding_window_caps_the_keys():
    assert step_costs(step([(0, 6)], sampled=0), GEOMETRY).weight_bytes == 1000 * 4
    windowed = Geometry(**vars(GEOMETRY) | {"sliding_window": 4})
    keys = (1 + 2 + 3 + 4 + 4) + 4 + 4
    assert step_costs(step([(0, 5), (3, 1), (10, 1)], sampled=3), windowed).attention_flops == 4 * 2 * 4 * 8 * keys


@pytest.mark.parametrize("seqs, kind", [
    ([(0, 9), (3, 1)], "prefill-heavy"),  # 90% of the tokens in a prefill chunk
    ([(0, 5), (3, 1), (10, 1)], "mixed"),
    ([(3, 1), (10, 1)], "decode"),
])
def test_steps_are_classed_by_their_prefill_share(seqs, kind):
    assert step_class(step(seqs, sampled=1)) == kind


def test_a_class_sums_its_steps_against_the_peaks():
    steps = [step([(0, 100)], 1, seconds=0.5), step([(100, 1), (50, 1)], 2, seconds=0.1, linear_s=0.05,
                                                    attention_s=0.01, forward_s=0.07, sampling_s=0.01)]
    summary = summarize(steps, GEOMETRY, gemm_gflops=1e-3, bandwidth_gbps=1e-4)
    assert list(summary) == ["prefill-heavy", "decode", "all"]
    costs = [step_costs(s, GEOMETRY) for s in steps]
    assert summary["all"]["gflops"] == pytest.approx(sum(c.flops for c in costs) / 0.6 / 1e9)
    assert summary["decode"]["share_of_gemm_peak"] == pytest.approx(costs[1].flops / 0.1 / 1e6)
    bound = max(costs[1].flops / 1e6, costs[1].bytes / 1e5)  # the slower of compute and memory
    assert summary["decode"]["share_of_roofline"] == pytest.approx(bound / 0.1)
    assert summary["prefill-heavy"]["linear_gflops"] == pytest.approx(costs[0].linear_flops / 0.4 / 1e9)
    assert summary["decode"]["time_split"] == pytest.approx(
        {"linear": 0.5, "attention": 0.1, "sampling": 0.1, "other": 0.1, "host": 0.2})


def test_rates_are_the_plain_runs_and_the_split_the_timed_runs():
    timed = step([(100, 1), (50, 1)], 2, seconds=0.1, linear_s=0.05, attention_s=0.01, forward_s=0.07,
                 sampling_s=0.01, plain_s=0.08)
    cost = step_costs(timed, GEOMETRY)
    f = summarize([timed], GEOMETRY, gemm_gflops=1e-3, bandwidth_gbps=1e-4)["decode"]
    assert f["ms_per_step"] == pytest.approx(80) and f["timed_ms_per_step"] == pytest.approx(100)
    assert f["gflops"] == pytest.approx(cost.flops / 0.08 / 1e9)
    assert f["share_of_roofline"] == pytest.approx(max(cost.flops / 1e6, cost.bytes / 1e5) / 0.08)
    assert f["time_split"] == pytest.approx({"linear": 0.5, "attention": 0.1, "sampling": 0.1, "other": 0.1, "host": 0.2})


def test_the_roofline_by_part_adds_up_the_linear_layers_and_attentions_own_bounds():
    # a batch of decodes: its linear layers bound by compute, its attention by the K/V bytes
    decode = step([(500, 1)] * 64, 64, seconds=1.0)
    cost = step_costs(decode, GEOMETRY)
    flops_per_s, bytes_per_s = 1e6, 1e5
    linear_s, attention_s = cost.linear_flops / flops_per_s, cost.kv_bytes / bytes_per_s
    assert linear_s > cost.weight_bytes / bytes_per_s and attention_s > cost.attention_flops / flops_per_s
    f = summarize([decode], GEOMETRY, gemm_gflops=1e-3, bandwidth_gbps=1e-4)["decode"]
    assert f["share_of_roofline_by_part"] == pytest.approx(linear_s + attention_s)
    assert f["share_of_roofline"] == pytest.approx(max(cost.flops / flops_per_s, cost.bytes / bytes_per_s))
    assert f["share_of_roofline_by_part"] > f["share_of_roofline"]


def test_each_timed_step_gets_the_plain_runs_time_of_the_same_step():
    plain = [step([(0, 9)], 1, seconds=0.3), step([(9, 1)], 1, seconds=0.1)]
    timed = [step([(0, 9)], 1, seconds=0.4), step([(9, 1)], 1, seconds=0.2)]
    paired = pair(plain, timed)
    assert [(s.seconds, s.plain_s) for s in paired] == [(0.4, 0.3), (0.2, 0.1)]
    with pytest.raises(RuntimeError, match="different steps"):
        pair(plain, [timed[0], step([(9, 1), (0, 4)], 2)])


def test_decode_steps_of_64_sequences_or_more_are_summed_apart_too():
    full, short = step([(100, 1)] * 64, 64, seconds=0.2), step([(100, 1)] * 63, 63, seconds=0.1)
    summary = summarize([full, short], GEOMETRY, gemm_gflops=1e-3, bandwidth_gbps=1e-4)
    assert list(summary) == ["decode", FULL_DECODE, "all"] and FULL_DECODE == "decode, 64+ seqs"
    assert (summary[FULL_DECODE]["steps"], summary[FULL_DECODE]["decode_rows"]) == (1, 64)
    assert summary[FULL_DECODE]["share_of_roofline"] == pytest.approx(
        summarize([full], GEOMETRY, gemm_gflops=1e-3, bandwidth_gbps=1e-4)["decode"]["share_of_roofline"])


def test_the_long_and_chat_workloads():
    long = synthetic_workload(512, kind="long")
    assert len(long) == 48
    assert sum(LONG_PROMPT_TOKENS[0] <= len(ids) <= LONG_PROMPT_TOKENS[1] for ids, _ in long) == 16
    chat = synthetic_workload(512, kind="chat")
    heads = [tuple(ids[:SYSTEM_PROMPT_LENGTH]) for ids, _ in chat]
    assert len(chat) == 96 and max(map(heads.count, heads)) == round(0.6 * 96)  # the shared system prompt


@pytest.mark.alone  # the peaks, measured first, against the run: a neighbour's load in between skews the share
def test_a_quick_run_end_to_end(tmp_path):
    figures_path, plot_path = tmp_path / "roofline.json", tmp_path / "roofline.png"
    # A small token budget: prompts go in over several steps, decodes join them (mixed steps)
    done = subprocess.run([sys.executable, "-m", "ops.roofline", "--model", "random:llama", "--quick",
                           "--token-budget", "64", "--num-blocks", "256", "--json", str(figures_path),
                           "--plot", str(plot_path)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "GEMM peak" in done.stdout and "GFLOP/s" in done.stdout and "Where the time goes" in done.stdout
    figures = json.loads(figures_path.read_text())
    peaks = figures["peaks"]
    assert peaks["gemm_peak_gflops"]["float32"]["gflops"] > 0 and peaks["bandwidth_gbps"] > 0
    assert figures["peaks_after"]["gemm_gflops"] > 0 and figures["peaks_after"]["bandwidth_gbps"] > 0
    assert "the peaks again after the runs" in done.stdout
    assert list(figures["classes"]) == ["prefill-heavy", "mixed", "decode", "all"]
    for kind, f in figures["classes"].items():
        assert sum(f["time_split"].values()) == pytest.approx(1.0), kind
        assert set(f["time_split"]) == set(PARTS) and min(f["time_split"].values()) >= 0, kind
        for share in ("share_of_gemm_peak", "share_of_bandwidth", "share_of_roofline", "share_of_roofline_by_part",
                      "linear_share_of_gemm_peak"):
            assert 0 < f[share] < 1.5, (kind, share, f[share])
        assert f["share_of_roofline_by_part"] >= f["share_of_roofline"]  # max(a, b) + max(c, d) >= max(a + c, b + d)
    steps, geometry = figures["steps"], figures["geometry"]
    # every prompt token and every output token but each request's last is computed once (no prefix shared)
    computed = figures["prompt_tokens"] + figures["output_tokens"] - figures["requests"]
    assert sum(n for s in steps for _, n in s["seqs"]) == computed
    assert sum(s["sampled"] for s in steps) == figures["output_tokens"]
    for s in steps:
        tokens = sum(n for _, n in s["seqs"])
        assert s["linear_flops"] == 2 * (geometry["layer_weights"] * tokens + geometry["head_weights"] * s["sampled"])
        assert s["seconds"] >= s["forward_s"] >= s["linear_s"] + s["attention_s"] > 0 and s["plain_s"] > 0
    assert figures["seconds"]["plain"] > 0 and figures["seconds"]["timed"] > 0
    assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
