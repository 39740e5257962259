"""Native CPU kernels, compiled on first use with torch's C++ extension builder.

`paged_decode` reads decode attention straight from the paged cache (csrc/paged_decode.cpp),
`write_kv` puts new keys and values into it (csrc/write_kv.cpp);
`pack_linear_weight` / `packed_linear` are a float32 GEMM for pre-packed weights (csrc/linear.cpp),
the latter also the operator torch.ops.streambatch.packed_linear (with a shape function, so that
torch.compile traces through it).
The build (about a minute, once per machine; cached by torch under
~/.cache/torch_extensions) needs a C++ compiler and ninja. When it cannot be built, callers
fall back to torch: the gather + SDPA decode path and oneDNN's packed linear; slower, same results.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)
SOURCES = [str(Path(__file__).with_name("csrc") / name) for name in ("bindings.cpp", "paged_decode.cpp", "write_kv.cpp", "linear.cpp")]


@functools.cache
def native():
    """The compiled module, or None (disabled with STREAMBATCH_NATIVE_KERNELS=0, or the build failed)."""
    if os.environ.get("STREAMBATCH_NATIVE_KERNELS", "1") == "0":
        return None
    try:
        from torch.utils.cpp_extension import load

        # ATen's Vectorized<float> picks its instruction set from these defines, as in torch's own build.
        capability = torch.backends.cpu.get_cpu_capability()
        if capability not in ("AVX2", "AVX512"):
            capability = "DEFAULT"
        defines = [f"-DCPU_CAPABILITY={capability}"]
        if capability != "DEFAULT":
            defines.append(f"-DCPU_CAPABILITY_{capability}")
        module = load(name=f"streambatch_kernels_{capability.lower()}", sources=SOURCES,
                      extra_cflags=["-O3", "-march=native", "-fopenmp", *defines], extra_ldflags=["-fopenmp"])
        torch.library.register_fake("streambatch::packed_linear", _packed_linear_shape)
        return module
    except Exception as error:  # no compiler, no ninja, no headers: the torch path still works
        log.warning("native kernels unavailable, using the torch paths: %s", error)
        return None


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float, sliding_window: int | None) -> torch.Tensor:
    """q [seqs, heads, dim] -> attention output [seqs, heads, dim], one token per sequence."""
    return native().paged_decode(q.contiguous(), k_cache, v_cache, block_tables, seq_lens, scale,
                                 sliding_window or 0)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, key: torch.Tensor,
             value: torch.Tensor) -> None:
    """key/value [T, kv_heads, dim] of T new tokens into their flat cache slots [T]."""
    native().write_kv(k_cache, v_cache, slots, key, value)


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """A float32 or bfloat16 weight [out, in] -> the panels `packed_linear` reads."""
    return native().pack_linear_weight(weight.contiguous())


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """x [..., in] -> x @ weight.T + bias [..., out] in x's dtype, computed in float32; the weight
    packed by pack_linear_weight, the bias float32."""
    return torch.ops.streambatch.packed_linear(x, packed, bias, out_features)


def _packed_linear_shape(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                         out_features: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features)
