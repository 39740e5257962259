"""The GPU benchmark's dry run (tiny model, CPU) end to end, its greedy check failing when our
engine's tokens are not HF's, its targets, and its refusal of a torch without CUDA."""

import json
import math

import pytest
import torch

from ops.bench_gpu import SECTIONS, greedy_check, main, targets
from ops.gpu_profile import profile_steps
from worker.engine.config import EngineConfig
from worker.engine.engine import Engine

pytestmark = pytest.mark.usefixtures("one_thread")


def positive(*values) -> bool:
    return all(isinstance(v, (int, float)) and math.isfinite(v) and v > 0 for v in values)


def test_a_profile_is_per_step_and_by_kind():
    """Known ops, counted per step whatever the number of steps profiled: a check that holds on a busy
    machine, where the ops' times against the step's own do not."""
    a = torch.randn(64, 64)

    def step():
        torch.mm(a, a)
        torch.mm(a, a)
        a.exp()

    for steps in (1, 3):
        profile = profile_steps(step, steps, 1.0, torch.device("cpu"))
        rows = {row["kernel"]: row for row in profile["top"]}
        assert rows["aten::mm"]["launches"] == 2 and rows["aten::mm"]["kind"] == "matmul"
        assert rows["aten::exp"]["launches"] == 1
        assert profile["kernels_s"] == pytest.approx(sum(kind["seconds"] for kind in profile["kinds"].values()))
        assert 0 < profile["kinds"]["matmul"]["seconds"] <= profile["kernels_s"]


def test_dry_run_reports_every_section(tmp_path, monkeypatch):
    import transformers

    def no_tokenizer(*args, **kwargs):
        raise AssertionError("a random model's run loads no tokenizer (the bundled model's needs three packages)")
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", no_tokenizer)
    out = tmp_path / "bench.json"
    assert main(["--dry-run", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert set(SECTIONS) | {"config", "targets"} == set(results)
    assert results["config"]["device"] == "cpu" and results["config"]["dtype"] == "float32"
    assert positive(results["device"]["bandwidth_bytes_per_s"], results["device"]["matmul_flop_per_s"])
    decode = results["decode"]
    assert sorted((row["sequences"], row["context"]) for row in decode) == [(1, 32), (1, 64), (4, 32), (4, 64)]
    for row in decode:
        assert positive(row["step_s"], row["tokens_per_s"], row["bound_tokens_per_s"], row["share_of_bound"],
                        row["host_s"], row["host_share"])
        assert row["bound_by"] in ("memory", "compute")
    prefill = results["prefill"]
    assert prefill["prompt_tokens"] == 64
    assert positive(prefill["tokens_per_s"], prefill["bound_tokens_per_s"], prefill["share_of_bound"])
    profiles = results["profile"]  # on the CPU: each op's own time
    assert list(profiles) == ["decode 4 x 64", "prefill 64"]
    for profile in profiles.values():
        assert positive(profile["step_s"], profile["kernels_s"], profile["launches_per_step"])
        assert profile["kinds"]["matmul"]["seconds"] > 0  # the CPU's attention kernels are no ops: not in it
        assert profile["top"] and all(row["seconds"] > 0 for row in profile["top"])
        assert profile["kernels_s"] == pytest.approx(sum(kind["seconds"] for kind in profile["kinds"].values()))
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
    assert set(results) == {"config", "decode", "prefill", "profile"}
    assert all("bound_tokens_per_s" not in row for row in results["decode"])
    assert main(["--dry-run", "--skip", "decoding"]) == 1  # one red line, no traceback


def test_greedy_check_fails_when_our_tokens_are_not_hf_s():
    engine = Engine(EngineConfig.from_options("random:llama", num_blocks=64))
    assert greedy_check(engine, "random:llama")["passed"]
    forward = engine.runner.forward
    engine.runner.forward = lambda input_ids, meta: forward(input_ids, meta).flip(-1)  # a mirrored vocabulary
    check = greedy_check(engine, "random:llama")
    assert not check["passed"] and check["exact"] == 0 and check["largest_margin"] > 0


def test_targets_judge_decode_from_64_sequences_prefill_and_the_host_at_256():
    decode = [{"sequences": n, "context": 2048, "share_of_bound": share, "bound_by": "memory", "host_share": host}
              for n, share, host in ((16, 0.5, 0.05), (64, 0.85, 0.01), (256, 0.79, 0.03))]
    verdicts = targets({"decode": decode, "prefill": {"share_of_bound": 0.61}})
    assert [(v["value"], v["met"]) for v in verdicts] == [(0.85, True), (0.79, False), (0.03, False), (0.61, True)]
    assert targets({}) == []  # no device figures (--skip device): nothing to judge


def test_a_torch_built_without_cuda_is_refused_clearly(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.version, "cuda", None)
    assert main(["--device", "cuda"]) == 1
    assert "built without CUDA" in capsys.readouterr().out


def test_gpu_check_merges_the_tests_outcome_and_prints_each_figure(tmp_path, capsys):
    from ops import gpu_check

    (tmp_path / "cuda-tests.xml").write_text(
        '<testsuites><testsuite><testcase classname="t" name="ok"/><testcase classname="t" name="bad"><failure/>'
        '</testcase><testcase classname="t" name="gpu"><skipped/></testcase></testsuite></testsuites>')
    row = {"sequences": 64, "context": 2048, "tokens_per_s": 5000.0, "share_of_bound": 0.85, "bound_by": "memory",
           "host_s": 1.2e-4, "host_share": 0.01, "syncs_per_step": 1.0}
    (tmp_path / "gpu.json").write_text(json.dumps({
        "decode": [row], "prefill": {"prompt_tokens": 2048, "share_of_bound": 0.61},
        "targets": [{"target": "host work", "value": 0.03, "met": False}]}))
    assert gpu_check.main([str(tmp_path)]) == 0
    assert json.loads((tmp_path / "gpu.json").read_text())["cuda_tests"] == {
        "passed": 1, "failed": ["t::bad"], "skipped": 1}
    out = capsys.readouterr().out
    for line in ("1 passed, 1 failed, 1 skipped", "failed: t::bad",
                 "decode  64 x  2048:     5,000 tokens/s, 85% of its memory bound, host 0.120 ms a step (1.0%), "
                 "1 syncs a step", "prefill 2,048 tokens: 61% of the matmul bound", "target NOT met: host work (3.0%)"):
        assert line in out, line


def test_gpu_check_refuses_a_torch_without_a_gpu(tmp_path):
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    done = subprocess.run([str(root / "ops" / "gpu_check.sh"), str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 1 and "a GPU check needs both" in done.stdout + done.stderr
