"""StepPlan -> packed tensors -> one model forward -> logits of the rows that sample.

The runner decides nothing: the plan says which tokens of which sequences to compute.
Every scheduled token of every sequence (prefill chunks and decodes together) goes into
one flattened row; attention finds each sequence's boundaries and KV through the
AttentionMetadata built here from the sequences' block tables.
"""

from __future__ import annotations

import functools

import torch

from worker.engine.attention import AttentionMetadata, run_model
from worker.engine.compiled import compile_forward
from worker.engine.disk_cache import Phase, quiet
from worker.engine.linear import fuse_projections, pack_linear_layers, packing_backend, packing_works
from worker.engine.models import ModelInfo, allocate_kv_cache
from worker.engine.plan import StepPlan
from worker.engine.sequence import Sequence


class ModelRunner:
    def __init__(self, model: torch.nn.Module, info: ModelInfo, num_blocks: int, block_size: int,
                 device: str = "cpu", compile: bool = False, on_phase: Phase = quiet) -> None:
        self.model = model
        self.block_size = block_size
        self.device = torch.device(device)
        on_phase(f"allocating the KV cache ({num_blocks} blocks of {block_size} tokens, "
                 f"{num_blocks * info.kv_bytes_per_block(block_size) / 2**30:.2f} GiB)")
        self.kv_caches = allocate_kv_cache(info, num_blocks, block_size, info.dtype, device)
        on_phase("preparing the model's linear layers")
        fuse_projections(model)
        # oneDNN's packed op does not lower into a graph with unbacked sizes: compiled, inductor's GEMM serves.
        if self.device.type == "cpu" and packing_works(info.dtype) and not (
                compile and packing_backend(info.dtype) == "onednn"):
            pack_linear_layers(model)
        self.forward = compile_forward(model) if compile else functools.partial(run_model, model)
        if compile:
            on_phase("compiling the model forward (minutes on a cold compile cache)")
            self._compile_now()

    @torch.inference_mode()
    def _compile_now(self) -> None:
        """Compile at start-up, not in the first step: a worker stalled minutes in a step would
        miss its heartbeats and see its requests taken over. A 1-token forward into block 0,
        whose content no sequence reads before writing it."""
        meta = AttentionMetadata.build([0], [1], [[0]], self.block_size, self.device, self.kv_caches)
        self.forward(torch.zeros(1, dtype=torch.long, device=self.device), meta)

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> tuple[list[Sequence], torch.Tensor]:
        """-> (the sequences that sample this step, their next-token logits [rows, vocab])."""
        seqs = list(plan.scheduled)
        num_new = list(plan.scheduled.values())
        num_computed = [seq.num_computed_tokens for seq in seqs]
        input_ids: list[int] = []
        for seq, start, count in zip(seqs, num_computed, num_new):
            input_ids.extend(seq.token_ids[start:start + count])
        meta = AttentionMetadata.build(num_computed, num_new, [seq.block_table for seq in seqs],
                                       self.block_size, self.device, self.kv_caches)
        sampling = [i for i, seq in enumerate(seqs) if plan.samples(seq)]
        meta.logits_rows = meta.logits_rows[sampling]  # a mid-prompt chunk needs no logits
        logits = self.forward(torch.tensor(input_ids, device=self.device), meta)
        return [seqs[i] for i in sampling], logits
