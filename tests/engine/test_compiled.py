"""The compiled forward (EngineConfig.compile): the tokens of HF generate, one graph for steps of
every shape, and a graph of its own for each model."""

import os
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor.runtime.cache_dir_utils import default_cache_dir

from tests.engine.test_engine import GREEDY, hf_greedy, prompts_of, run
from worker.engine import kernels
from worker.engine.attention import AttentionMetadata, run_model
from worker.engine.compiled import compile_cache_dir
from worker.engine.config import EngineConfig
from worker.engine.engine import Engine
from worker.engine.linear import packing_backend
from worker.engine.models import ModelInfo, load_model, random_model
from worker.engine.runner import ModelRunner

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def llama():
    model, _ = load_model("random:llama")
    reference = random_model("random:llama")
    reference.set_attn_implementation("sdpa")
    return model, reference


@pytest.mark.long
def test_compiled_engine_matches_hf_with_one_graph_for_every_step_shape(llama):
    model, reference = llama
    prompts = prompts_of(12, seed=5, high=60)
    want = [hf_greedy(reference, prompt, GREEDY.max_tokens) for prompt in prompts]
    graphs = counters["stats"]["unique_graphs"]
    # 13-token budget: chunks with no logits row; a small pool: preemption and recompute.
    engine = Engine(EngineConfig.from_options("random:llama", compile=True, token_budget=13, num_blocks=14,
                                              block_size=8, watermark=0.0), model=model)
    assert counters["stats"]["unique_graphs"] == graphs + 1  # compiled at start-up, not in a step
    with torch._dynamo.config.patch(error_on_recompile=True):
        assert run(engine, prompts[:1]) == want[:1]  # alone: steps of one token and one row
        assert run(engine, prompts) == want  # mixed chunks and decodes
    assert engine.scheduler.num_preemptions > 0


def test_each_compiled_model_has_its_own_graph(llama):
    """Same class and shapes, another constant (the norm's epsilon): must not reuse the first graph."""
    models = [llama[0], load_model("random:llama:rms_norm_eps=0.5")[0]]
    runners = [ModelRunner(model, ModelInfo.from_model(model), 8, 16, compile=True) for model in models]
    logits = []
    with torch.inference_mode():  # inputs made outside it would have the graph traced anew, as a runner's never are
        ids = torch.tensor([3, 1, 4, 1, 5])
        for runner in runners + runners:
            meta = AttentionMetadata.build([0], [len(ids)], [[0]], 16, kv_caches=runner.kv_caches)
            compiled = runner.forward(ids, meta)
            torch.testing.assert_close(compiled, run_model(runner.model, ids, meta), atol=1e-5, rtol=0)
            logits.append(compiled)
    assert not torch.allclose(logits[0], logits[1], atol=1e-3)


def test_compiled_forward_without_native_kernels(monkeypatch):
    """Where the C++ kernels cannot be built: oneDNN layers, torch attention; compiled = eager."""
    monkeypatch.setattr(kernels, "native", lambda: None)
    assert packing_backend(torch.float32) == "onednn"
    model, _ = load_model("random:llama")
    runner = ModelRunner(model, ModelInfo.from_model(model), 8, 16, compile=True)
    with torch.inference_mode():
        ids = torch.tensor([2, 7, 1, 8])
        meta = AttentionMetadata.build([0], [len(ids)], [[0]], 16, kv_caches=runner.kv_caches)
        assert meta.backend == "torch"
        torch.testing.assert_close(runner.forward(ids, meta), run_model(model, ids, meta), atol=1e-5, rtol=0)


def test_the_compile_cache_lasts_in_our_cache_directory_unless_told_otherwise(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())  # as torch leaves it on first use
    monkeypatch.setenv("STREAMBATCH_CACHE", str(tmp_path / "cache"))
    assert compile_cache_dir() == tmp_path / "cache" / "inductor"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cache" / "inductor")  # what torch reads
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    assert compile_cache_dir() == tmp_path / "cache" / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "chosen"))
    assert compile_cache_dir() == tmp_path / "chosen"
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    (tmp_path / "read-only").write_text("")  # a file where the directory would go: cannot be made
    monkeypatch.setenv("STREAMBATCH_CACHE", str(tmp_path / "read-only"))
    assert compile_cache_dir() == Path(default_cache_dir())
