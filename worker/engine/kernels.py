"""Native CPU kernels, built once per machine (extension.py).

`paged_decode` reads decode attention straight from the paged cache (csrc/paged_decode.cpp), and
`prefill_attention` a prompt chunk's, causal, tile by tile (csrc/prefill_attention.cpp);
`write_kv` puts new keys and values into it (csrc/write_kv.cpp);
`pack_linear_weight` / `packed_linear` are a GEMM for pre-packed weights, float32 sums (csrc/linear.cpp),
the latter also the operator torch.ops.streambatch.packed_linear (with a shape function, so that
torch.compile traces through it); `rms_norm` and `silu_and_mul` are a decoder layer's small ops in
one pass each (csrc/layer_ops.cpp, for eager forwards: layer_ops.py); `argmax_rows` is greedy sampling's
argmax of each row (csrc/argmax.cpp).

The build needs a C++ compiler and ninja and takes about two minutes on 2 cores: `make setup`
runs it (`python -m worker.prepare`), and an engine that finds no build makes one before it
serves, reporting the phase. When the kernels cannot be had (no compiler, a failed build, another
process's build that outlasted the wait, or STREAMBATCH_NATIVE_KERNELS=0), callers use the torch
paths after one warning: the gather + SDPA decode path and oneDNN's packed linear; slower, same results.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from types import ModuleType

import torch

from worker.engine.disk_cache import Phase, quiet
from worker.engine.extension import Extension

log = logging.getLogger(__name__)
_UNSET = object()
_native: ModuleType | None | object = _UNSET


def kernels_extension() -> Extension:
    """ATen's Vectorized<float> picks its instruction set from the CPU_CAPABILITY defines, as in torch's own build."""
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        capability = "DEFAULT"
    defines = [f"-DCPU_CAPABILITY={capability}"]
    if capability != "DEFAULT":
        defines.append(f"-DCPU_CAPABILITY_{capability}")
    csrc = Path(__file__).with_name("csrc")
    sources = ("bindings.cpp", "paged_decode.cpp", "prefill_attention.cpp", "write_kv.cpp", "linear.cpp",
               "layer_ops.cpp", "argmax.cpp")
    return Extension(f"streambatch_kernels_{capability.lower()}", tuple(csrc / name for name in sources),
                     headers=(csrc / "attention_tiles.h", csrc / "amx_tiles.h"),
                     cflags=("-O3", "-march=native", "-fopenmp", *defines), ldflags=("-fopenmp",))


def native(on_phase: Phase = quiet) -> ModuleType | None:
    """The compiled module (built first if this machine has no build of these sources), or None:
    disabled with STREAMBATCH_NATIVE_KERNELS=0, or not to be had (logged once)."""
    global _native
    if _native is _UNSET:
        _native = None
        if os.environ.get("STREAMBATCH_NATIVE_KERNELS", "1") != "0":
            try:
                _native = kernels_extension().load(on_phase)
                torch.library.register_fake("streambatch::packed_linear", _packed_linear_shape)
            except Exception as error:  # no compiler, a failed build, a build that outlasted our wait
                log.warning("native kernels unavailable, using the torch paths (slower, same results): %s", error)
    return _native


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, sliding_window: int | None) -> torch.Tensor:
    """q [seqs, heads, dim] -> attention output [seqs, heads, dim], one token per sequence."""
    return native().paged_decode(q.contiguous(), k_cache, v_cache, block_tables, seq_lens, scale,
                                 sliding_window or 0)


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, blocks: torch.Tensor,
                      num_computed: int, scale: float, sliding_window: int | None, out: torch.Tensor) -> None:
    """q [T, heads, dim]: a sequence's T new tokens at positions num_computed .. num_computed + T - 1,
    whose keys and values are in the cache -> their attention output, written into `out` [T, heads,
    dim] (contiguous); blocks: the sequence's block table (int64)."""
    native().prefill_attention(q.contiguous(), k_cache, v_cache, blocks, num_computed, scale, sliding_window or 0,
                               out)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, key: torch.Tensor,
             value: torch.Tensor) -> None:
    """key/value [T, kv_heads, dim] of T new tokens into their flat cache slots [T]."""
    native().write_kv(k_cache, v_cache, slots, key, value)


def bf16_dot_products() -> bool:
    """The build multiplies bfloat16 by bfloat16 (avx512_bf16's vdpbf16ps): `pack_linear_weight`'s pairs."""
    return native().bf16_dot_products()


def pack_linear_weight(weight: torch.Tensor, pairs: bool = False) -> torch.Tensor:
    """A float32 or bfloat16 weight [out, in] -> the panels `packed_linear` reads; `pairs` (bfloat16,
    where bf16_dot_products) packs each column's k two by two, for inputs rounded to bfloat16."""
    return native().pack_linear_weight(weight.contiguous(), pairs)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """x [..., in] -> x @ weight.T + bias [..., out], the float32 sums as they are (of x rounded to bfloat16
    where the weight was packed in pairs); the weight packed by pack_linear_weight, the bias float32."""
    return torch.ops.streambatch.packed_linear(x, packed, bias, out_features)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """LlamaRMSNorm's forward for x [..., n] and a weight [n] of x's dtype, in one pass; written as x's dtype or
    `out_dtype` (bf16, for float32 x: the kernel rounds it as it writes it, csrc/layer_ops.cpp)."""
    return native().rms_norm(x.contiguous(), weight, eps, out_dtype)


def silu_and_mul(x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [..., 2n], each row [gate | up] -> silu(gate) * up [..., n] in x's dtype or `out_dtype` (as rms_norm's),
    in one pass."""
    return native().silu_and_mul(x.contiguous(), out_dtype)


def rotary(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int,
           out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """apply_rotary_pos_emb for the q and k heads of fused q/k/v rows qkv [tokens, (heads + 2 kv_heads) d],
    with cos and sin [tokens, d]: q [tokens, heads, d] and k [tokens, kv_heads, d] in one pass, in qkv's dtype
    or `out_dtype` (as rms_norm's)."""
    return native().rotary(qkv, cos.contiguous(), sin.contiguous(), heads, kv_heads, out_dtype)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x [rows, n] float32 -> int64 [rows]: x.max(dim=1).indices (the first of equals, a row's first NaN if any)."""
    return native().argmax_rows(x.contiguous())


def _packed_linear_shape(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                         out_features: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features, dtype=torch.float32)
