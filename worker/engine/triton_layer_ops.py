"""A decoder layer's small ops on a GPU, one Triton kernel each: what csrc/layer_ops.cpp is to the
CPU (layer_ops.py swaps either in). On an H200 a 64-sequence decode step of the Llama-3-8B shape
spent 2.8 of its 9.5 ms in small unfused kernels, RMSNorm's eight a norm the most of them.

Each kernel rounds where the module's ops round (LlamaRMSNorm: the normalized row to x's dtype,
then its product with the weight; SiLU, then its product with up; the rotary embedding: each of its
two products, then their sum), computing in float32 between. One program a row (the rotary: a head
of a token's row): a layer's rows are a few thousand elements wide (BLOCK holds the whole row).
Under TRITON_INTERPRET=1 (the tests) they run on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rounded(x, like_ptr, BF16: tl.constexpr):
    """x (float32) rounded to the dtype of like_ptr's tensor (bf16 where BF16), to nearest even, as float32. bf16
    by its bits, as torch rounds (Triton's interpreter would truncate a conversion): then storing it is exact.
    An op's intermediates round as the module's (its input's dtype), its result as it is stored (its output's)."""
    if BF16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    return x.to(like_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _rms_norm_kernel(x_ptr, weight_ptr, out_ptr, width, eps, BLOCK: tl.constexpr, BF16: tl.constexpr,
                     OUT_BF16: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    columns = tl.arange(0, BLOCK)
    inside = columns < width
    x = tl.load(x_ptr + row * width + columns, mask=inside, other=0.0).to(tl.float32)
    scale = tl.rsqrt(tl.sum(x * x, axis=0) / width + eps)
    weight = tl.load(weight_ptr + columns, mask=inside, other=0.0).to(tl.float32)
    out = _rounded(_rounded(x * scale, x_ptr, BF16) * weight, out_ptr, OUT_BF16)
    tl.store(out_ptr + row * width + columns, out.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, width, BLOCK: tl.constexpr, BF16: tl.constexpr, OUT_BF16: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    columns = tl.arange(0, BLOCK)
    inside = columns < width
    gate = tl.load(x_ptr + row * 2 * width + columns, mask=inside, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * width + width + columns, mask=inside, other=0.0).to(tl.float32)
    out = _rounded(_rounded(gate / (1.0 + tl.exp(-gate)), x_ptr, BF16) * up, out_ptr, OUT_BF16)
    tl.store(out_ptr + row * width + columns, out.to(out_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _rotary_kernel(qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, row_stride, heads, kv_heads, d, BLOCK: tl.constexpr,
                   BF16: tl.constexpr, OUT_BF16: tl.constexpr):
    token, head = tl.program_id(0).to(tl.int64), tl.program_id(1)
    columns = tl.arange(0, BLOCK)
    inside = columns < d
    half = d // 2
    partner = tl.where(columns < half, columns + half, columns - half)
    x = tl.load(qkv_ptr + token * row_stride + head * d + columns, mask=inside, other=0.0).to(tl.float32)
    x_partner = tl.load(qkv_ptr + token * row_stride + head * d + partner, mask=inside, other=0.0).to(tl.float32)
    rotated = tl.where(columns < half, -x_partner, x_partner)
    cos = tl.load(cos_ptr + token * d + columns, mask=inside, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + token * d + columns, mask=inside, other=0.0).to(tl.float32)
    out = _rounded(_rounded(x * cos, qkv_ptr, BF16) + _rounded(rotated * sin, qkv_ptr, BF16), q_ptr, OUT_BF16)
    if head < heads:
        tl.store(q_ptr + (token * heads + head) * d + columns, out.to(q_ptr.dtype.element_ty), mask=inside)
    else:
        tl.store(k_ptr + (token * kv_heads + head - heads) * d + columns, out.to(k_ptr.dtype.element_ty),
                 mask=inside)


def _warps(block: int) -> int:
    """A warp a 1,024 elements of the row, 4 to 16: a 14,336-wide MLP row stays out of local memory."""
    return min(16, max(4, block // 1024))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """LlamaRMSNorm's forward for x [..., n] and a weight [n] of x's dtype, in one kernel, written as x's dtype or
    `out_dtype` (kernels.py's interface: the store rounds to it)."""
    x = x.contiguous()
    out = torch.empty_like(x, dtype=out_dtype or x.dtype)
    width = x.shape[-1]
    rows = x.numel() // width if width else 0
    if rows:
        block = triton.next_power_of_2(width)
        _rms_norm_kernel[(rows,)](x, weight, out, width, eps, BLOCK=block, BF16=x.dtype == torch.bfloat16,
                                  OUT_BF16=out.dtype == torch.bfloat16, num_warps=_warps(block))
    return out


def silu_and_mul(x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [..., 2n], each row [gate | up] -> silu(gate) * up [..., n] in x's dtype or `out_dtype`, in one kernel."""
    x = x.contiguous()
    width = x.shape[-1] // 2
    out = x.new_empty((*x.shape[:-1], width), dtype=out_dtype or x.dtype)
    rows = out.numel() // width if width else 0
    if rows:
        block = triton.next_power_of_2(width)
        _silu_and_mul_kernel[(rows,)](x, out, width, BLOCK=block, BF16=x.dtype == torch.bfloat16,
                                      OUT_BF16=out.dtype == torch.bfloat16, num_warps=_warps(block))
    return out


def rotary(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
           out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """apply_rotary_pos_emb for the q and k heads of fused q/k/v rows qkv [tokens, (heads + 2 kv_heads) d],
    with cos and sin [tokens, d]: q [tokens, heads, d] and k [tokens, kv_heads, d] in one kernel, in qkv's dtype
    or `out_dtype`."""
    tokens, d = qkv.shape[0], qkv.shape[1] // (heads + 2 * kv_heads)
    dtype = out_dtype or qkv.dtype
    q, k = qkv.new_empty(tokens, heads, d, dtype=dtype), qkv.new_empty(tokens, kv_heads, d, dtype=dtype)
    if tokens:
        # No fused multiply-add: transformers rounds each product before the sum.
        _rotary_kernel[(tokens, heads + kv_heads)](qkv, cos.contiguous(), sin.contiguous(), q, k, qkv.stride(0),
                                                   heads, kv_heads, d, BLOCK=triton.next_power_of_2(d),
                                                   BF16=qkv.dtype == torch.bfloat16, OUT_BF16=dtype == torch.bfloat16,
                                                   enable_fp_fusion=False)
    return q, k
