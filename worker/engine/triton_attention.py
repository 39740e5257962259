"""Paged attention for GPUs: Triton kernels over the whole packed step (attention.py's "triton" backend).

`paged_attention` serves every sequence of the packed row in one launch, prefill chunks over a
cached prefix and decodes alike (as vLLM's "unified attention"). A program takes BLOCK_Q
consecutive new tokens of one sequence together with the GROUP query heads that share one KV head:
BLOCK_M = BLOCK_Q * GROUP rows of one tl.dot, so a KV tile is read once for the whole GQA group.
It walks the sequence's keys TILE_N positions at a time through its block table (a tile may span
blocks, or part of one), masks each row's keys causally (a new token at position p sees keys
0..p) and by the sliding window (p - j < window), keeps an online softmax in fp32 and writes its
rows of the output. Only the tiles a program's rows can see are read: up to its last row's
position, and from its first row's window start.

The grid is (num_tokens // BLOCK_Q + num_seqs, kv_heads): sequence s owns the query tiles from
query_start_loc[s] // BLOCK_Q + s on, which bounds the tiles of any split of num_tokens tokens among
num_seqs sequences. Both counts are tensor shapes, so the launch needs no host sync (a CUDA graph
can capture it); each program finds its sequence by binary search over query_start_loc, and the
spare ones return at once.

`write_kv` puts the new K/V into the cache by slot, one program per token (all its KV heads): one
launch for K and V where torch's indexed assignment takes two (each with its index bookkeeping), and
a slot < 0 (a padding token of a captured graph) writes nothing.

Under TRITON_INTERPRET=1 the kernels run on CPU tensors (the tests). The interpreter's tl.dot on
bfloat16 returns garbage, so there, and only there, bf16 operands are cast to fp32 first. The flag
must be set before triton is first imported (triton's own jit functions, tl.sum and the like, are
defined then; importing torch or transformers may import it).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# As triton.jit sees it defining the kernels below (read from the environment: triton.knobs is recent).
INTERPRETED = os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on", "yes")
MIN_DOT_SIZE = 16  # tl.dot needs at least 16 rows, columns and inner dimension
TILE_N = 32  # key positions per step of the KV walk
LOG2_E = 1.4426950408889634


@triton.jit
def _dot(a, b, DOT_FP32: tl.constexpr):
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    else:
        # fp32 operands: exact products, as torch's matmul (tf32 would lose greedy parity with HF).
        return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _attention_kernel(
    out, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
    num_seqs, scale_log2, window,
    stride_out_token, stride_out_head, stride_out_dim,
    stride_q_token, stride_q_head, stride_q_dim,
    stride_k_block, stride_k_head, stride_k_dim, stride_k_pos,
    stride_v_block, stride_v_head, stride_v_pos, stride_v_dim,
    stride_table,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr, SLIDING: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    # This tile's sequence: the last s whose first tile, query_start_loc[s] // BLOCK_Q + s, is <= tile.
    low = 0
    high = num_seqs - 1
    while low < high:
        middle = (low + high + 1) // 2
        if tl.load(query_start_loc + middle) // BLOCK_Q + middle <= tile:
            low = middle
        else:
            high = middle - 1
    seq = low
    query_start = tl.load(query_start_loc + seq)
    query_len = tl.load(query_start_loc + seq + 1) - query_start
    q_tile = tile - (query_start // BLOCK_Q + seq)
    if q_tile * BLOCK_Q >= query_len:
        return
    context_len = tl.load(seq_lens + seq) - query_len  # tokens cached before this step

    # Row r: new token q_tile * BLOCK_Q + r // GROUP of the sequence, query head kv_head * GROUP + r % GROUP.
    rows = tl.arange(0, BLOCK_M)
    q_index = q_tile * BLOCK_Q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows < BLOCK_Q * GROUP) & (q_index < query_len)
    q_pos = context_len + q_index
    token = query_start + q_index
    dims = tl.arange(0, HEAD_DIM_PADDED)
    dim_valid = dims < HEAD_DIM
    q = tl.load(query + token[:, None] * stride_q_token + head[:, None] * stride_q_head + dims[None, :] * stride_q_dim,
                mask=row_valid[:, None] & dim_valid[None, :], other=0.0)

    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], tl.float32)
    kv_end = context_len + tl.minimum((q_tile + 1) * BLOCK_Q, query_len)  # past the last row's position
    kv_start = 0
    if SLIDING:
        kv_start = tl.maximum(context_len + q_tile * BLOCK_Q - window + 1, 0) // TILE_N * TILE_N
    table = block_tables + seq * stride_table
    for start in range(kv_start, kv_end, TILE_N):
        pos = start + tl.arange(0, TILE_N)
        pos_valid = pos < kv_end
        block = tl.load(table + pos // BLOCK_SIZE, mask=pos_valid, other=0)
        offset = pos % BLOCK_SIZE
        # K is stored [dim, position] per block and head: the tile loads as the transposed operand.
        k = tl.load(k_cache + block[None, :] * stride_k_block + kv_head * stride_k_head
                    + dims[:, None] * stride_k_dim + offset[None, :] * stride_k_pos,
                    mask=dim_valid[:, None] & pos_valid[None, :], other=0.0)
        v = tl.load(v_cache + block[:, None] * stride_v_block + kv_head * stride_v_head
                    + offset[:, None] * stride_v_pos + dims[None, :] * stride_v_dim,
                    mask=pos_valid[:, None] & dim_valid[None, :], other=0.0)
        scores = _dot(q, k, DOT_FP32) * scale_log2
        visible = pos_valid[None, :] & (pos[None, :] <= q_pos[:, None])
        if SLIDING:
            visible = visible & (q_pos[:, None] - pos[None, :] < window)
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, 1))
        # A row that has seen no visible key yet (padding, or a tile before its window) keeps -inf:
        # subtract 0 instead, so that its exponentials are 0 rather than NaN.
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        p = tl.math.exp2(scores - shift[:, None])
        rescale = tl.math.exp2(row_max - shift)
        row_sum = row_sum * rescale + tl.sum(p, 1)
        acc = acc * rescale[:, None] + _dot(p.to(v.dtype), v, DOT_FP32)
        row_max = new_max
    acc = acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None]
    tl.store(out + token[:, None] * stride_out_token + head[:, None] * stride_out_head + dims[None, :] * stride_out_dim,
             acc.to(out.dtype.element_ty), mask=row_valid[:, None] & dim_valid[None, :])


@triton.jit
def _write_kv_kernel(
    k_cache, v_cache, key, value, slot_mapping,
    stride_k_block, stride_k_head, stride_k_dim, stride_k_pos,
    stride_v_block, stride_v_head, stride_v_pos, stride_v_dim,
    stride_key_token, stride_key_head, stride_key_dim,
    stride_value_token, stride_value_head, stride_value_dim,
    NUM_KV_HEADS: tl.constexpr, NUM_KV_HEADS_PADDED: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_PADDED: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping + token)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, NUM_KV_HEADS_PADDED)[:, None]
    dims = tl.arange(0, HEAD_DIM_PADDED)[None, :]
    valid = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
    k = tl.load(key + token * stride_key_token + heads * stride_key_head + dims * stride_key_dim, mask=valid)
    v = tl.load(value + token * stride_value_token + heads * stride_value_head + dims * stride_value_dim, mask=valid)
    tl.store(k_cache + block * stride_k_block + heads * stride_k_head + dims * stride_k_dim + offset * stride_k_pos,
             k, mask=valid)
    tl.store(v_cache + block * stride_v_block + heads * stride_v_head + offset * stride_v_pos + dims * stride_v_dim,
             v, mask=valid)


def _padded(head_dim: int) -> int:
    return max(MIN_DOT_SIZE, triton.next_power_of_2(head_dim))


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, key: torch.Tensor,
             value: torch.Tensor) -> None:
    """key/value [T, kv_heads, dim] of T new tokens into their flat cache slots [T] (slot < 0: skipped)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    _write_kv_kernel[(num_tokens,)](
        k_cache, v_cache, key, value, slots, *k_cache.stride(), *v_cache.stride(), *key.stride(), *value.stride(),
        NUM_KV_HEADS=num_kv_heads, NUM_KV_HEADS_PADDED=triton.next_power_of_2(num_kv_heads), HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=triton.next_power_of_2(head_dim), BLOCK_SIZE=k_cache.shape[3],
    )


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                    scaling: float, sliding_window: int | None) -> torch.Tensor:
    """query [T, heads, dim] of the packed row -> attention output [T, heads, dim]. Sequence s has the
    rows query_start_loc[s] .. query_start_loc[s+1] - 1, its context of seq_lens[s] tokens (those rows
    the last ones) in the blocks block_tables[s]; K/V caches as attention.kv_cache_shapes."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads, block_size = k_cache.shape[1], k_cache.shape[3]
    group = num_heads // num_kv_heads
    block_m = max(MIN_DOT_SIZE, triton.next_power_of_2(group))
    block_q = block_m // group
    num_seqs = seq_lens.shape[0]
    out = query.new_empty(num_tokens, num_heads, head_dim)
    _attention_kernel[(num_tokens // block_q + num_seqs, num_kv_heads)](
        out, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
        num_seqs, scaling * LOG2_E, sliding_window or 0,
        *out.stride(), *query.stride(), *k_cache.stride(), *v_cache.stride(), block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PADDED=_padded(head_dim), BLOCK_SIZE=block_size,
        BLOCK_Q=block_q, BLOCK_M=block_m, TILE_N=TILE_N, SLIDING=sliding_window is not None,
        DOT_FP32=INTERPRETED and query.dtype == torch.bfloat16,
    )
    return out
