"""A decoder layer's small ops in one pass each, swapped in for transformers' modules in eager
forwards (a compiled forward fuses them itself): csrc/layer_ops.cpp's on the CPU (worker/engine/
kernels.py), one Triton kernel each on a GPU (triton_layer_ops.py); `ops` names which.

transformers' RMSNorm is eight torch ops (a float copy, pow, mean, add, rsqrt, mul, a copy back,
the weight's mul) and its gated MLP's activation two (silu, mul), each a dispatch, an allocation and
a pass over the activations (on a GPU a kernel launch), in bf16 each converting to float and back.
Ours do each in one pass, with the modules' own roundings (tests/engine/test_layer_ops.py holds
them to them).
Swapped in: the RMSNorms of the families the engine serves (Llama, Mistral, Qwen2), and their MLPs
whose act_fn is SiLU, once fuse_projections has made gate and up one GEMM.
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch import nn
from transformers.activations import SiLUActivation
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm
from transformers.models.mistral.modeling_mistral import MistralMLP, MistralRMSNorm
from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP, Qwen2RMSNorm

from worker.engine.linear import FusedProjections, ProjectionSlice

NORMS = (LlamaRMSNorm, MistralRMSNorm, Qwen2RMSNorm)  # weight * T(x * rsqrt(mean(x^2) + eps)), each
GATED_MLPS = (LlamaMLP, MistralMLP, Qwen2MLP)  # down_proj(act_fn(gate_proj(x)) * up_proj(x)), each


class NativeRMSNorm(nn.Module):
    def __init__(self, norm: nn.Module, ops: ModuleType) -> None:
        super().__init__()
        self.weight = norm.weight
        self.variance_epsilon = norm.variance_epsilon
        self.ops = ops

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(hidden_states, self.weight, self.variance_epsilon)


class NativeGatedMLP(nn.Module):
    """down_proj(silu(gate) * up) from the fused gate/up GEMM's output as it lies, [gate | up] per row."""

    def __init__(self, gate_up: FusedProjections, down_proj: nn.Module, ops: ModuleType) -> None:
        super().__init__()
        self.gate_up = gate_up
        self.down_proj = down_proj
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up.fused(x)))


def _fused_gate_up(mlp: nn.Module) -> FusedProjections | None:
    """The one GEMM that gives the MLP's [gate | up], if fuse_projections made it so."""
    gate, up = getattr(mlp, "gate_proj", None), getattr(mlp, "up_proj", None)
    if not (isinstance(gate, ProjectionSlice) and isinstance(up, ProjectionSlice) and gate.group is up.group):
        return None
    group = gate.group
    return group if (gate.index, up.index) == (0, 1) and len(group.sizes) == 2 else None


def use_native_layer_ops(model: nn.Module, ops: ModuleType) -> int:
    """Swap our modules in, their kernels `ops`' rms_norm and silu_and_mul (kernels.py's must have
    built); returns how many were swapped."""
    targets = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if type(child) in NORMS and child.weight.dtype in (torch.float32, torch.bfloat16):
                targets.append((parent, name, NativeRMSNorm(child, ops)))
            elif type(child) in GATED_MLPS and isinstance(child.act_fn, SiLUActivation):
                gate_up = _fused_gate_up(child)
                if gate_up is not None:
                    targets.append((parent, name, NativeGatedMLP(gate_up, child.down_proj, ops)))
    for parent, name, module in targets:
        setattr(parent, name, module)
    return len(targets)
