"""A decoder layer's small ops in one pass each, swapped in for transformers' modules in eager
forwards (a compiled forward fuses them itself): csrc/layer_ops.cpp's on the CPU (worker/engine/
kernels.py), one Triton kernel each on a GPU (triton_layer_ops.py); `ops` names which.

transformers' RMSNorm is eight torch ops (a float copy, pow, mean, add, rsqrt, mul, a copy back,
the weight's mul) and its gated MLP's activation two (silu, mul), each a dispatch, an allocation and
a pass over the activations (on a GPU a kernel launch), in bf16 each converting to float and back.
Ours do each in one pass, with the modules' own roundings (tests/engine/test_layer_ops.py holds
them to them).
Their attention modules' rotary embedding (apply_rotary_pos_emb) is seven ops for q and seven for k
(two products, a negation, two slices, a concatenation and a sum each), on strided views of the q/k/v
GEMM's output: ours rotates both in one pass over that output (float32 at 512 tokens on a 2-core AMX
Xeon: 1.4 ms a layer against 95 us).
Swapped in: the RMSNorms of the families the engine serves (Llama, Mistral, Qwen2), their MLPs whose
act_fn is SiLU once fuse_projections has made gate and up one GEMM, and their attention modules once it
has made q, k and v one GEMM, for models on the engine's paged attention.
"""

from __future__ import annotations

import sys
from types import ModuleType

import torch
from torch import nn
from transformers.activations import SiLUActivation
from transformers.cache_utils import Cache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm
from transformers.models.mistral.modeling_mistral import MistralAttention, MistralMLP, MistralRMSNorm
from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention, Qwen2MLP, Qwen2RMSNorm

from worker.engine.attention import ATTN_IMPLEMENTATION
from worker.engine.linear import FusedProjections, ProjectionSlice

NORMS = (LlamaRMSNorm, MistralRMSNorm, Qwen2RMSNorm)  # weight * T(x * rsqrt(mean(x^2) + eps)), each
GATED_MLPS = (LlamaMLP, MistralMLP, Qwen2MLP)  # down_proj(act_fn(gate_proj(x)) * up_proj(x)), each
# Each family's attention module -> its sliding window, read where the module's forward reads it.
ATTENTIONS = {
    LlamaAttention: lambda attention: None,
    MistralAttention: lambda attention: getattr(attention.config, "sliding_window", None),
    Qwen2Attention: lambda attention: attention.sliding_window,
}


class NativeRMSNorm(nn.Module):
    def __init__(self, norm: nn.Module, ops: ModuleType, gemm_inputs: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = norm.weight
        self.variance_epsilon = norm.variance_epsilon
        self.ops = ops
        self.gemm_inputs = gemm_inputs  # its output is only ever a GEMM's input

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(hidden_states, self.weight, self.variance_epsilon, self.gemm_inputs)


class NativeGatedMLP(nn.Module):
    """down_proj(silu(gate) * up) from the fused gate/up GEMM's output as it lies, [gate | up] per row."""

    def __init__(self, gate_up: FusedProjections, down_proj: nn.Module, ops: ModuleType,
                 gemm_inputs: torch.dtype | None = None) -> None:
        super().__init__()
        self.gate_up = gate_up
        self.down_proj = down_proj
        self.ops = ops
        self.gemm_inputs = gemm_inputs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up.fused(x), self.gemm_inputs))


