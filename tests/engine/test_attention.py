"""Paged attention: packed mixed batches must give the logits each sequence gets alone."""

from __future__ import annotations

import functools
import math
import os
import random

import pytest
import torch

from worker.engine import attention, kernels
from worker.engine.attention import AttentionMetadata, compute_logits, paged_attention, run_model
from worker.engine.models import ModelInfo, allocate_kv_cache, load_model


# STREAMBATCH_TEST_DEVICE=cuda runs the same checks on a GPU.
DEVICE = os.environ.get("STREAMBATCH_TEST_DEVICE", "cpu")


pytestmark = pytest.mark.usefixtures("one_thread")


@functools.cache
def paged_model(name: str, dtype: str = "float32"):
    return load_model(name, dtype=dtype, device=DEVICE)[0]


@functools.cache
def reference_model(name: str, dtype: str = "float32"):
    """The same weights with stock HF attention (no paging, no packing)."""
    model = load_model(name, dtype=dtype, device=DEVICE)[0]
    model.set_attn_implementation("sdpa")
    return model


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(2, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class Pager:
    """A minimal stand-in for the block pool: shuffled physical blocks, tables grown on demand."""

    def __init__(self, model, block_size: int, num_blocks: int = 128, seed: int = 0, backend: str | None = None):
        self.model, self.block_size, self.backend = model, block_size, backend
        self.kv_caches = allocate_kv_cache(ModelInfo.from_model(model), num_blocks, block_size, device=DEVICE,
                                           backend=backend)
        self.free = list(range(num_blocks))
        random.Random(seed).shuffle(self.free)
        self.tables: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}

    def metadata(self, work: list[tuple[str, list[int]]]) -> AttentionMetadata:
        for key, new in work:
            table = self.tables.setdefault(key, [])
            while len(table) * self.block_size < self.computed.get(key, 0) + len(new):
                table.append(self.free.pop())
        return AttentionMetadata.build(
            [self.computed.get(key, 0) for key, _ in work], [len(new) for _, new in work],
            [self.tables[key] for key, _ in work], self.block_size, DEVICE, kv_caches=self.kv_caches,
            backend=self.backend,
        )

    def step(self, work: list[tuple[str, list[int]]], all_rows: bool = False):
        """One packed forward. all_rows: logits of every new token [T, V], else run_model's [S, V]."""
        meta = self.metadata(work)
        input_ids = torch.tensor([t for _, new in work for t in new], device=DEVICE)
        with torch.inference_mode():
            if all_rows:
                logits = self.model(input_ids=input_ids[None], position_ids=meta.positions[None],
                                    attn_metadata=meta, use_cache=False).logits[0]
            else:
                logits = run_model(self.model, input_ids, meta)
        for key, new in work:
            self.computed[key] = self.computed.get(key, 0) + len(new)
        return meta, logits


def reference_logits(name: str, ids: list[int], dtype: str = "float32") -> torch.Tensor:
    with torch.inference_mode():
        return reference_model(name, dtype)(input_ids=torch.tensor([ids], device=DEVICE)).logits[0]


def check_rows(name, pager, work, meta, logits, full, dtype="float32", atol=1e-4):
    """Rows of each sequence's new tokens == the reference run of that sequence alone."""
    for i, (key, new) in enumerate(work):
        start, end = meta.query_start_loc_list[i], meta.query_start_loc_list[i + 1]
        computed = meta.seq_lens_list[i] - len(new)
        expected = reference_logits(name, full[key][: meta.seq_lens_list[i]], dtype)[computed:]
        torch.testing.assert_close(logits[start:end], expected, atol=atol, rtol=0, msg=f"{name} sequence {key}")


MODELS = ["random:llama", "random:qwen2", "random:mistral"]


