"""The model's linear layers, made faster without touching its code: sibling projections of
one input fused into one GEMM, and on CPU weights pre-packed for a faster GEMM (packing_backend):
our kernel (csrc/linear.cpp) for float32 and bf16 (bf16 by bf16 on AMX tiles or with avx512_bf16's
vdpbf16ps, else bf16 weights in float32 arithmetic), oneDNN's where our kernels did not build.

Fusing: q/k/v and gate/up read the same input, so one GEMM with their weights stacked reads
that input once and gives the GEMM a wider, more efficient shape; each original module is
replaced by a slice of the fused output. Measured here for 16-32 decode rows over SmolLM2's 30
layers with cold weights: 30.3 -> 26.4 ms and 47.6 -> 43.6 ms per step.
Packing: MKL's sgemm, which nn.Linear uses on CPU, is slow for the few-row matrices of
decode steps; oneDNN with a pre-packed weight runs SmolLM2's MLP projections 1.3-1.6x and
its 49k-row lm_head 2.4x faster, and is on par for prefill-sized inputs. Our float32 kernel
runs SmolLM2's 30 layers (AVX2, 2 threads, best of 5) in 32-34 / 57 / 98 ms for 16 / 32 / 64
rows where oneDNN takes 50-59 / 72 / 125, and on par from 128 rows up.

A bf16 model on the CPU keeps its activations in float32 (keep_activations_in_float32): only its
linear layers' weights and the KV cache are bf16. Our GEMM rounds each input to bf16 and gives its
float32 sums as they are, so the residual stream, the norms, rotary, softmax and the logits never
round to bf16: that rounding, not the weights', is what made bf16's greedy tokens part from float32's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker.engine import huge_pages, kernels

# Sibling projections that transformers' decoder models apply to the same input.
FUSABLE_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def cpu_computes_bf16() -> bool:
    """The CPU has bf16 instructions (avx512_bf16 or AMX), as oneDNN sees it."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def packing_backend(dtype: torch.dtype) -> str | None:
    """Which pre-packed GEMM serves CPU linear layers of this dtype: "native" (ours), "onednn", or None.
    bf16 goes to oneDNN only where ours did not build and the CPU has AMX. Ours runs bf16 on AMX tiles too
    and gives float32 sums, where oneDNN's bf16 GEMM rounds its output to bf16 (keep_activations_in_float32
    needs them). On a 2-core AMX Xeon, SmolLM2's 30 layers with cold weights: ours 0.93-1.1x oneDNN's speed
    for 1-64 rows, 0.81-0.85x for 128-512 (both 4-5x our float32 there); at 2,048 hot rows 0.55-0.7x. With
    avx512_bf16 alone oneDNN's bf16 GEMM peaked at 150 GFLOP/s against float32's 269, and ours ran SmolLM2's
    layers 1.0-1.6x faster than it for 1-256 rows even in float32 arithmetic."""
    if dtype in (torch.float32, torch.bfloat16) and kernels.native() is not None:
        return "native"
    amx_bf16 = cpu_computes_bf16() and getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
    if dtype == torch.float32 and torch.backends.mkldnn.is_available() or dtype == torch.bfloat16 and amx_bf16:
        return "onednn"
    return None


class PackedLinear(nn.Module):
    """nn.Linear with its weight packed once for the GEMM packing_backend picks for its dtype. Ours gives its
    float32 sums as they are, whatever the input's dtype; oneDNN's gives the input's dtype."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach()
        bias = None if linear.bias is None else linear.bias.detach()
        self.native = packing_backend(weight.dtype) == "native"
        pairs = self.native and weight.dtype == torch.bfloat16 and kernels.bf16_dot_products()
        self.packed_weight = (kernels.pack_linear_weight(weight, pairs) if self.native
                              else torch.ops.mkldnn._reorder_linear_weight(weight))
        self.bias = bias.float() if self.native and bias is not None else bias  # ours adds in float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native:
            return kernels.packed_linear(x, self.packed_weight, self.bias, self.out_features)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


class FusedProjections(nn.Module):
    """Several projections of the same input computed by one GEMM. The output of the latest
    input is kept until every projection has taken its slice; any other call recomputes, so
    each slice always equals its original projection of the input it is given."""

    def __init__(self, linears: list[nn.Linear]) -> None:
        super().__init__()
        first = linears[0]
        self.sizes = [linear.out_features for linear in linears]
        has_bias = any(linear.bias is not None for linear in linears)
        self.fused = nn.Linear(first.in_features, sum(self.sizes), bias=has_bias,
                               device=first.weight.device, dtype=first.weight.dtype)
        with torch.no_grad():
            self.fused.weight.copy_(torch.cat([linear.weight for linear in linears]))
            if has_bias:
                self.fused.bias.copy_(torch.cat([linear.bias if linear.bias is not None
                                                 else linear.weight.new_zeros(linear.out_features)
                                                 for linear in linears]))
        self.kept = _KeptOutput()

    def project(self, index: int, x: torch.Tensor) -> torch.Tensor:
        kept = self.kept
        if x is not kept.input or kept.left == 0:
            kept.input, kept.outputs, kept.left = x, self.fused(x).split(self.sizes, dim=-1), len(self.sizes)
        out = kept.outputs[index]
        kept.left -= 1
        if kept.left == 0:
            kept.input, kept.outputs = None, ()  # do not hold the step's activations
        return out


class _KeptOutput:
    """A plain object: nn.Module's __setattr__ costs microseconds per call on this hot path."""

    __slots__ = ("input", "outputs", "left")

    def __init__(self) -> None:
        self.input: torch.Tensor | None = None
        self.outputs: tuple[torch.Tensor, ...] = ()
        self.left = 0  # slices of the kept output not taken yet


