"""The GPU benchmark's dry run (tiny model, CPU) end to end, and its greedy check failing when our
engine's tokens are not HF's."""

import json
import math

import pytest

from ops.bench_gpu import SECTIONS, greedy_check, main
from worker.engine.config import EngineConfig
from worker.engine.engine import Engine

pytestmark = pytest.mark.usefixtures("one_thread")


def positive(*values) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in values)


def test_dry_run_reports_every_section(tmp_path):
    out = tmp_path / "bench.json"
    assert main(["--dry-run", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert set(SECTIONS) | {"config"} == set(results)
    assert results["config"]["device"] == "cpu" and results["config"]["dtype"] == "float32"
    assert positive(results["device"]["bandwidth_bytes_per_s"], results["device"]["matmul_flop_per_s"])
    decode = results["decode"]
    assert sorted((row["sequences"], row["context"]) for row in decode) == [(1, 32), (1, 64), (4, 32), (4, 64)]
    for row in decode:
        assert positive(row["step_s"], row["tokens_per_s"], row["bound_tokens_per_s"], row["share_of_bound"])
        assert row["bound_by"] in ("memory", "compute")
    prefill = results["prefill"]
    assert prefill["prompt_tokens"] == 64
    assert positive(prefill["tokens_per_s"], prefill["bound_tokens_per_s"], prefill["share_of_bound"])
    offline = results["offline"]
    assert offline["requests"] == 8
    assert offline["output_tokens"] == 4 * 16 + 2 * 64 + 2 * 256  # bench_offline's mix, EOS ignored
    assert positive(offline["output_tokens_per_s"], *offline["ttft_s"].values(), *offline["itl_s"].values())
    assert offline["ttft_s"]["p50"] <= offline["ttft_s"]["p99"]
    greedy = results["greedy"]
    assert greedy["passed"] and [(c["exact"], c["prompts"]) for c in greedy["checks"]] == [(4, 4)]


def test_skip_leaves_sections_out_and_bounds_need_the_device_figures(tmp_path):
    out = tmp_path / "bench.json"
    assert main(["--dry-run", "--skip", "device,offline,greedy", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert set(results) == {"config", "decode", "prefill"}
    assert all("bound_tokens_per_s" not in row for row in results["decode"])
    assert main(["--dry-run", "--skip", "decoding"]) == 1  # one red line, no traceback


def test_greedy_check_fails_when_our_tokens_are_not_hf_s():
    engine = Engine(EngineConfig.from_options("random:llama", num_blocks=64))
    assert greedy_check(engine, "random:llama")["passed"]
    forward = engine.runner.forward
    engine.runner.forward = lambda input_ids, meta: forward(input_ids, meta).flip(-1)  # a mirrored vocabulary
    check = greedy_check(engine, "random:llama")
    assert not check["passed"] and check["exact"] == 0 and check["largest_margin"] > 0