@pytest.mark.parametrize("backend", ["native", "torch"])
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("name", MODELS)
def test_mixed_batch_matches_each_sequence_alone(name, block_size, backend):
    if backend == "native" and kernels.native() is None:
        pytest.fail("the native decode kernel did not build")
    full = {"long": tokens(100, 1), "short": tokens(5, 2), "decode": tokens(38, 3), "chunked": tokens(43, 4),
            "single": tokens(1, 5)}
    pager = Pager(paged_model(name), block_size, seed=block_size, backend=backend)
    # Step 1 fills the cache: a context that will decode, and the first chunk of a chunked prefill.
    work = [("decode", full["decode"][:37]), ("chunked", full["chunked"][:20])]
    meta, logits = pager.step(work, all_rows=True)
    check_rows(name, pager, work, meta, logits, full)
    # Step 2 mixes fresh prompts (100 and 5 tokens, and a 1-token one), a decode over 37 cached
    # tokens and a second chunk over a cached prefix, interleaved so decodes are not contiguous.
    work = [("long", full["long"]), ("decode", full["decode"][37:]), ("short", full["short"]),
            ("single", full["single"]), ("chunked", full["chunked"][20:])]
    meta = pager.metadata(work)
    decode_rows = [[100, 106]] if backend == "native" else [[106, 100]]  # native: row order; torch: by length
    assert len(meta.prefills) == 3 and [g.rows.tolist() for g in meta.decode_groups] == decode_rows
    meta, logits = pager.step(work, all_rows=True)
    check_rows(name, pager, work, meta, logits, full)
    # run_model keeps only each sequence's last row (rerunning rewrites the same K/V to the same slots).
    with torch.inference_mode():
        last = run_model(pager.model, torch.tensor([t for _, new in work for t in new], device=DEVICE), meta)
    torch.testing.assert_close(last, logits[meta.logits_rows], atol=1e-5, rtol=0)


def test_sliding_window_reference_really_differs():
    """random:mistral (window 16) checks the window only if a 100-token context makes it matter."""
    ids = tokens(100, 1)
    windowed = reference_logits("random:mistral", ids)
    unwindowed = load_model("random:mistral:sliding_window=null", device=DEVICE)[0]
    unwindowed.set_attn_implementation("sdpa")
    with torch.inference_mode():
        plain = unwindowed(input_ids=torch.tensor([ids], device=DEVICE)).logits[0]
    assert (windowed[-1] - plain[-1]).abs().max() > 1e-2


def greedy_paged(name: str, prompts: list[list[int]], max_new: int, block_size: int, token_budget: int):
    """A toy continuous-batching loop: decodes first, then prefill chunks fill the token budget."""
    pager = Pager(paged_model(name), block_size, seed=7)
    eos = ModelInfo.from_model(paged_model(name)).eos_token_ids
    outputs = {i: [] for i in range(len(prompts))}
    cursor = {i: 0 for i in range(len(prompts))}  # prefill progress
    pending = {}  # sequence -> token to feed next
    while any(len(o) < max_new and not (o and o[-1] in eos) for o in outputs.values()):
        work = [(str(i), [pending.pop(i)]) for i in list(pending)]
        budget = token_budget - len(work)
        for i, prompt in enumerate(prompts):
            if cursor[i] < len(prompt) and budget > 0:
                take = min(budget, len(prompt) - cursor[i])
                work.append((str(i), prompt[cursor[i] : cursor[i] + take]))
                cursor[i] += take
                budget -= take
        _, logits = pager.step(work)
        for row, (key, _) in enumerate(work):
            i = int(key)
            if cursor[i] < len(prompts[i]):
                continue  # mid-prompt chunk: its logits are not sampled
            token = int(logits[row].argmax())
            outputs[i].append(token)
            if len(outputs[i]) < max_new and token not in eos:
                pending[i] = token
    return [outputs[i] for i in range(len(prompts))]


@pytest.mark.parametrize("name", ["random:llama", "random:qwen2"])
def test_greedy_decoding_matches_hf_generate(name):
    prompts = [tokens(7, 11), tokens(19, 12), tokens(45, 13)]
    got = greedy_paged(name, prompts, max_new=12, block_size=8, token_budget=24)
    for prompt, output in zip(prompts, got):
        with torch.inference_mode():
            ids = torch.tensor([prompt], device=DEVICE)
            expected = reference_model(name).generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False, pad_token_id=0
            )[0, len(prompt) :].tolist()
        assert output == expected