class ProjectionSlice(nn.Module):
    """Stands in for one fused projection: its slice of the shared output."""

    def __init__(self, group: FusedProjections, index: int, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.index = index
        object.__setattr__(self, "group", group)  # owned by the parent module, not by each slice

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.project(self.index, x)


def fuse_projections(model: nn.Module) -> int:
    """Fuse every group of FUSABLE_GROUPS found as nn.Linear siblings; returns how many groups."""
    fused = 0
    for parent in list(model.modules()):
        for names in FUSABLE_GROUPS:
            linears = [getattr(parent, name, None) for name in names]
            if not all(type(linear) is nn.Linear for linear in linears):
                continue
            if len({(linear.in_features, linear.weight.dtype, linear.weight.device) for linear in linears}) != 1:
                continue
            group = FusedProjections(linears)
            parent.add_module("fused_" + "_".join(name.removesuffix("_proj") for name in names), group)
            for index, (name, linear) in enumerate(zip(names, linears)):
                setattr(parent, name, ProjectionSlice(group, index, linear))
            fused += 1
    return fused


def packing_works(dtype: torch.dtype) -> bool:
    """A packing backend exists for this dtype, and a packed probe layer agrees with F.linear
    (oneDNN's op is internal to torch: check before use). With AMX, oneDNN's packed 16-row bf16
    GEMMs run 1.2-1.9x faster than unpacked, with identical results."""
    if packing_backend(dtype) is None:
        return False
    try:
        probe = nn.Linear(8, 4, dtype=dtype)
        x = torch.randn(3, 8, dtype=dtype)
        return torch.allclose(PackedLinear(probe)(x).float(), F.linear(x, probe.weight, probe.bias).float(), atol=1e-5,
                              rtol=1e-2)
    except (RuntimeError, AttributeError):
        return False


def pack_linear_layers(model: nn.Module) -> int:
    """Replace every nn.Linear of a CPU model in place (after packing_works); returns how many. Our GEMM's
    packed weights then lie side by side on huge pages: a decode step streams all of them once."""
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if type(child) is nn.Linear]
    packed = [PackedLinear(child) for _, _, child in targets]
    for (parent, name, _), layer in zip(targets, packed):
        setattr(parent, name, layer)
    _onto_huge_pages([layer for layer in packed if layer.native])
    return len(targets)


def _onto_huge_pages(layers: list[PackedLinear]) -> None:
    """Each dtype's packed weights moved into one buffer on huge pages, one by one (each original is freed as
    its copy takes its place). On a Zen 4, SmolLM2's 30 layers so ran 1.07-1.20x faster at 8-64 rows in
    float32 and 1.04-1.20x in bf16 (both copies of the weights alternating in one process). Advised one by one,
    each layer's weight (0.6-3.5 MB) held almost no whole huge page, and the engine ran no faster."""
    for dtype in {layer.packed_weight.dtype for layer in layers}:
        group = [layer for layer in layers if layer.packed_weight.dtype == dtype]
        places = huge_pages.empty_side_by_side([layer.packed_weight.shape for layer in group], dtype)
        for layer, place in zip(group, places):
            layer.packed_weight = place.copy_(layer.packed_weight)


def keep_activations_in_float32(model: nn.Module) -> None:
    """Once pack_linear_layers has packed a bf16 model's linear layers for our GEMM, what is left of it (the
    embeddings, the norms' weights) in float32: every activation then stays float32, and each GEMM rounds
    only its input to bf16. The packed weights are not the model's parameters, and stay as they are."""
    nn.Module.float(model)  # transformers' own .float() refuses a model loaded from GGUF
