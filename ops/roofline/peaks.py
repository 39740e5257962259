"""This machine's ceilings, measured: the GEMM rate at the model's own linear shapes, per dtype, and the
memory bandwidth.

A GEMM's rate depends on its shape (a 576-wide layer is not a square 4096 probe) and on the GEMM: each
shape runs for chunks of rows (the tokens of a step, 64-2,048) through torch's F.linear (MKL or oneDNN)
and the engine's PackedLinear (worker/engine/linear.py: our kernel for float32, and for bf16 unless the CPU
has AMX, where oneDNN serves it), best of a few calls; a dtype's peak is the best rate of them all. Bandwidth:
the better of a pure read (a sum) and a copy, over 256 MiB, far past any cache.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from worker.engine.linear import PackedLinear, cpu_computes_bf16, packing_backend, packing_works

CHUNKS, QUICK_CHUNKS = (64, 256, 1024, 2048), (64, 512)  # rows (tokens) per GEMM
REPEATS, QUICK_REPEATS = 5, 2  # timed calls per measurement, after one to warm up
BANDWIDTH_BYTES = 256 * 2**20


@dataclass(frozen=True)
class GemmRate:
    dtype: str
    shape: str  # the model's name for it: q_k_v, o_proj, gate_up, down_proj, lm_head
    in_features: int
    out_features: int
    rows: int
    gemm: str  # F.linear, or PackedLinear (its backend)
    gflops: float


@dataclass(frozen=True)
class Peaks:
    gemms: list[GemmRate]  # every (dtype, shape, rows, GEMM) measured
    read_gbps: float
    copy_gbps: float  # bytes read and written

    @property
    def bandwidth_gbps(self) -> float:
        return max(self.read_gbps, self.copy_gbps)

    @property
    def dtypes(self) -> list[str]:
        return list(dict.fromkeys(rate.dtype for rate in self.gemms))

    def best(self, dtype: str) -> GemmRate:
        """The dtype's GEMM peak: its best rate at any shape, chunk and GEMM."""
        return max((rate for rate in self.gemms if rate.dtype == dtype), key=lambda rate: rate.gflops)

    def gemm_gflops(self, dtype: str) -> float:
        return self.best(dtype).gflops

    def as_json(self) -> dict:
        return {"gemm_peak_gflops": {dtype: asdict(self.best(dtype)) for dtype in self.dtypes},
                "read_gbps": self.read_gbps, "copy_gbps": self.copy_gbps, "bandwidth_gbps": self.bandwidth_gbps,
                "gemms": [asdict(rate) for rate in self.gemms]}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtypes_to_measure(run_dtype: torch.dtype) -> list[torch.dtype]:
    """float32, bfloat16 where the CPU computes it natively (avx512_bf16 / AMX), and the run's own."""
    dtypes = [torch.float32] + ([torch.bfloat16] if cpu_computes_bf16() else [])
    return list(dict.fromkeys(dtypes + [run_dtype]))


def linear_shapes(model: nn.Module) -> dict[str, tuple[int, int]]:
    """The model's distinct GEMMs as the engine runs them (fused, packed): name -> (in, out features),
    named after their first occurrence (model.layers.0.self_attn.fused_q_k_v.fused -> q_k_v)."""
    shapes: dict[str, tuple[int, int]] = {}
    for path, module in model.named_modules():
        if type(module) not in (nn.Linear, PackedLinear):
            continue
        shape = (module.in_features, module.out_features)
        if shape not in shapes.values():
            name = path.removesuffix(".fused").rsplit(".", 1)[-1].removeprefix("fused_")
            shapes[name if name not in shapes else path] = shape
    return shapes


def best_seconds(call, repeats: int) -> float:
    call()  # first use: packing caches, page faults
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - started)
    return best


@torch.inference_mode()
def gemm_rates(shapes: dict[str, tuple[int, int]], dtype: torch.dtype, chunks=CHUNKS,
               repeats: int = REPEATS) -> list[GemmRate]:
    rates = []
    name = dtype_name(dtype)
    for shape, (in_features, out_features) in shapes.items():
        layer = nn.Linear(in_features, out_features, bias=False, dtype=dtype)
        gemms = {"F.linear": lambda x: F.linear(x, layer.weight)}
        if packing_works(dtype):
            gemms[f"PackedLinear ({packing_backend(dtype)})"] = PackedLinear(layer)
        for rows in chunks:
            x = torch.randn(rows, in_features, dtype=dtype)
            for gemm, run in gemms.items():
                seconds = best_seconds(lambda: run(x), repeats)
                rates.append(GemmRate(name, shape, in_features, out_features, rows, gemm,
                                      2 * rows * in_features * out_features / seconds / 1e9))
    return rates


@torch.inference_mode()
def bandwidth(repeats: int = REPEATS) -> tuple[float, float]:
    """(read, copy) GB/s over BANDWIDTH_BYTES of float32."""
    source = torch.empty(BANDWIDTH_BYTES // 4).uniform_()
    target = torch.empty_like(source)
    read = BANDWIDTH_BYTES / best_seconds(source.sum, repeats)
    copy = 2 * BANDWIDTH_BYTES / best_seconds(lambda: target.copy_(source), repeats)
    return read / 1e9, copy / 1e9


def recheck(peaks: Peaks, dtype: torch.dtype, quick: bool = False) -> tuple[float, float]:
    """(the dtype's peak GEMM, at its shape, rows and GEMM, and the bandwidth) measured again: with the
    peaks measured before the run, how far this machine's speed moved while it ran."""
    best = peaks.best(dtype_name(dtype))
    repeats = QUICK_REPEATS if quick else REPEATS
    again = [rate for rate in gemm_rates({best.shape: (best.in_features, best.out_features)}, dtype, (best.rows,),
                                         repeats) if rate.gemm == best.gemm]
    return again[0].gflops, max(bandwidth(repeats))


def measure(shapes: dict[str, tuple[int, int]], dtypes: list[torch.dtype], quick: bool = False) -> Peaks:
    chunks, repeats = (QUICK_CHUNKS, QUICK_REPEATS) if quick else (CHUNKS, REPEATS)
    gemms = [rate for dtype in dtypes for rate in gemm_rates(shapes, dtype, chunks, repeats)]
    return Peaks(gemms, *bandwidth(repeats))