def test_bfloat16_mixed_batch_close_to_reference():
    name = "random:llama"
    full = {"long": tokens(100, 1), "short": tokens(5, 2), "decode": tokens(30, 3)}
    pager = Pager(paged_model(name, "bfloat16"), 16)
    assert pager.kv_caches[0][0].dtype == torch.bfloat16
    pager.step([("decode", full["decode"][:29])])
    work = [("long", full["long"]), ("decode", full["decode"][29:]), ("short", full["short"])]
    meta, logits = pager.step(work)
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
    same_argmax = 0
    for row, (key, _) in enumerate(work):
        expected = reference_logits(name, full[key], "bfloat16")[-1]
        assert (logits[row].float() - expected.float()).abs().max() < 0.1  # logits spread about +-3
        same_argmax += int(logits[row].argmax() == expected.argmax())
    assert same_argmax >= 2


def test_decodes_share_one_attention_call(monkeypatch):
    """Per layer: one SDPA for all decodes plus one per prefill chunk, never one per decode."""
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **k: calls.append(a[0].shape) or sdpa(*a, **k))
    model = paged_model("random:llama")
    pager = Pager(model, 8, backend="torch")
    pager.step([(str(i), tokens(3 + i, i)) for i in range(10)])
    calls.clear()
    work = [(str(i), [5]) for i in range(10)] + [("new", tokens(9, 99))]
    meta, _ = pager.step(work)
    assert not meta.is_all_decode
    assert len(calls) == 2 * model.config.num_hidden_layers
    assert calls[0][0] == 10  # the decode call carries all ten sequences


def test_decode_groups_give_the_same_logits():
    model = paged_model("random:llama")
    pager = Pager(model, 8, backend="torch")
    contexts = {str(i): tokens(3 + 7 * i, i) for i in range(8)}
    pager.step(list(contexts.items()))
    work = [(key, [9]) for key in contexts]
    metas = [pager.metadata(work), pager.metadata(work)]
    metas[1] = AttentionMetadata.build([pager.computed[k] for k, _ in work], [1] * 8,
                                       [pager.tables[k] for k, _ in work], 8, DEVICE, kv_caches=pager.kv_caches,
                                       decode_group_tokens=24, backend="torch")
    assert len(metas[0].decode_groups) == 1 and len(metas[1].decode_groups) > 3
    with torch.inference_mode():
        one, split = (run_model(model, torch.tensor([9] * 8, device=DEVICE), m) for m in metas)
    torch.testing.assert_close(one, split, atol=1e-5, rtol=0)
    for row, (key, _) in enumerate(work):
        expected = reference_logits("random:llama", contexts[key] + [9])[-1]
        torch.testing.assert_close(split[row], expected, atol=1e-4, rtol=0)


def test_compute_logits_matches_logits_to_keep(monkeypatch):
    model = paged_model("random:qwen2")
    pager = Pager(model, 16)
    work = [("a", tokens(12, 1)), ("b", tokens(3, 2))]
    meta, logits = pager.step(work)
    with torch.inference_mode():
        ids = torch.tensor([t for _, new in work for t in new], device=DEVICE)[None]
        hidden = model.model(input_ids=ids, position_ids=meta.positions[None], attn_metadata=meta,
                             use_cache=False).last_hidden_state
        torch.testing.assert_close(compute_logits(model, hidden, meta.logits_rows), logits, atol=1e-5, rtol=0)
        # A model without logits_to_keep takes the base-model + lm_head path of run_model.
        monkeypatch.setitem(attention._LOGITS_TO_KEEP, type(model), False)
        torch.testing.assert_close(run_model(model, ids[0], meta), logits, atol=1e-5, rtol=0)


