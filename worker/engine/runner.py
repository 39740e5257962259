"""StepPlan -> packed tensors -> one model forward -> logits of the rows that sample.

The runner decides nothing: the plan says which tokens of which sequences to compute.
Every scheduled token of every sequence (prefill chunks and decodes together) goes into
one flattened row; attention finds each sequence's boundaries and KV through the
AttentionMetadata built here from the sequences' block tables.

A plan becomes StepInputs (plain ints) before anything is computed: under tensor parallelism
rank 0 sends those to the other ranks (parallel.py), and every rank computes them alike. Block
tables travel as updates of the runners' persistent tables (block_tables.py): only the blocks each
sequence gained since its row was last written.

On a GPU nothing here makes the host wait for the device: the step's index tensors go over in one
asynchronous copy from pinned memory (host_copy.py), and the sampler's read-back is the step's one sync.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import msgspec
import torch

from worker.engine import kernels
from worker.engine.attention import AttentionMetadata, default_backend, run_model
from worker.engine.block_tables import BlockTables, RowAssigner, TableUpdate
from worker.engine.compiled import compile_forward
from worker.engine.config import AttentionBackend, EngineConfig
from worker.engine.cuda_graphs import DecodeGraphs
from worker.engine.disk_cache import Phase, quiet
from worker.engine.host_copy import values_to_device
from worker.engine.layer_ops import use_native_layer_ops
from worker.engine.linear import (fuse_projections, keep_activations_in_float32, pack_linear_layers,
                                  packing_backend, packing_works)
from worker.engine.models import ModelInfo, allocate_kv_cache
from worker.engine.plan import StepPlan
from worker.engine.sequence import Sequence

if TYPE_CHECKING:
    from worker.engine.parallel import Ranks


class StepInputs(msgspec.Struct, array_like=True, gc=False):
    """What a step computes, per sequence: its new tokens start at position num_computed[i]; its
    blocks are in row rows[i] of the persistent tables, which gain new_blocks[i] from column
    table_starts[i] on."""

    input_ids: list[int]  # every sequence's new tokens, one after the other
    num_computed: list[int]
    num_new: list[int]
    rows: list[int]
    table_starts: list[int]
    new_blocks: list[list[int]]
    sampling: list[int]  # the sequences (indices) whose last new token gets logits

    @classmethod
    def of(cls, plan: StepPlan, rows: RowAssigner) -> StepInputs:
        seqs = list(plan.scheduled)
        num_computed = [seq.num_computed_tokens for seq in seqs]
        input_ids: list[int] = []
        for seq, start, count in zip(seqs, num_computed, plan.scheduled.values()):
            input_ids.extend(seq.token_ids[start:start + count])
        tables = rows.update(seqs)
        return cls(input_ids, num_computed, list(plan.scheduled.values()), tables.rows, tables.starts,
                   tables.new_blocks, [i for i, seq in enumerate(seqs) if plan.samples(seq)])


class ModelRunner:
    def __init__(self, model: torch.nn.Module, info: ModelInfo, num_blocks: int, block_size: int,
                 device: str = "cpu", compile: bool = False, on_phase: Phase = quiet,
                 attention_backend: AttentionBackend | None = None, cuda_graph_max_seqs: int = 0,
                 max_model_len: int | None = None, ranks: Ranks | None = None) -> None:
        """`info`: this rank's (ModelInfo.per_rank) under tensor parallelism; `ranks`: rank 0's
        handle on the other ranks, to which each step goes first."""
        self.model = model
        self.ranks = ranks
        self.block_size = block_size
        self.device = torch.device(device)
        self.attention_backend = attention_backend or default_backend(self.device)
        on_phase(f"allocating the KV cache ({num_blocks} blocks of {block_size} tokens, "
                 f"{num_blocks * info.kv_bytes_per_block(block_size) / 2**30:.2f} GiB)")
        self.kv_caches = allocate_kv_cache(info, num_blocks, block_size, info.dtype, device, self.attention_backend)
        max_blocks = -(-(max_model_len or info.max_model_len) // block_size)
        self.rows = RowAssigner()  # rank 0's; the other ranks get its decisions in StepInputs
        self.tables = BlockTables(max_blocks, self.device)
        on_phase("preparing the model's linear layers")
        fuse_projections(model)
        gemm_inputs = None  # where the activations are wider than what the GEMMs take (layer_ops.py)
        # oneDNN's packed op does not lower into a graph with unbacked sizes: compiled, inductor's GEMM serves.
        if self.device.type == "cpu" and packing_works(info.dtype) and not (
                compile and packing_backend(info.dtype) == "onednn"):
            pack_linear_layers(model)
            if info.dtype == torch.bfloat16 and packing_backend(info.dtype) == "native":
                keep_activations_in_float32(model)
                gemm_inputs = torch.bfloat16
        if self.device.type == "cpu" and not compile and kernels.native() is not None:
            use_native_layer_ops(model, kernels, gemm_inputs)  # compiled, inductor fuses these ops itself
        elif self.device.type == "cuda" and not compile:
            from worker.engine import triton_layer_ops  # only a GPU needs triton here
            use_native_layer_ops(model, triton_layer_ops)
        self.forward = compile_forward(model) if compile else functools.partial(run_model, model)
        if compile:
            on_phase("compiling the model forward (minutes on a cold compile cache)")
            self._compile_now()
        if self.attention_backend == "triton":  # every kernel variant compiled now, none mid-traffic
            from worker.engine import triton_attention  # only this backend needs triton

            on_phase("compiling the attention kernels")
            triton_attention.warm_up(*self.kv_caches[0], info.num_heads, info.sliding_window)
        # Decode steps through fixed buffers, replayed from CUDA graphs on a GPU (eager elsewhere: tests).
        self.decode_graphs: DecodeGraphs | None = None
        if cuda_graph_max_seqs and self.attention_backend == "triton":
            capture = self.device.type == "cuda"
            if capture:
                on_phase(f"capturing CUDA graphs of decode steps of up to {cuda_graph_max_seqs} sequences")
            self.decode_graphs = DecodeGraphs(self.forward, self.kv_caches, block_size, max_blocks,
                                              cuda_graph_max_seqs, self.device, capture)

    @torch.inference_mode()
    def _compile_now(self) -> None:
        """Compile at start-up, not in the first step: a worker stalled minutes in a step would
        miss its heartbeats and see its requests taken over. A 1-token forward into block 0,
        whose content no sequence reads before writing it."""
        meta = AttentionMetadata.build([0], [1], [[0]], self.block_size, self.device, self.kv_caches,
                                       backend=self.attention_backend)
        self.forward(torch.zeros(1, dtype=torch.long, device=self.device), meta)

    def execute(self, plan: StepPlan) -> tuple[list[Sequence], torch.Tensor]:
        """-> (the sequences that sample this step, their next-token logits [rows, vocab])."""
        seqs, inputs = list(plan.scheduled), StepInputs.of(plan, self.rows)
        logits = self.compute(inputs) if self.ranks is None else self.ranks.run(inputs, self.compute)
        return [seqs[i] for i in inputs.sampling], logits

    @torch.inference_mode()
    def compute(self, inputs: StepInputs) -> torch.Tensor:
        """One forward -> logits [rows of inputs.sampling, vocab] (no columns on a rank past 0)."""
        self.tables.apply(TableUpdate(inputs.rows, inputs.table_starts, inputs.new_blocks))
        tables = self.tables.of_step(inputs.rows)
        graphs, count = self.decode_graphs, len(inputs.num_new)
        if graphs is not None and count <= graphs.max_seqs and len(inputs.input_ids) == count:
            logits = graphs.run(inputs.input_ids, inputs.num_computed, tables)
            if len(inputs.sampling) == count:
                return logits
            # a 1-token chunk in the middle of a prompt samples nothing
            return logits.index_select(0, values_to_device(inputs.sampling, torch.long, self.device))
        meta = AttentionMetadata.build(inputs.num_computed, inputs.num_new, tables, self.block_size, self.device,
                                       self.kv_caches, backend=self.attention_backend, sampling=inputs.sampling)
        return self.forward(values_to_device(inputs.input_ids, torch.long, self.device), meta)


def runner_for(config: EngineConfig, model: torch.nn.Module, info: ModelInfo, num_blocks: int, max_model_len: int,
               device: str, on_phase: Phase = quiet, ranks: Ranks | None = None) -> ModelRunner:
    """The runner `config` asks for: an engine's, or another tensor-parallel rank's."""
    return ModelRunner(model, info, num_blocks, config.block_size, device, config.compile, on_phase,
                       config.attention_backend, config.cuda_graph_max_seqs, max_model_len, ranks)
