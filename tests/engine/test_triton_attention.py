"""The Triton backend (triton_attention.py) against the CPU paths and HF generate.

On CPU the kernels run under Triton's interpreter: tests/conftest.py sets TRITON_INTERPRET=1
before torch (which imports triton) is imported. STREAMBATCH_TEST_DEVICE=cuda runs the same
checks compiled, on a GPU.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from producer.protocol import SamplingParams
from tests.engine.test_attention import DEVICE, Pager, check_rows, paged_model, tokens
from tests.engine.test_engine import hf_greedy, make_engine, model_and_reference, prompts_of, run
from tests.engine.triton_variants import Launches, variant
from worker.engine import kernels, triton_attention
from worker.engine.attention import AttentionMetadata, attend, default_backend, kv_cache_shapes

pytestmark = pytest.mark.usefixtures("one_thread")
ROOT = Path(__file__).resolve().parents[2]

# (num_computed, num_new) per sequence of one packed step: a fresh prompt of several query tiles,
# decodes over 1 to 2 KV tiles (TILE_N = 32), chunks over a cached prefix, a 1-token prompt;
# sequences start on and off the query tiles of the row (BLOCK_Q 16 or 5).
STEP = [(0, 20), (37, 1), (20, 9), (50, 1), (3, 1), (0, 1), (41, 6)]
TOLERANCE = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def test_the_kernels_run_interpreted_on_cpu():
    if DEVICE != "cpu":
        pytest.skip("compiled on a GPU")
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    # triton's own jit functions (tl.sum, tl.max) too: they are defined when triton is first imported.
    assert triton_attention.INTERPRETED and isinstance(tl.sum, InterpretedFunction), \
        "TRITON_INTERPRET=1 must be set before torch or triton is imported (tests/conftest.py)"
    assert isinstance(triton_attention._attention_kernel, InterpretedFunction)


def packed_step(block_size: int, num_kv_heads: int, group: int, head_dim: int, dtype: torch.dtype, seed: int = 0,
                step=STEP):
    """Random caches (the cached prefixes' K/V, in the triton backend's layout: K as V), queries and
    new K/V of the step, on shuffled blocks."""
    generator = torch.Generator().manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=generator).to(dtype).to(DEVICE)  # noqa: E731
    free = list(range(64))
    random.Random(seed).shuffle(free)
    tables = [[free.pop() for _ in range(-(-(c + n) // block_size))] for c, n in step]
    k_shape, v_shape = kv_cache_shapes(64, block_size, num_kv_heads, head_dim, "triton")
    assert k_shape == v_shape
    num_tokens = sum(n for _, n in step)
    caches = randn(*k_shape), randn(*v_shape)
    inputs = (randn(1, num_kv_heads * group, num_tokens, head_dim), randn(1, num_kv_heads, num_tokens, head_dim),
              randn(1, num_kv_heads, num_tokens, head_dim))
    return tables, caches, inputs


def attend_with(backend: str, block_size: int, tables, caches, inputs, window: int | None, step=STEP):
    """-> (output [1, T, heads, dim], the caches after the step's writes, K in the triton layout again).
    The native kernel gets K as it stores it: [head_dim, block_size] per block and head."""
    meta = AttentionMetadata.build([c for c, _ in step], [n for _, n in step], tables, block_size, DEVICE,
                                   backend=backend)
    native = backend == "native"
    k_cache, v_cache = caches[0].transpose(2, 3).contiguous() if native else caches[0].clone(), caches[1].clone()
    query, key, value = inputs
    out = attend(meta, k_cache, v_cache, query, key, value, query.shape[-1] ** -0.5, window)
    return out, (k_cache.transpose(2, 3) if native else k_cache, v_cache)


@pytest.mark.parametrize("block_size, group, head_dim, dtype, window", [
    (16, 1, 64, torch.float32, None),
    (8, 3, 64, torch.float32, 7),
    (32, 3, 40, torch.float16, None),  # head_dim 40: padded to 64
    (8, 1, 40, torch.float16, 7),
    (16, 3, 64, torch.bfloat16, 7),
    (32, 1, 64, torch.bfloat16, None),
    (16, 4, 128, torch.bfloat16, None),  # Llama-3-8B's heads: 32 over 8, head_dim 128
    (16, 7, 128, torch.float16, 7),  # Qwen2-7B's: 28 over 4, a group that fills 14 of a tile's 16 rows
], ids=lambda value: str(value).removeprefix("torch."))
def test_mixed_step_matches_the_cpu_paths(block_size, group, head_dim, dtype, window):
    step = packed_step(block_size, 2, group, head_dim, dtype)
    out, caches = attend_with("triton", block_size, *step, window)
    references = ["torch"] + (["native"] if DEVICE == "cpu" and kernels.native() is not None else [])
    for backend in references:
        expected, expected_caches = attend_with(backend, block_size, *step, window)
        assert all(torch.equal(a, b) for a, b in zip(caches, expected_caches)), backend
        torch.testing.assert_close(out, expected, atol=TOLERANCE[dtype], rtol=0, msg=backend)


def test_window_and_causal_masks_matter():
    """The case above would pass with a kernel that ignored the window or saw future keys, were
    the outputs the same with and without them: they are not."""
    step = packed_step(8, 2, 1, 64, torch.float32)
    windowed, _ = attend_with("triton", 8, *step, 7)
    full, _ = attend_with("triton", 8, *step, None)
    assert (windowed - full).abs().max() > 0.1
    query, key, value = step[2]
    value = value.clone()
    value[:, :, 19] += 10  # the last token of the 20-token prompt: only its own row sees it
    changed, _ = attend_with("triton", 8, step[0], step[1], (query, key, value), None)
    differs = (changed - full).abs().amax(dim=(0, 2, 3)) > 0
    assert differs.nonzero().flatten().tolist() == [19]


def test_padding_of_a_captured_graph_changes_nothing():
    """A CUDA graph replays a step padded to its captured size: tokens with slot -1 write nothing,
    and empty sequences (query_start_loc repeating its end) add no rows."""
    k_shape, v_shape = kv_cache_shapes(2, 4, 2, 8, "triton")
    k_cache, v_cache = torch.zeros(k_shape, device=DEVICE), torch.zeros(v_shape, device=DEVICE)
    key = torch.ones(2, 2, 8, device=DEVICE)
    triton_attention.write_kv(k_cache, v_cache, torch.tensor([5, -1], device=DEVICE), key, key)
    assert k_cache.sum() == v_cache.sum() == 16  # one token: 2 heads x 8
    assert (k_cache[1, :, 1] == 1).all() and (v_cache[1, :, 1] == 1).all()

    tables, caches, (query, _, _) = packed_step(8, 2, 3, 64, torch.float32)
    meta = AttentionMetadata.build([c for c, _ in STEP], [n for _, n in STEP], tables, 8, DEVICE, backend="triton")
    end, two = meta.query_start_loc[-1:], torch.zeros(2, dtype=torch.long, device=DEVICE)
    plain, padded = (
        triton_attention.paged_attention(query[0].transpose(0, 1), *caches, starts, lens, table, 0.125, None)
        for starts, lens, table in (
            (meta.query_start_loc, meta.seq_lens, meta.block_tables),
            (torch.cat([meta.query_start_loc, end, end]), torch.cat([meta.seq_lens, two]),
             torch.cat([meta.block_tables, meta.block_tables[:2]])),
        ))
    assert torch.equal(plain, padded)


def test_backend_choice():
    assert default_backend("cuda") == "triton"  # triton is installed
    assert default_backend("cpu") == ("native" if kernels.native() is not None else "torch")
    meta = AttentionMetadata.build([4, 0], [1, 3], [[2, 1], [0]], 4, backend="triton")
    assert meta.backend == "triton" and not meta.decode_groups and not meta.prefills  # one launch needs neither
    assert not meta.is_all_decode
    with pytest.raises(ValueError, match="backend"):
        AttentionMetadata.build([0], [1], [[0]], 4, backend="cudnn")


def test_mixed_batch_logits_match_each_sequence_alone():
    """random:mistral: GQA (4 heads over 2) and a 16-token sliding window, through the whole model."""
    name = "random:mistral"
    full = {"long": tokens(40, 1), "short": tokens(5, 2), "decode": tokens(38, 3), "chunked": tokens(43, 4),
            "single": tokens(1, 5)}
    pager = Pager(paged_model(name), 8, seed=3, backend="triton")
    work = [("decode", full["decode"][:37]), ("chunked", full["chunked"][:20])]
    meta, logits = pager.step(work, all_rows=True)
    check_rows(name, pager, work, meta, logits, full)
    work = [("long", full["long"]), ("decode", full["decode"][37:]), ("short", full["short"]),
            ("single", full["single"]), ("chunked", full["chunked"][20:])]
    meta, logits = pager.step(work, all_rows=True)
    check_rows(name, pager, work, meta, logits, full)


@pytest.mark.parametrize("spec, low", [("random:llama", 3), ("random:mistral", 20)])  # mistral: past its window
def test_engine_greedy_tokens_match_hf_generate(spec, low, monkeypatch):
    model, reference = model_and_reference(spec, DEVICE)
    prompts = prompts_of(4, seed=5, low=low, high=40)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    # A small budget: prompts go in chunks, mixed with the decodes of the others.
    engine = make_engine((spec, model, reference), num_blocks=64, block_size=8, token_budget=24,
                         attention_backend="triton", device=DEVICE)
    query_lens = []  # per launch, the new tokens of each sequence
    kernel = triton_attention.paged_attention
    monkeypatch.setattr(triton_attention, "paged_attention",
                        lambda *args: query_lens.append(args[3].diff().tolist()) or kernel(*args))
    assert run(engine, prompts, params) == [hf_greedy(reference, prompt, 8) for prompt in prompts]
    assert any(1 in lens and max(lens) > 1 for lens in query_lens)  # a step mixed decodes and chunks


# Decodes only, over 1 to 5 KV tiles (TILE_N = 32), one context a single token.
DECODES = [(37, 1), (150, 1), (3, 1), (95, 1), (0, 1)]


@pytest.mark.parametrize("segments", [2, 4, 16])
@pytest.mark.parametrize("group, dtype, window", [(3, torch.float32, None), (4, torch.bfloat16, 40)],
                         ids=lambda value: str(value).removeprefix("torch."))
def test_split_kv_decodes_match_the_cpu_paths(segments, group, dtype, window, monkeypatch):
    """Contexts split into ranges (more of them than some contexts have tiles: empty ranges) and
    reduced give what one walk over each context gives, and the CPU paths' result."""
    step = packed_step(16, 2, group, 128, dtype, step=DECODES)
    expected, expected_caches = attend_with("torch", 16, *step, window, step=DECODES)
    for count in (1, segments):
        monkeypatch.setattr(triton_attention, "num_segments", lambda *args, count=count: count)
        out, caches = attend_with("triton", 16, *step, window, step=DECODES)
        assert all(torch.equal(a, b) for a, b in zip(caches, expected_caches))
        torch.testing.assert_close(out, expected, atol=TOLERANCE[dtype], rtol=0, msg=f"{count} segments")


def test_few_decodes_split_their_contexts_to_fill_the_multiprocessors(monkeypatch):
    monkeypatch.setattr(triton_attention, "multiprocessors", lambda device: 132)  # an H200's
    # Llama-3-8B's 8 KV heads: programs = sequences x 8
    assert [triton_attention.num_segments(n, 8, True, "cuda") for n in (1, 2, 4, 8, 16, 17, 256)] == \
        [16, 16, 8, 4, 2, 1, 1]
    assert triton_attention.num_segments(1, 8, False, "cuda") == 1  # a step with a prefill chunk: never


def test_serving_launches_no_kernel_variant_that_warm_up_did_not(monkeypatch):
    """Triton compiles a kernel per specialization of its arguments (an int's value 1 or divisible
    by 16, a pointer's alignment, the constexprs): every launch of a run, mixed steps and decodes
    of every count, through the CUDA-graph buffers and not, must find its variant among those the
    runner's warm-up launched."""
    launches = Launches().install(monkeypatch)
    spec = "random:mistral"  # a sliding window, GQA
    model, reference = model_and_reference(spec, DEVICE)
    engine = make_engine((spec, model, reference), num_blocks=64, block_size=8, token_budget=24,
                         attention_backend="triton", cuda_graph_max_seqs=2, device=DEVICE)
    warmed = {variant(launch) for launch in launches.seen}
    launches.seen.clear()
    prompts = prompts_of(4, seed=9, low=1, high=30)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt_ids=prompt,
                           params=SamplingParams(max_tokens=2 + i, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished:
        engine.step()
    served = {variant(launch) for launch in launches.seen}
    assert {name for name, _ in served} == {"_attention_kernel", "_reduce_segments_kernel", "_write_kv_kernel"}
    assert served <= warmed, served - warmed


def test_the_kernels_compile_for_sm90_with_keys_in_16_byte_async_copies():
    """The review's finding, kept: K stored [dim, position] loaded two bytes at a time outside the
    async-copy pipeline at 168 registers a thread; head_dim-contiguous, in 16-byte cp.async at 96.
    Every variant warm_up launches for Llama-3-8B's decode in bf16 on an H200, compiled for sm_90 by
    the ptxas triton bundles (tests/engine/triton_variants.py, in a process without the interpreter)."""
    environment = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", "tests.engine.triton_variants"], capture_output=True, text=True,
                          env=environment | {"TRITON_DEFAULT_FP_FUSION": "1"}, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    variants = [json.loads(line) for line in done.stdout.splitlines()]
    assert {(v["kernel"], v["segments"]) for v in variants} >= {
        ("_write_kv_kernel", None), ("_attention_kernel", 1), ("_attention_kernel", 16),
        ("_reduce_segments_kernel", 16)}
    for found in variants:
        assert found["two_byte_loads"] == 0, found
        if found["kernel"] == "_attention_kernel":
            assert found["cp_async"] > 0 and found["registers"] <= 128, found