def test_build_metadata_by_hand():
    meta = AttentionMetadata.build(
        num_computed=[0, 6, 2], num_new=[3, 1, 4], block_tables=[[5], [2, 7], [1, 0]], block_size=4
    )
    assert meta.positions.tolist() == [0, 1, 2, 6, 2, 3, 4, 5]
    assert meta.slot_mapping.tolist() == [20, 21, 22, 30, 6, 7, 0, 1]
    assert meta.query_start_loc.tolist() == [0, 3, 4, 8]
    assert meta.seq_lens.tolist() == meta.seq_lens_list == [3, 7, 6]
    assert meta.block_tables.tolist() == [[5, 0], [2, 7], [1, 0]]
    assert meta.logits_rows.tolist() == [2, 3, 7]
    assert (meta.max_query_len, meta.max_seq_len, meta.num_tokens) == (4, 7, 8)
    [decodes] = meta.decode_groups
    assert (decodes.rows.tolist(), decodes.blocks.tolist(), decodes.max_blocks) == ([3], [2, 7], 2)
    assert [(p.start, p.end, p.num_computed, p.seq_len, p.blocks.tolist()) for p in meta.prefills] == [
        (0, 3, 0, 3, [5]), (4, 8, 2, 6, [1, 0])]
    all_decode = AttentionMetadata.build([4, 9, 0], [1, 1, 1], [[3, 1], [2, 4, 6], [8]], 4, backend="torch")
    assert all_decode.is_all_decode
    [decodes] = all_decode.decode_groups  # sorted by length, padded to the longest
    assert decodes.rows.tolist() == [2, 0, 1] and decodes.seq_lens.tolist() == [1, 5, 10]
    assert decodes.blocks.tolist() == [8, 0, 0, 3, 1, 0, 2, 4, 6] and decodes.max_blocks == math.ceil(10 / 4)
    # A cap on padded tokens per call splits the group (lengths 1, 5 | 10 with blocks of 4 -> 8 | 12).
    split = AttentionMetadata.build([4, 9, 0], [1, 1, 1], [[3, 1], [2, 4, 6], [8]], 4, decode_group_tokens=16,
                                   backend="torch")
    assert [g.rows.tolist() for g in split.decode_groups] == [[2, 0], [1]]
    # The native kernel pads nothing: one group, the rows in order.
    native = AttentionMetadata.build([4, 9, 0], [1, 1, 1], [[3, 1], [2, 4, 6], [8]], 4, decode_group_tokens=16,
                                     backend="native")
    assert [g.rows.tolist() for g in native.decode_groups] == [[0, 1, 2]]


@pytest.mark.parametrize("args", [
    ([0], [5], [[1]]),  # 5 tokens do not fit one block of 4
    ([0], [0], [[1]]),  # no new tokens
    ([0, 0], [1], [[1]]),  # lengths disagree
    ([], [], []),
])
def test_build_metadata_rejects_bad_input(args):
    with pytest.raises(ValueError):
        AttentionMetadata.build(*args, block_size=4)


def test_transformers_builds_no_mask_for_packed_rows(monkeypatch):
    """Sequence boundaries come from AttentionMetadata only: the layers get attention_mask=None."""
    import transformers.masking_utils as masking_utils

    seen = []
    monkeypatch.setattr(masking_utils, "find_packed_sequence_indices", lambda *a: seen.append(a))
    pager = Pager(paged_model("random:mistral"), 8)  # mistral builds a sliding-window mask too
    meta = pager.metadata([("a", tokens(5, 1)), ("b", tokens(4, 2))])
    with torch.inference_mode():
        hidden = torch.zeros(1, 9, 64, device=DEVICE)
        for make in (masking_utils.create_causal_mask, masking_utils.create_sliding_window_causal_mask):
            assert make(config=pager.model.config, inputs_embeds=hidden, attention_mask=None, cache=None,
                        position_ids=meta.positions[None]) is None
    assert not seen  # not even the packed-sequence scan (a host sync on CUDA) runs


