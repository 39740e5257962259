"""Paged attention plugged into transformers' attention interface.

Each step the runner packs every scheduled token (prefill chunks and decodes mixed) into
ONE row [1, T] and calls the stock HF model once with `attn_metadata=AttentionMetadata`.
transformers hands each layer's q [1, heads, T, dim] and the new k/v [1, kv_heads, T, dim]
to `paged_attention`, which writes the new K/V into the paged pool (by slot) and attends
each sequence's queries to its whole context, read back through its block table.

Decodes (one new token) are batched. On CPU the native kernel (csrc/paged_decode.cpp) reads
their K/V straight from the blocks: SmolLM2's 16-row decode step of the offline benchmark went
100 -> 68 ms with it tuned (whole blocks per sequence, vectorized across positions). Elsewhere
(or without a compiler) they are sorted by length, cut into groups of bounded padded size, each
group's KV gathered into [decodes, kv_heads, max_len, dim] and served by one SDPA call, with
the query heads of a KV group folded into the query axis (no K/V repeat for GQA).
Prefill chunks on the native backend are read from the blocks too (csrc/prefill_attention.cpp:
flash attention's tiles, nothing computed past the causal line): against SDPA on SmolLM2's shape
(AVX-512, 2 threads, chunks of 512-2,048 tokens, fresh or after a cached prefix, whose explicit mask
makes SDPA compute the masked half too) 1.5-2.5x over several runs; elsewhere one SDPA each (plain
is_causal when no cached prefix).
On CUDA the Triton kernels of triton_attention.py serve the whole step in one launch instead.

Gather + SDPA, measured (SmolLM2-135M shape, random weights, 64 decodes with 100-600 context, block 16, CPU,
1 thread; the model alone with no context: 334 ms/step fp32): one SDPA per sequence 636 ms;
one group of all 64 (30 MB gathered per K per layer, page-faulted afresh by malloc) 2126 ms;
groups of <= 16384 / 8192 / 4096 / 2048 padded tokens 833 / 694 / 644 / 608 ms.
bf16: per sequence 2850 ms, one group 2544, 4096-token groups 2094 (model alone 1914).
"""

from __future__ import annotations

import importlib.util
import inspect
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Sequence, get_args

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

from worker.engine import kernels
from worker.engine.block_tables import StepTables
from worker.engine.config import AttentionBackend
from worker.engine.host_copy import to_device

ATTN_IMPLEMENTATION = "streambatch_paged"
# Padded context tokens per batched decode call, per device type (see the module docstring).
DECODE_GROUP_TOKENS = {"cpu": 4096, "cuda": 1 << 20}
BACKENDS = get_args(AttentionBackend)


def default_backend(device: torch.device | str) -> AttentionBackend:
    """native on CPU when the C++ kernels build, triton on CUDA when triton is installed, else torch."""
    kind = torch.device(device).type
    if kind == "cpu" and kernels.native() is not None:
        return "native"
    if kind == "cuda" and importlib.util.find_spec("triton") is not None:
        return "triton"
    return "torch"


@dataclass
class PrefillChunk:
    """One sequence with several new tokens: rows start:end of the packed row."""

    start: int
    end: int
    num_computed: int  # tokens of this sequence already in the cache before the step
    seq_len: int  # num_computed + (end - start)
    blocks: torch.Tensor  # physical blocks holding positions 0 .. seq_len-1