class NativeAttention(nn.Module):
    """The attention module's forward (q/k/v, rotary embedding, a transformers Cache if given, the
    model's attention function, o_proj) from the fused q/k/v GEMM's output as it lies, [q heads | k heads
    | v heads] per row, q and k rotated in one pass. Swapped in where the model runs on the engine's
    paged attention; a caller that switches the model to another attention or passes a Cache (as
    ops/bench_gpu.py's check against HF generate does) gets what transformers' forward gives."""

    def __init__(self, attention: nn.Module, qkv: FusedProjections, ops: ModuleType,
                 gemm_inputs: torch.dtype | None = None) -> None:
        super().__init__()
        self.fused_q_k_v = qkv  # fuse_projections' name for it: the model's module paths stay as they were
        self.o_proj = attention.o_proj
        self.config = attention.config
        self.layer_idx = attention.layer_idx
        self.is_causal = attention.is_causal
        self.scaling = attention.scaling
        self.head_dim = attention.head_dim
        self.sliding_window = ATTENTIONS[type(attention)](attention)
        self.eager_attention = sys.modules[type(attention).__module__].eager_attention_forward  # the family's own
        # this rank's heads, when tensor parallelism split them (sharding.py)
        self.num_heads, self.num_kv_heads = qkv.sizes[0] // self.head_dim, qkv.sizes[1] // self.head_dim
        self.num_key_value_groups = self.num_heads // self.num_kv_heads  # read by transformers' attention functions
        self.ops = ops
        self.gemm_inputs = gemm_inputs  # q and k, as the paged attention reads them (its cache's type)

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor],
                attention_mask: torch.Tensor | None = None, cache: Cache | None = None,
                **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
        lead = hidden_states.shape[:-1]
        qkv = self.fused_q_k_v.fused(hidden_states)
        qkv = qkv.view(-1, qkv.shape[-1])
        cos, sin = (part.reshape(-1, self.head_dim) for part in position_embeddings)
        q, k = self.ops.rotary(qkv, cos, sin, self.num_heads, self.num_kv_heads, self.gemm_inputs)
        v = qkv[:, (self.num_heads + self.num_kv_heads) * self.head_dim:]
        if self.gemm_inputs is not None:  # as q and k (an attention function takes all three in one dtype)
            v = v.to(self.gemm_inputs)
        # [batch, heads, T, d] views, as transformers' forward hands them over
        query, key, value = (x.reshape(*lead, -1, self.head_dim).transpose(1, 2) for x in (q, k, v))
        if cache is not None:
            key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)
        attention_function = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation,
                                                                   self.eager_attention)
        out, weights = attention_function(self, query, key, value, attention_mask, dropout=0.0,
                                          scaling=self.scaling, sliding_window=self.sliding_window, **kwargs)
        return self.o_proj(out.reshape(*lead, -1).contiguous()), weights


def _fused(module: nn.Module, names: tuple[str, ...]) -> FusedProjections | None:
    """The one GEMM that gives the module's projections `names` side by side, in that order, if
    fuse_projections made it so."""
    slices = [getattr(module, name, None) for name in names]
    if not all(isinstance(part, ProjectionSlice) for part in slices):
        return None
    group = slices[0].group
    if any(part.group is not group for part in slices) or len(group.sizes) != len(names):
        return None
    return group if [part.index for part in slices] == list(range(len(names))) else None


def use_native_layer_ops(model: nn.Module, ops: ModuleType, gemm_inputs: torch.dtype | None = None) -> int:
    """Swap our modules in, their kernels `ops`' rms_norm, silu_and_mul and rotary (kernels.py's must
    have built); returns how many were swapped. `gemm_inputs`: the dtype the model's GEMMs and attention
    round their inputs to, where its activations are float32 (a bf16 model on the CPU, linear.py): the
    norms, the activation and rotary then write it outright, which are only ever those inputs (the same
    values, rounded once, with half the bytes to write and no pass of the GEMM's own to round them)."""
    targets = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if type(child) in NORMS and child.weight.dtype in (torch.float32, torch.bfloat16):
                targets.append((parent, name, NativeRMSNorm(child, ops, gemm_inputs)))
            elif type(child) in GATED_MLPS and isinstance(child.act_fn, SiLUActivation):
                gate_up = _fused(child, ("gate_proj", "up_proj"))
                if gate_up is not None:
                    targets.append((parent, name, NativeGatedMLP(gate_up, child.down_proj, ops, gemm_inputs)))
            elif type(child) in ATTENTIONS and child.config._attn_implementation == ATTN_IMPLEMENTATION:
                qkv = _fused(child, ("q_proj", "k_proj", "v_proj"))
                if qkv is not None:
                    targets.append((parent, name, NativeAttention(child, qkv, ops, gemm_inputs)))
    for parent, name, module in targets:
        setattr(parent, name, module)
    return len(targets)