def test_attention_without_metadata_or_with_softcap_is_a_clear_error():
    model = paged_model("random:llama")
    with pytest.raises(ValueError, match="attn_metadata"):
        model(input_ids=torch.tensor([[3, 4]], device=DEVICE), use_cache=False)
    module = model.model.layers[0].self_attn
    q = torch.zeros(1, 4, 1, 16, device=DEVICE)
    kv = torch.zeros(1, 2, 1, 16, device=DEVICE)
    meta = AttentionMetadata.build([0], [1], [[0]], 4, DEVICE)
    with pytest.raises(ValueError, match="kv_caches"):
        paged_attention(module, q, kv, kv, None, attn_metadata=meta)  # built without caches
    with pytest.raises(NotImplementedError, match="softcap"):
        paged_attention(module, q, kv, kv, None, softcap=30.0, attn_metadata=meta)


@pytest.mark.parametrize("native", [True, False], ids=["native-write", "torch-write"])
def test_written_kv_reads_back_in_position_order(native):
    from worker.engine.attention import kv_cache_shapes, read_kv, write_kv

    if native and kernels.native() is None:
        pytest.fail("the native kernels did not build")
    torch.manual_seed(0)
    backend = "native" if native else "torch"
    k_shape, v_shape = kv_cache_shapes(6, 4, 2, 8, backend)
    k_cache, v_cache = torch.zeros(k_shape), torch.zeros(v_shape)
    table = torch.tensor([[5, 0, 3]])  # positions 0-3 in block 5, 4-7 in block 0, 8-11 in block 3
    positions = torch.arange(10)
    slots = table[0, positions // 4] * 4 + positions % 4
    key, value = torch.randn(2, 10, 8).transpose(0, 1), torch.randn(10, 2, 8)  # [tokens, heads, dim], any strides
    if native:
        kernels.write_kv(k_cache, v_cache, slots, key, value)
    else:
        write_kv(k_cache, v_cache, slots // 4, slots % 4, key, value)
    k, v = read_kv(k_cache, v_cache, table, 10, backend)
    assert torch.equal(k[0], key.transpose(0, 1)) and torch.equal(v[0], value.transpose(0, 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("dim", [64, 96])
def test_native_prefill_attention_matches_masked_sdpa(block_size, dtype, dim):
    """csrc/prefill_attention.cpp against SDPA with an explicit mask over the gathered context, for
    chunks fresh and after a cached prefix, shorter and longer than its tiles (16 queries, 32-64
    keys), with and without a sliding window, 9 query heads on 3 KV heads (SmolLM2's); bf16 on a
    CPU with AMX goes through its tiles (head_dim 96: a last pass of two 16-column tiles)."""
    if kernels.native() is None:
        pytest.fail("the native kernels did not build")
    heads, kv_heads, num_blocks = 9, 3, 64
    generator = torch.Generator().manual_seed(block_size)
    k_cache, v_cache = (torch.randn(shape, generator=generator).to(dtype) for shape in
                        attention.kv_cache_shapes(num_blocks, block_size, kv_heads, dim, "native"))
    for computed, new, window in [(0, 1, None), (0, 37, None), (7, 1, None), (100, 77, None), (0, 150, 50),
                                  (333, 90, 64), (64, 129, None)]:
        length = computed + new
        blocks = torch.randperm(num_blocks, generator=generator)[:-(-length // block_size)]
        q = torch.randn(new, heads, dim, generator=generator).to(dtype)
        out = torch.empty_like(q)
        kernels.prefill_attention(q, k_cache, v_cache, blocks, computed, dim ** -0.5, window, out)
        k, v = attention.read_kv(k_cache, v_cache, blocks[None], length, "native")
        positions, keys = torch.arange(computed, length)[:, None], torch.arange(length)
        visible = (keys <= positions) & ((keys > positions - window) if window else True)
        expected = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1)[None].float(), k.float(), v.float(), attn_mask=visible, scale=dim ** -0.5,
            enable_gqa=True)[0].transpose(0, 1)
        # bf16: the output's own rounding (2^-8 relative) on values of about 1
        tolerance = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=0, msg=f"{computed} + {new}, {window}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("heads, kv_heads, dim", [(9, 3, 64), (4, 4, 64), (6, 3, 40), (10, 2, 80), (8, 1, 128)])
def test_native_paged_decode_matches_sdpa(block_size, dtype, heads, kv_heads, dim):
    """csrc/paged_decode.cpp against SDPA over each sequence's gathered context: lengths shorter
    than a block, across blocks and ending mid-block, with and without a sliding window; block
    sizes under a vector's width (read in partial vectors) and over it; bf16 caches widened in
    registers; 1 to 8 query heads per KV head (the values' sums taken up to 4 heads at a time) and head
    sizes that are not a whole number of vectors (SmolLM2's 9 on 3 of 64 first)."""
    if kernels.native() is None:
        pytest.fail("the native kernels did not build")
    lens = torch.tensor([1, 5, block_size, block_size + 3, 200, 333])
    max_blocks = -(-int(lens.max()) // block_size)
    num_blocks = len(lens) * max_blocks + 3
    generator = torch.Generator().manual_seed(block_size)
    k_cache, v_cache = (torch.randn(shape, generator=generator).to(dtype) for shape in
                        attention.kv_cache_shapes(num_blocks, block_size, kv_heads, dim, "native"))
    tables = torch.randperm(num_blocks, generator=generator)[:len(lens) * max_blocks].view(len(lens), max_blocks)
    q = torch.randn(len(lens), heads, dim, generator=generator).to(dtype)
    for window in (None, 50):
        out = kernels.paged_decode(q, k_cache, v_cache, tables, lens, dim ** -0.5, window)
        for i, length in enumerate(lens.tolist()):
            k, v = attention.read_kv(k_cache, v_cache, tables[i:i + 1], length, "native")
            first = max(0, length - window) if window else 0
            expected = torch.nn.functional.scaled_dot_product_attention(
                q[i:i + 1, :, None].float(), k[:, :, first:].float(), v[:, :, first:].float(), scale=dim ** -0.5,
                enable_gqa=True)[0, :, 0]
            tolerance = 1e-5 if dtype == torch.float32 else 1e-2
            torch.testing.assert_close(out[i].float(), expected, atol=tolerance, rtol=0, msg=f"{length}, {window}")


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("heads, kv_heads, dim", [(9, 3, 64), (6, 3, 40), (8, 1, 128)])
def test_native_paged_decode_of_a_bf16_cache_is_the_float32_kernel_s_rounded(block_size, heads, kv_heads, dim):
    """A bf16 cache takes its own path (two blocks' scores at a time where a block is one vector of
    positions), but every sum adds up in the same order as float32's: the same values widened to float32
    give the same output, rounded to bf16, bit for bit; odd and even block counts, with a window."""
    if kernels.native() is None:
        pytest.fail("the native kernels did not build")
    lens = torch.tensor([1, 5, block_size, block_size + 3, 2 * block_size + 1, 200, 333])
    max_blocks = -(-int(lens.max()) // block_size)
    num_blocks = len(lens) * max_blocks + 3
    generator = torch.Generator().manual_seed(block_size)
    k_cache, v_cache = (torch.randn(shape, generator=generator).bfloat16() for shape in
                        attention.kv_cache_shapes(num_blocks, block_size, kv_heads, dim, "native"))
    tables = torch.randperm(num_blocks, generator=generator)[:len(lens) * max_blocks].view(len(lens), max_blocks)
    q = torch.randn(len(lens), heads, dim, generator=generator).bfloat16()
    for window in (None, 50):
        out = kernels.paged_decode(q, k_cache, v_cache, tables, lens, dim ** -0.5, window)
        widened = kernels.paged_decode(q.float(), k_cache.float(), v_cache.float(), tables, lens, dim ** -0.5, window)
        assert torch.equal(out, widened.bfloat16()), window
