"""All-decode steps replayed from CUDA graphs: one replay instead of hundreds of kernel launches.

A decode step launches a few kernels per layer (norms, projections, rotary, attention, MLP); at small
batches the GPU finishes them faster than Python issues them, so the launches, not the math, bound
the step. At start-up the runner therefore captures one forward per batch size of BATCH_SIZES (up
to a maximum), each over the same fixed device buffers, as vLLM and nano-vllm do; a step of n
decodes copies its inputs into the buffers and replays the graph of the smallest size >= n.
Rows past n are padding: slot -1 (triton_attention.write_kv writes nothing for it), one token of
context in block 0 (read, never written), and their logits are dropped.

Only the triton attention backend can be captured: it reads nothing but tensors and launches a
grid sized by tensor shapes, so one AttentionMetadata per captured size (views of the buffers)
serves every replay. The torch backend loops in Python over decode groups and cannot be.
`capture=False` keeps the buffers and padding but runs the forward eagerly: the CPU tests' way to
check everything here but the capture itself.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

import torch

from worker.engine.attention import AttentionMetadata, padded_tables, slot_mapping

BATCH_SIZES = (1, 2, 4, 8, *range(16, 1025, 16))  # as nano-vllm: fine steps where padding costs most

Forward = Callable[[torch.Tensor, AttentionMetadata], torch.Tensor]  # (input_ids [T], meta) -> logits


class DecodeGraphs:
    def __init__(self, forward: Forward, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int,
                 max_blocks_per_seq: int, max_seqs: int, device: torch.device | str, capture: bool = True) -> None:
        if max_seqs < 1:
            raise ValueError(f"CUDA graphs need max_seqs >= 1, got {max_seqs}")
        self.sizes = [size for size in BATCH_SIZES if size < max_seqs] + [max_seqs]
        self.block_size = block_size
        self.forward = forward
        device = torch.device(device)
        size = self.sizes[-1]
        as_long = dict(dtype=torch.long, device=device)
        self.input_ids = torch.zeros(size, **as_long)
        self.positions = torch.zeros(size, **as_long)
        self.slots = torch.full((size,), -1, **as_long)
        self.seq_lens = torch.ones(size, **as_long)
        self.block_tables = torch.zeros(size, max_blocks_per_seq, **as_long)
        query_start_loc = torch.arange(size + 1, **as_long)  # one new token per row, whatever the step
        self.metadata = {
            n: AttentionMetadata(
                slot_mapping=self.slots[:n], positions=self.positions[:n],
                query_start_loc=query_start_loc[:n + 1], seq_lens=self.seq_lens[:n], block_tables=self.block_tables[:n],
                logits_rows=query_start_loc[:n], block_size=block_size, max_query_len=1,
                max_seq_len=max_blocks_per_seq * block_size, seq_lens_list=[1] * n, query_start_loc_list=list(range(n + 1)),
                decode_groups=[], prefills=[], backend="triton", kv_caches=kv_caches,
            )
            for n in self.sizes
        }
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if capture:
            self._capture()

    @property
    def max_seqs(self) -> int:
        return self.sizes[-1]

    @torch.inference_mode()
    def _capture(self) -> None:
        """Largest first, all in one memory pool: a smaller graph reuses the larger one's memory."""
        pool = None
        for n in reversed(self.sizes):
            self.forward(self.input_ids[:n], self.metadata[n])  # warm-up: Triton compiles, cuBLAS picks
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self.forward(self.input_ids[:n], self.metadata[n])
            pool = graph.pool()
            self.graphs[n] = (graph, logits)
        torch.cuda.synchronize()

    def run(self, input_ids: Sequence[int], num_computed: Sequence[int],
            block_tables: Sequence[Sequence[int]]) -> torch.Tensor:
        """One decode per sequence: its token input_ids[i] at position num_computed[i], its blocks
        block_tables[i] -> logits [len(input_ids), vocab]."""
        n = len(input_ids)
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        # Only the columns this step's tables fill are copied: a row's later columns may hold an
        # earlier step's blocks, which attention never reads (nothing past a sequence's length).
        tables = padded_tables(block_tables, size)
        positions = torch.tensor(num_computed, dtype=torch.long)
        slots = torch.full((size,), -1, dtype=torch.long)
        slots[:n] = slot_mapping(tables, torch.arange(n), positions, self.block_size)
        seq_lens = torch.ones(size, dtype=torch.long)
        seq_lens[:n] = positions + 1
        # Rows up to `size`: the padding rows a larger step left are reset too.
        self.input_ids[:n].copy_(torch.tensor(input_ids), non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slots[:size].copy_(slots, non_blocking=True)
        self.seq_lens[:size].copy_(seq_lens, non_blocking=True)
        self.block_tables[:size, :tables.shape[1]].copy_(tables, non_blocking=True)
        if self.graphs:
            graph, logits = self.graphs[size]
            graph.replay()
        else:
            logits = self.forward(self.input_ids[:size], self.metadata[size])
        return logits[:n]
