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

A step's inputs reach the buffers in one asynchronous copy from pinned memory, and its block tables
are gathered on the device from the runner's persistent tables (block_tables.py). Every captured
size writes its logits into one buffer [max_seqs, vocab]: a graph's own output would stay allocated
for as long as the graph lives (560 MB over 20 sizes for Llama-3-8B's vocabulary).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

import torch

from worker.engine.attention import AttentionMetadata
from worker.engine.block_tables import StepTables

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
        # input ids, positions, slots, context lengths and persistent-table rows: one row each, one copy in
        self.inputs = torch.zeros(5, size, dtype=torch.long, device=device)
        self.input_ids, self.positions, self.slots, self.seq_lens, self.rows = self.inputs
        self.slots.fill_(-1)
        self.seq_lens.fill_(1)
        self.block_tables = torch.zeros(size, max_blocks_per_seq, dtype=torch.long, device=device)
        query_start_loc = torch.arange(size + 1, dtype=torch.long, device=device)  # one new token per row
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
        self.logits: torch.Tensor | None = None  # [max_seqs, vocab], made by the first forward
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if capture:
            self._capture()

    @property
    def max_seqs(self) -> int:
        return self.sizes[-1]

    def _forward(self, n: int) -> None:
        logits = self.forward(self.input_ids[:n], self.metadata[n])
        if self.logits is None:
            self.logits = logits.new_empty(self.max_seqs, logits.shape[1])
        self.logits[:n].copy_(logits)

    @torch.inference_mode()
    def _capture(self) -> None:
        """Largest first, all in one memory pool: a smaller graph reuses the larger one's memory."""
        pool = None
        for n in reversed(self.sizes):
            self._forward(n)  # warm-up: Triton compiles, cuBLAS picks; the first makes the logits buffer
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._forward(n)
            pool = graph.pool()
            self.graphs[n] = graph
        torch.cuda.synchronize()

    def run(self, input_ids: Sequence[int], num_computed: Sequence[int], tables: StepTables) -> torch.Tensor:
        """One decode per sequence: its token input_ids[i] at position num_computed[i], its blocks
        in row tables.rows[i] -> logits [len(input_ids), vocab] (a view of the shared buffer)."""
        n = len(input_ids)
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        host = torch.zeros(5, self.max_seqs, dtype=torch.long)  # every row: one contiguous copy
        host[2].fill_(-1)  # padding rows: the ones a larger step left are reset too
        host[3].fill_(1)
        rows, positions = torch.tensor(tables.rows), torch.tensor(num_computed)
        host[0, :n] = torch.tensor(input_ids)
        host[1, :n] = positions
        host[2, :n] = tables.host[rows, positions // self.block_size] * self.block_size + positions % self.block_size
        host[3, :n] = positions + 1
        host[4, :n] = rows
        if self.inputs.device.type == "cuda":
            host = host.pin_memory()
        self.inputs.copy_(host, non_blocking=True)
        torch.index_select(tables.on_device, 0, self.rows[:n], out=self.block_tables[:n])
        if self.graphs:
            self.graphs[size].replay()
        else:
            self._forward(size)
        return self.logits[:n]
