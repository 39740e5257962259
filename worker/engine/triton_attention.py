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

The grid is (num_tokens // BLOCK_Q + num_seqs, kv_heads, segments): sequence s owns the query tiles
from query_start_loc[s] // BLOCK_Q + s on, which bounds the tiles of any split of num_tokens tokens
among num_seqs sequences. Both counts are tensor shapes, so the launch needs no host sync (a CUDA
graph can capture it); each program finds its sequence by binary search over query_start_loc, and
the spare ones return at once.

Split KV: a step of few decodes has few programs (1 to 16 sequences of Llama-3-8B's 8 KV heads: 8 to
128 programs for an H200's 132 multiprocessors), each walking a whole context. Such a step splits
every context into `segments` ranges (`num_segments`, from the grid's size alone, so that each
captured batch size has one); each program writes its range's unnormalised output, maximum and
sum, and `_reduce_segments_kernel` combines them, as vLLM's 3D unified attention does.

The caches are [blocks, kv_heads, block_size, head_dim] for K and V alike: a tile of keys is
head_dim-contiguous per position, so it loads in 16-byte asynchronous copies (cp.async on sm_90:
96 registers a thread; the [head_dim, position] layout the CPU kernel keeps loaded K two bytes at
a time outside the copy pipeline, at 168). tests/engine/test_triton_attention.py compiles the
kernels for sm_90 to keep it so.

No variant is compiled mid-traffic: Triton specializes an int argument by its value (1, divisible
by 16, other) unless told not to, so the arguments that vary between steps (the sequence count, the
block tables' width) are not specialized, a size-1 dimension's stride is passed as if contiguous,
and `warm_up` launches every variant a runner can use at start-up.

`write_kv` puts the new K/V into the cache by slot, one program per token (all its KV heads): one
launch for K and V where torch's indexed assignment takes two (each with its index bookkeeping), and
a slot < 0 (a padding token of a captured graph) writes nothing.

Under TRITON_INTERPRET=1 the kernels run on CPU tensors (the tests). The interpreter's tl.dot on
bfloat16 returns garbage, so there, and only there, bf16 operands are cast to fp32 first. The flag
must be set before triton is first imported (triton's own jit functions, tl.sum and the like, are
defined then; importing torch or transformers may import it).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

# As triton.jit sees it defining the kernels below (read from the environment: triton.knobs is recent).
INTERPRETED = os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on", "yes")
MIN_DOT_SIZE = 16  # tl.dot needs at least 16 rows, columns and inner dimension
TILE_N = 32  # key positions per step of the KV walk
LOG2_E = 1.4426950408889634
MAX_SEGMENTS = 16  # ranges a context is split into, at most (a power of 2)
# No device to ask under the interpreter: a GPU this small makes the tests' few decodes split too.
INTERPRETED_MULTIPROCESSORS = 4


@triton.jit
def _dot(a, b, DOT_FP32: tl.constexpr):
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    else:
        # fp32 operands: exact products, as torch's matmul (tf32 would lose greedy parity with HF).
        return tl.dot(a, b, input_precision="ieee")


# Not specialized: what varies between steps (see the module docstring), and the index tensors'
# alignment (they may be views into one uploaded buffer), which scalar loads do not use.
@triton.jit(do_not_specialize=["num_seqs", "stride_table"],
            do_not_specialize_on_alignment=["block_tables", "seq_lens", "query_start_loc"])
def _attention_kernel(
    out, partial_acc, partial_max, partial_sum, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
    num_seqs, scale_log2, window,
    stride_out_token, stride_out_head, stride_out_dim,
    stride_q_token, stride_q_head, stride_q_dim,
    stride_k_block, stride_k_head, stride_k_pos, stride_k_dim,
    stride_v_block, stride_v_head, stride_v_pos, stride_v_dim,
    stride_table,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr, SLIDING: tl.constexpr,
    DOT_FP32: tl.constexpr, NUM_SEGMENTS: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)
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
    # This program's share of the tiles: all of them, or one segment's.
    tiles_per_segment = tl.cdiv(tl.cdiv(kv_end - kv_start, TILE_N), NUM_SEGMENTS)
    walk_start = kv_start + segment * tiles_per_segment * TILE_N
    walk_end = tl.minimum(kv_end, walk_start + tiles_per_segment * TILE_N)
    table = block_tables + seq * stride_table
    for start in range(walk_start, walk_end, TILE_N):
        pos = start + tl.arange(0, TILE_N)
        pos_valid = pos < kv_end
        block = tl.load(table + pos // BLOCK_SIZE, mask=pos_valid, other=0)
        offset = pos % BLOCK_SIZE
        # K loads as the transposed operand [dim, position] of q.k; in memory each position's head_dim is contiguous.
        k = tl.load(k_cache + block[None, :] * stride_k_block + kv_head * stride_k_head
                    + offset[None, :] * stride_k_pos + dims[:, None] * stride_k_dim,
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
    if NUM_SEGMENTS == 1:
        acc = acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None]
        tl.store(out + token[:, None] * stride_out_token + head[:, None] * stride_out_head
                 + dims[None, :] * stride_out_dim, acc.to(out.dtype.element_ty),
                 mask=row_valid[:, None] & dim_valid[None, :])
    else:
        # The segment's unnormalised output, maximum and sum: [tokens, heads, segments(, HEAD_DIM_PADDED)].
        slot = (token * (tl.num_programs(1) * GROUP) + head) * NUM_SEGMENTS + segment
        tl.store(partial_acc + slot[:, None] * HEAD_DIM_PADDED + dims[None, :], acc, mask=row_valid[:, None])
        tl.store(partial_max + slot, row_max, mask=row_valid)
        tl.store(partial_sum + slot, row_sum, mask=row_valid)


@triton.jit
def _reduce_segments_kernel(
    out, partial_acc, partial_max, partial_sum, stride_out_token, stride_out_head, stride_out_dim,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr, NUM_SEGMENTS: tl.constexpr,
):
    """One (token, head): its segments' outputs, each rescaled to the largest maximum, over their summed sums."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    first = (token * tl.num_programs(1) + head) * NUM_SEGMENTS
    segments = first + tl.arange(0, NUM_SEGMENTS)
    maxima = tl.load(partial_max + segments)
    largest = tl.max(maxima, 0)
    weights = tl.math.exp2(maxima - tl.where(largest == float("-inf"), 0.0, largest))  # empty segments: 0
    total = tl.sum(tl.load(partial_sum + segments) * weights, 0)
    dims = tl.arange(0, HEAD_DIM_PADDED)
    acc = tl.sum(tl.load(partial_acc + segments[:, None] * HEAD_DIM_PADDED + dims[None, :]) * weights[:, None], 0)
    acc = acc / tl.where(total > 0, total, 1.0)
    tl.store(out + token * stride_out_token + head * stride_out_head + dims * stride_out_dim,
             acc.to(out.dtype.element_ty), mask=dims < HEAD_DIM)


@triton.jit(do_not_specialize_on_alignment=["slot_mapping"])
def _write_kv_kernel(
    k_cache, v_cache, key, value, slot_mapping,
    stride_k_block, stride_k_head, stride_k_pos, stride_k_dim,
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
    tl.store(k_cache + block * stride_k_block + heads * stride_k_head + offset * stride_k_pos + dims * stride_k_dim,
             k, mask=valid)
    tl.store(v_cache + block * stride_v_block + heads * stride_v_head + offset * stride_v_pos + dims * stride_v_dim,
             v, mask=valid)


def _padded(head_dim: int) -> int:
    return max(MIN_DOT_SIZE, triton.next_power_of_2(head_dim))


def _strides(tensor: torch.Tensor) -> tuple[int, ...]:
    """Its strides, a size-1 dimension's as if contiguous: torch leaves those arbitrary (a 1-token
    step's may read 1), and Triton would compile another variant for each."""
    strides, contiguous = list(tensor.stride()), 1
    for dim in reversed(range(tensor.dim())):
        if tensor.shape[dim] == 1:
            strides[dim] = contiguous
        contiguous *= tensor.shape[dim]
    return tuple(strides)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, key: torch.Tensor,
             value: torch.Tensor) -> None:
    """key/value [T, kv_heads, dim] of T new tokens into their flat cache slots [T] (slot < 0: skipped)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    _write_kv_kernel[(num_tokens,)](
        k_cache, v_cache, key, value, slots, *k_cache.stride(), *v_cache.stride(), *_strides(key), *_strides(value),
        NUM_KV_HEADS=num_kv_heads, NUM_KV_HEADS_PADDED=triton.next_power_of_2(num_kv_heads), HEAD_DIM=head_dim,
        HEAD_DIM_PADDED=triton.next_power_of_2(head_dim), BLOCK_SIZE=v_cache.shape[2],
    )


@functools.cache
def multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRETED_MULTIPROCESSORS
    return torch.cuda.get_device_properties(device).multi_processor_count


def num_segments(num_seqs: int, num_kv_heads: int, all_decode: bool, device: torch.device | str) -> int:
    """How many ranges each context is split into: 1 unless a step of decodes alone has fewer programs
    (a sequence's KV heads) than the device has multiprocessors; then the power of 2 that fills them."""
    programs = num_seqs * num_kv_heads
    available = multiprocessors(torch.device(device))
    if not all_decode or programs >= available:
        return 1
    return min(MAX_SEGMENTS, triton.next_power_of_2(-(-available // programs)))


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                    scaling: float, sliding_window: int | None, segments: int = 1) -> torch.Tensor:
    """query [T, heads, dim] of the packed row -> attention output [T, heads, dim]. Sequence s has the
    rows query_start_loc[s] .. query_start_loc[s+1] - 1, its context of seq_lens[s] tokens (those rows
    the last ones) in the blocks block_tables[s]; K/V caches as attention.kv_cache_shapes gives them
    for this backend. `segments` > 1 splits each context into that many ranges (num_segments)."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads, block_size = v_cache.shape[1], v_cache.shape[2]
    group = num_heads // num_kv_heads
    block_m = max(MIN_DOT_SIZE, triton.next_power_of_2(group))
    block_q = block_m // group
    num_seqs = seq_lens.shape[0]
    padded = _padded(head_dim)
    out = query.new_empty(num_tokens, num_heads, head_dim)
    partial_acc = partial_max = partial_sum = out  # unused by one segment
    if segments > 1:
        partial_acc = query.new_empty(num_tokens, num_heads, segments, padded, dtype=torch.float32)
        partial_max = query.new_empty(num_tokens, num_heads, segments, dtype=torch.float32)
        partial_sum = torch.empty_like(partial_max)
    _attention_kernel[(num_tokens // block_q + num_seqs, num_kv_heads, segments)](
        out, partial_acc, partial_max, partial_sum, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
        num_seqs, scaling * LOG2_E, sliding_window or 0,
        *_strides(out), *_strides(query), *k_cache.stride(), *v_cache.stride(), block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_PADDED=padded, BLOCK_SIZE=block_size,
        BLOCK_Q=block_q, BLOCK_M=block_m, TILE_N=TILE_N, SLIDING=sliding_window is not None,
        DOT_FP32=INTERPRETED and query.dtype == torch.bfloat16, NUM_SEGMENTS=segments,
    )
    if segments > 1:
        _reduce_segments_kernel[(num_tokens, num_heads)](
            out, partial_acc, partial_max, partial_sum, *_strides(out),
            HEAD_DIM=head_dim, HEAD_DIM_PADDED=padded, NUM_SEGMENTS=segments,
        )
    return out


def warm_up(k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, sliding_window: int | None) -> None:
    """Launch every variant a runner with these caches can use (one per segment count a decode step
    can take, the reduction's for each, the cache write), so that none compiles while serving. It
    writes nothing (its token's slot is -1) and reads block 0."""
    device = v_cache.device
    num_kv_heads, head_dim = v_cache.shape[1], v_cache.shape[3]
    query = v_cache.new_zeros(1, num_heads, head_dim)
    key = v_cache.new_zeros(1, num_kv_heads, head_dim)
    write_kv(k_cache, v_cache, torch.tensor([-1], device=device), key, key)
    starts, lengths, table = (torch.tensor(values, device=device) for values in ([0, 1], [1], [[0]]))
    for segments in sorted({num_segments(n, num_kv_heads, True, device)
                            for n in range(1, -(-multiprocessors(device) // num_kv_heads) + 1)}):
        paged_attention(query, k_cache, v_cache, starts, lengths, table, 1.0, sliding_window, segments)
