"""The model split across tensor-parallel ranks, in place after loading, the Megatron way (as vLLM
and nano-vllm split it): each rank keeps 1/N of every attention's heads and of every MLP's
intermediate width, so a layer exchanges one all-reduce after its attention and one after its MLP.

- q/k/v and gate/up are column-parallel: a rank keeps its rows of their weights (and biases), that
  is whole heads, query heads with the KV head they share (GQA needs no exchange), and its slice of
  the MLP's intermediate activations. Its attention runs on its heads against its KV heads: paged
  attention reads the head counts off the tensors it is given, and the KV cache holds this rank's.
- o_proj and down_proj are row-parallel: a rank keeps the matching columns, so its product is one
  term of the full one; an all-reduce sums the terms (RowParallelLinear), the bias added once.
- Embeddings and norms are replicated: a lookup and elementwise work, nothing worth an exchange.
- lm_head is rank 0's alone, whole: rank 0 computes the logits and samples, with no gather; the
  other ranks' is NoLogits, so they spend nothing on logits nobody reads.
The shards stay plain nn.Linear, so the runner's fusing (q/k/v, gate/up) and packing apply to them
unchanged. transformers' own tensor parallelism (tp_plan) is not used: it loads through
from_pretrained only (not our random models) and splits into DTensors, which neither our packed
CPU GEMM nor the fused projections take.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")  # column-parallel but the last, row-parallel
MLP = ("gate_proj", "up_proj", "down_proj")


class RowParallelLinear(nn.Module):
    """A row-parallel projection: this rank's term of the product, summed over the ranks."""

    def __init__(self, linear: nn.Linear) -> None:
        """`linear`: this rank's columns of the weight; its bias is added after the sum, once."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = linear.bias
        linear.bias = None
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x)
        dist.all_reduce(out)
        return out if self.bias is None else out + self.bias


class NoLogits(nn.Module):
    """The lm_head of a rank past 0: logits of no columns, for the rows asked."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states.new_empty(*hidden_states.shape[:-1], 0)


def check_divisible(config, ranks: int) -> None:
    """Raises ValueError unless every split of shard_model falls on whole heads and columns."""
    sizes = {"attention heads": config.num_attention_heads, "KV heads": config.num_key_value_heads,
             "intermediate size": config.intermediate_size}
    uneven = [f"{size} {name}" for name, size in sizes.items() if size % ranks]
    if uneven:
        raise ValueError(f"tensor_parallel={ranks} must divide the model's {', '.join(uneven)} "
                         f"(it has {', '.join(f'{size} {name}' for name, size in sizes.items())})")


def shard_model(model: nn.Module, rank: int, ranks: int) -> None:
    """Keep this rank's part of `model` (see the module docstring); raises ValueError for a model
    whose heads do not divide by `ranks`, or whose layers are not q/k/v/o_proj and gate/up/down_proj."""
    check_divisible(model.config, ranks)
    blocks = {ATTENTION: 0, MLP: 0}
    for module in list(model.modules()):
        for names in blocks:
            linears = [getattr(module, name, None) for name in names]
            if not all(isinstance(linear, nn.Linear) for linear in linears):
                continue
            *columns, row = linears
            for linear in columns:
                _keep_part(linear, 0, rank, ranks)
            _keep_part(row, 1, rank, ranks)
            setattr(module, names[-1], RowParallelLinear(row))
            blocks[names] += 1
    layers = model.config.num_hidden_layers
    if set(blocks.values()) != {layers}:
        raise ValueError(f"{type(model).__name__} cannot be split: {blocks[ATTENTION]} attention blocks of "
                         f"{'/'.join(ATTENTION)} and {blocks[MLP]} MLP blocks of {'/'.join(MLP)} for {layers} layers")
    if rank > 0:
        model.set_output_embeddings(NoLogits())


def _keep_part(linear: nn.Linear, dim: int, rank: int, ranks: int) -> None:
    """Keep the rank's 1/ranks of the weight along `dim` (0: output rows, with the bias; 1: input
    columns). Copied, so that the whole weight is freed."""
    size = linear.weight.shape[dim] // ranks
    linear.weight = nn.Parameter(linear.weight.narrow(dim, rank * size, size).clone(), requires_grad=False)
    if dim == 0:
        linear.out_features = size
        if linear.bias is not None:
            linear.bias = nn.Parameter(linear.bias.narrow(0, rank * size, size).clone(), requires_grad=False)
    else:
        linear.in_features = size