@dataclass
class DecodeGroup:
    """Sequences with one new token, attended in one batched call over their padded context."""

    rows: torch.Tensor  # [n] their rows in the packed row
    blocks: torch.Tensor  # [n * max_blocks] flattened, padded block tables
    seq_lens: torch.Tensor  # [n]
    max_blocks: int


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] flat cache slot of each new token (block * block_size + offset)
    positions: torch.Tensor  # [T] position of each new token in its sequence
    query_start_loc: torch.Tensor  # [S+1] cu_seqlens of the new tokens
    seq_lens: torch.Tensor  # [S] context length after this step
    block_tables: torch.Tensor  # [S, width] physical block ids (columns past a sequence's blocks: any block)
    logits_rows: torch.Tensor  # [S] row of each sequence's last new token
    block_size: int
    max_query_len: int
    max_seq_len: int
    seq_lens_list: list[int]
    query_start_loc_list: list[int]
    # Sequences with exactly one new token (decodes, or a 1-token last chunk): batched calls.
    # Neither list is built for the triton backend, whose one launch reads the tensors above.
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillChunk]
    backend: AttentionBackend
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    _masks: dict = field(default_factory=dict, repr=False)  # masks per (group, window), shared by layers

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_list[-1]

    @property
    def is_all_decode(self) -> bool:
        return self.max_query_len == 1

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    @classmethod
    def build(
        cls,
        num_computed: Sequence[int],
        num_new: Sequence[int],
        block_tables: Sequence[Sequence[int]] | StepTables,
        block_size: int,
        device: torch.device | str = "cpu",
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
        decode_group_tokens: int | None = None,
        backend: AttentionBackend | None = None,
        sampling: Sequence[int] | None = None,
    ) -> AttentionMetadata:
        """Plain Python per-sequence data -> tensors. Sequence i's new tokens take positions
        num_computed[i] .. num_computed[i] + num_new[i] - 1; its blocks are block_tables[i] (lists,
        checked here, or the rows of a runner's persistent tables). decode_group_tokens caps the
        padded context of one batched decode call (default: DECODE_GROUP_TOKENS[device type]).
        backend (default: default_backend(device)): "native" writes new K/V and reads decodes straight
        from the cache with the C++ kernels, padding nothing, so all decodes form one group.
        `sampling`: the sequences whose last token gets logits (default all)."""
        backend = backend or default_backend(device)
        device = torch.device(device)
        if backend not in BACKENDS:
            raise ValueError(f"unknown attention backend {backend!r}: choose from {', '.join(BACKENDS)}")
        if not (len(num_computed) == len(num_new)) or not num_new:
            raise ValueError("num_computed, num_new and block_tables need one entry per sequence (at least one)")
        seq_lens = [c + n for c, n in zip(num_computed, num_new)]
        if not isinstance(block_tables, StepTables):
            if len(block_tables) != len(num_new):
                raise ValueError("num_computed, num_new and block_tables need one entry per sequence")
            for i, (n, length, table) in enumerate(zip(num_new, seq_lens, block_tables)):
                if n < 1 or len(table) * block_size < length:
                    raise ValueError(f"sequence {i}: {n} new tokens, context {length}, {len(table)} blocks "
                                     f"of {block_size}")
            block_tables = StepTables.of(block_tables, device)
        query_start_loc = [0]
        for n in num_new:
            query_start_loc.append(query_start_loc[-1] + n)
        # Index math on the host (small tensors), then one copy of them all to the device.
        new = torch.tensor(num_new)
        seq_of_token = torch.repeat_interleave(torch.arange(len(num_new)), new)
        starts = torch.tensor(query_start_loc[:-1])
        positions = torch.arange(query_start_loc[-1]) - starts[seq_of_token] + torch.tensor(num_computed)[seq_of_token]
        rows = torch.tensor(block_tables.rows)
        slots = block_tables.host[rows[seq_of_token], positions // block_size] * block_size + positions % block_size
        logits_rows = torch.tensor(query_start_loc[1:]) - 1
        if sampling is not None:
            logits_rows = logits_rows[sampling]
        slots, positions, query_start_loc_t, seq_lens_t, logits_rows, device_rows = to_device(
            device, slots, positions, torch.tensor(query_start_loc), torch.tensor(seq_lens), logits_rows, rows)

        decode_groups, prefills = [], []
        if backend != "triton":  # one launch reads the tensors above; the other backends loop over these
            tables = block_tables.host.index_select(0, rows)
            # Decodes sorted by length and cut into groups of bounded padded size: less padding, and on
            # CPU each group's gathered K/V stays in cache between gather and attention.
            cap = decode_group_tokens or DECODE_GROUP_TOKENS.get(device.type, DECODE_GROUP_TOKENS["cpu"])
            decodes = [i for i, n in enumerate(num_new) if n == 1]
            if backend == "native":  # no padding: one group, in row order
                cap = float("inf")
            else:
                decodes.sort(key=seq_lens.__getitem__)
            groups: list[list[int]] = [[]]
            for i in decodes:
                padded = -(-seq_lens[i] // block_size) * block_size  # i is the longest of its group so far
                if groups[-1] and (len(groups[-1]) + 1) * padded > cap:
                    groups.append([])
                groups[-1].append(i)
            decode_groups = [cls._decode_group(g, starts, tables, seq_lens, block_size, device) for g in groups if g]
            prefills = [PrefillChunk(query_start_loc[i], query_start_loc[i + 1], num_computed[i], seq_lens[i],
                                     tables[i, : -(-seq_lens[i] // block_size)].to(device))
                        for i, n in enumerate(num_new) if n > 1]
        return cls(
            slot_mapping=slots,
            positions=positions,
            query_start_loc=query_start_loc_t,
            seq_lens=seq_lens_t,
            block_tables=block_tables.on_device.index_select(0, device_rows),
            logits_rows=logits_rows,
            block_size=block_size,
            max_query_len=max(num_new),
            max_seq_len=max(seq_lens),
            seq_lens_list=seq_lens,
            query_start_loc_list=query_start_loc,
            decode_groups=decode_groups,
            prefills=prefills,
            backend=backend,
            kv_caches=kv_caches if kv_caches is not None else [],
        )

    @staticmethod
    def _decode_group(seqs, starts, tables, seq_lens, block_size, device) -> DecodeGroup:
        max_blocks = -(-max(seq_lens[i] for i in seqs) // block_size)
        rows, blocks, lengths = to_device(device, starts[seqs], tables[seqs, :max_blocks].flatten(),
                                          torch.tensor([seq_lens[i] for i in seqs]))
        return DecodeGroup(rows=rows, blocks=blocks, seq_lens=lengths, max_blocks=max_blocks)

    def _visible(self, key: object, q_pos: torch.Tensor, kv_len: int, window: int | None) -> torch.Tensor:
        """Bool mask [*q_pos.shape, kv_len]: key j is visible to a query at position p iff
        j <= p (and p - j < window). Built once per step, reused by every layer."""
        mask = self._masks.get((key, window))
        if mask is None:
            kv = torch.arange(kv_len, device=q_pos.device)
            mask = kv <= q_pos[..., None]
            if window is not None:
                mask &= kv > q_pos[..., None] - window
            self._masks[(key, window)] = mask
        return mask


def kv_cache_shapes(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                    backend: AttentionBackend) -> tuple[tuple, tuple]:
    """Per layer (K shape, V shape). Values are stored per block and head as [block_size, head_dim],
    and so are keys, except for the native kernel: it keeps each block's keys as a [head_dim,
    block_size] tile, so that decode attention computes q.k across positions with no horizontal sums
    (its inner loop). On a GPU that layout would load keys two bytes at a time (triton_attention.py)."""
    values = (num_blocks, num_kv_heads, block_size, head_dim)
    if backend == "native":
        return (num_blocks, num_kv_heads, head_dim, block_size), values
    return values, values


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor,
             key: torch.Tensor, value: torch.Tensor) -> None:
    """key/value [T, kv_heads, head_dim] of T new tokens into their (block, offset) slots (the torch
    backend's layout: both [blocks, kv_heads, block_size, head_dim])."""
    k_cache[blocks, :, offsets] = key
    v_cache[blocks, :, offsets] = value


def read_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor, length: int | None = None,
            backend: AttentionBackend = "torch") -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [n, kv_heads, positions, head_dim] of n sequences, gathered through their block
    tables [n, blocks] (positions = blocks * block_size, or the first `length`) from caches laid out
    for `backend` (kv_cache_shapes)."""
    n, num_blocks = tables.shape
    _, kv_heads, block_size, head_dim = v_cache.shape
    flat = tables.flatten()
    shape = (n, kv_heads, num_blocks * block_size, head_dim)
    k = k_cache.index_select(0, flat)
    if backend == "native":
        k = k.view(n, num_blocks, kv_heads, head_dim, block_size).permute(0, 2, 1, 4, 3)
    else:
        k = k.view(n, num_blocks, kv_heads, block_size, head_dim).transpose(1, 2)
    v = v_cache.index_select(0, flat).view(n, num_blocks, kv_heads, block_size, head_dim).transpose(1, 2)
    return k.reshape(shape)[:, :, :length], v.reshape(shape)[:, :, :length]


def paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    attn_metadata: AttentionMetadata | None = None,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface -> attend(). The step's metadata comes in the model call's
    kwargs. A compiled forward (compiled.py) passes the caches instead and calls the operator below,
    which takes the metadata from the step context: a graph's operators take only tensors and numbers."""
    if softcap is not None or kwargs.get("s_aux") is not None:
        raise NotImplementedError("paged attention: logit softcapping / attention sinks are not supported")
    if getattr(module, "is_causal", True) is False:
        raise NotImplementedError("paged attention: only causal (decoder) attention is supported")
    if attn_metadata is None and kv_caches is None:
        raise ValueError(f"'{ATTN_IMPLEMENTATION}' attention needs attn_metadata=AttentionMetadata in the model call")
    caches = kv_caches if kv_caches is not None else attn_metadata.kv_caches
    if module.layer_idx >= len(caches):
        raise ValueError(f"kv_caches has {len(caches)} layers; layer {module.layer_idx} needs one")
    k_cache, v_cache = caches[module.layer_idx]
    scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
    # float32 activations over a bf16 cache (a bf16 model on the CPU, runner.py): attended in the cache's type
    activations = query.dtype
    query, key, value = (x.to(k_cache.dtype) for x in (query, key, value))
    if attn_metadata is None:
        out = torch.ops.streambatch.paged_attention(query, key, value, k_cache, v_cache, scaling, sliding_window)
    else:
        out = attend(attn_metadata, k_cache, v_cache, query, key, value, scaling, sliding_window)
    return out.to(activations), None


_step_metadata: AttentionMetadata | None = None


@contextmanager
def step_metadata(meta: AttentionMetadata):
    """The metadata the paged_attention operator reads during one forward."""
    global _step_metadata
    previous, _step_metadata = _step_metadata, meta
    try:
        yield
    finally:
        _step_metadata = previous


# The caches are declared mutated: an operator the compiler believes pure may be dropped when its
# output goes unused (a step whose chunks need no logits), and its cache writes with it.
@torch.library.custom_op("streambatch::paged_attention", mutates_args=("k_cache", "v_cache"))
def _paged_attention_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, scaling: float, sliding_window: int | None) -> torch.Tensor:
    if _step_metadata is None:
        raise ValueError("the paged_attention operator runs inside attention.step_metadata(meta)")
    return attend(_step_metadata, k_cache, v_cache, query, key, value, scaling, sliding_window)


@_paged_attention_op.register_fake
def _(query, key, value, k_cache, v_cache, scaling, sliding_window):
    _, num_heads, num_tokens, head_dim = query.shape
    return query.new_empty(1, num_tokens, num_heads, head_dim)


def attend(meta: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor, query: torch.Tensor,
           key: torch.Tensor, value: torch.Tensor, scaling: float, sliding_window: int | None) -> torch.Tensor:
    """q [1, heads, T, dim], new k/v [1, kv_heads, T, dim] -> attention output [1, T, heads, dim];
    the new K/V written to the layer's cache."""
    _, num_heads, num_tokens, head_dim = query.shape
    num_kv_heads = key.shape[1]
    group = num_heads // num_kv_heads
    block_size = meta.block_size

    # Write the new K/V first, so the reads below see the whole context.
    new_keys, new_values = key[0].transpose(0, 1), value[0].transpose(0, 1)
    if meta.backend == "triton":
        # Imported here: only this backend needs triton (CUDA torch brings it; a CPU install may lack it).
        from worker.engine import triton_attention

        triton_attention.write_kv(k_cache, v_cache, meta.slot_mapping, new_keys, new_values)
        segments = triton_attention.num_segments(meta.num_seqs, num_kv_heads, meta.is_all_decode, query.device)
        return triton_attention.paged_attention(query[0].transpose(0, 1), k_cache, v_cache, meta.query_start_loc,
                                                meta.seq_lens, meta.block_tables, scaling, sliding_window,
                                                segments)[None]
    if meta.backend == "native":
        kernels.write_kv(k_cache, v_cache, meta.slot_mapping, new_keys, new_values)
    else:
        write_kv(k_cache, v_cache, meta.slot_mapping // block_size, meta.slot_mapping % block_size, new_keys, new_values)

    # All-decode step on the native kernel: its one group is every row in order, no gather or scatter.
    in_place = meta.backend == "native" and meta.is_all_decode
    out = None if in_place else query.new_empty(num_tokens, num_heads, head_dim)
    for g, decodes in enumerate(meta.decode_groups):
        n, kv_len = decodes.rows.numel(), decodes.max_blocks * block_size
        if meta.backend == "native":
            q = query[0].transpose(0, 1)
            o = kernels.paged_decode(q if in_place else q.index_select(0, decodes.rows), k_cache, v_cache,
                                     decodes.blocks.view(n, -1), decodes.seq_lens, scaling, sliding_window)
            if in_place:
                return o.unsqueeze(0)
            out.index_copy_(0, decodes.rows, o)
            continue
        # Heads h = kv*group + j share KV head kv: fold the group into the query axis (no K/V repeat).
        q = query[0].transpose(0, 1).index_select(0, decodes.rows).view(n, num_kv_heads, group, head_dim)
        k, v = read_kv(k_cache, v_cache, decodes.blocks.view(n, -1), backend=meta.backend)
        mask = meta._visible(("decode", g), decodes.seq_lens - 1, kv_len, sliding_window)[:, None, None, :]
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)
        out.index_copy_(0, decodes.rows, o.reshape(n, num_heads, head_dim))

    for i, chunk in enumerate(meta.prefills):
        if meta.backend == "native":
            kernels.prefill_attention(query[0, :, chunk.start : chunk.end].transpose(0, 1), k_cache, v_cache,
                                      chunk.blocks, chunk.num_computed, scaling, sliding_window,
                                      out[chunk.start : chunk.end])
            continue
        q = query[:, :, chunk.start : chunk.end]
        if chunk.num_computed == 0 and sliding_window is None:
            # Fresh prompt: its K/V are all in this step, the mask is plain causal.
            o = F.scaled_dot_product_attention(
                q, key[:, :, chunk.start : chunk.end], value[:, :, chunk.start : chunk.end],
                is_causal=True, scale=scaling, enable_gqa=True,
            )
        else:
            k, v = read_kv(k_cache, v_cache, chunk.blocks[None], chunk.seq_len, meta.backend)
            q_pos = torch.arange(chunk.num_computed, chunk.seq_len, device=query.device)
            mask = meta._visible(i, q_pos, chunk.seq_len, sliding_window)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=True)
        out[chunk.start : chunk.end] = o[0].transpose(0, 1)
    return out.unsqueeze(0)


# Deliberately NO AttentionMaskInterface entry: for a name it does not know, transformers
# (masking_utils._preprocess_mask_arguments) exits before building any mask. A registered
# mask function that returns None would also work, but transformers first runs its
# packed-sequence detection on position_ids, whose `if (...).all()` is a host sync per forward on CUDA.
AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention)


def compute_logits(model: torch.nn.Module, hidden_states: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """lm_head on the selected rows of [1, T, hidden] only: a 2,000-token prefill needs one row of logits."""
    return model.get_output_embeddings()(hidden_states[0].index_select(0, rows))


def run_model(model: torch.nn.Module, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """One packed forward: input_ids [T] -> logits [num_seqs, vocab] (last new token of each sequence)."""
    return model_logits(model, input_ids[None], meta.positions[None], meta.logits_rows, attn_metadata=meta)


def model_logits(model: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
                 logits_rows: torch.Tensor, **kwargs) -> torch.Tensor:
    """input_ids, position_ids [1, T] -> logits [rows, vocab] of the given rows. Uses transformers'
    `logits_to_keep` (a tensor of rows) when the model has it, else base model + lm_head."""
    kwargs.update(position_ids=position_ids, use_cache=False)
    if _accepts_logits_to_keep(type(model)):
        return model(input_ids=input_ids, logits_to_keep=logits_rows, **kwargs).logits[0]
    hidden = model.get_decoder()(input_ids=input_ids, **kwargs).last_hidden_state
    return compute_logits(model, hidden, logits_rows)


_LOGITS_TO_KEEP: dict[type, bool] = {}


@torch.compiler.assume_constant_result  # a compiled forward takes the answer as given: no guard on the cache
def _accepts_logits_to_keep(cls: type) -> bool:
    if cls not in _LOGITS_TO_KEEP:
        _LOGITS_TO_KEEP[cls] = "logits_to_keep" in inspect.signature(cls.forward).parameters
    return _LOGITS_TO_KEEP[cls]
