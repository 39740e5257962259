"""Every running sequence's block table, kept between steps (vLLM's persistent batch).

Rebuilding a step's block tables from the sequences' lists, padded into a new tensor, was most of
the host's work in a decode step: 3.6-4 ms of 4.9 at 256 sequences of 2,048 tokens. Instead each
runner keeps one table, a row per running sequence and a column per block of the model length, on
the host (pinned on CUDA) and on the device. A sequence keeps its row while it runs, and its table
only grows (blocks.py appends, and a preemption gives it a new list), so a step writes only the
blocks each of its sequences gained since the row was last written, and copies the table to the
device without the host waiting. The step's attention gathers its sequences' rows on the device.

Rank 0 decides the rows (`RowAssigner`); the updates travel in StepInputs, so that every
tensor-parallel rank's table is the same.
"""

from __future__ import annotations

from collections.abc import Sequence as Sequences
from dataclasses import dataclass

import torch

from worker.engine.host_copy import pinned_if_cuda
from worker.engine.sequence import Sequence


@dataclass
class TableUpdate:
    """Per sequence of a step: its row, and the blocks to write there from column `start` on
    (start 0: the row's whole table)."""

    rows: list[int]
    starts: list[int]
    new_blocks: list[list[int]]


@dataclass
class _Row:
    index: int
    table: list[int]  # the sequence's block_table list, as last written
    written: int  # its blocks written into the row


class RowAssigner:
    """Rank 0: which row each running sequence has, and what its row still lacks."""

    def __init__(self) -> None:
        self.rows: dict[Sequence, _Row] = {}
        self.free: list[int] = []

    def update(self, seqs: Sequences[Sequence]) -> TableUpdate:
        update = TableUpdate([], [], [])
        for seq in seqs:
            row, table = self.rows.get(seq), seq.block_table
            if row is None or row.table is not table:  # new, or re-admitted with a new table
                row = self.rows[seq] = _Row(row.index if row is not None else self._free_row(), table, 0)
            update.rows.append(row.index)
            update.starts.append(row.written)
            update.new_blocks.append(table[row.written:])
            row.written = len(table)
        if len(self.rows) > len(seqs):  # some hold rows without a token in this step: gone, or waiting
            for seq, row in list(self.rows.items()):
                if seq.is_finished or seq.block_table is not row.table:
                    del self.rows[seq]
                    self.free.append(row.index)
        return update

    def _free_row(self) -> int:
        return self.free.pop() if self.free else len(self.rows)


class BlockTables:
    """Every rank: the rows on the host and on the device."""

    def __init__(self, max_blocks_per_seq: int, device: torch.device, rows: int = 64) -> None:
        self.device = device
        self.width = max_blocks_per_seq
        self.host = pinned_if_cuda(torch.zeros(rows, max_blocks_per_seq, dtype=torch.long), device)
        self.on_device = self.host if device.type == "cpu" else torch.zeros_like(self.host, device=device)
        self.host_view = self.host.numpy()  # writes through numpy: a torch slice assignment costs ~5 µs
        self.used_rows = 0
        self.copied: torch.cuda.Event | None = None

    def apply(self, update: TableUpdate) -> None:
        """Write the blocks rows gained, then copy the written part of the table to the device."""
        if update.rows and max(update.rows) >= len(self.host):
            self._grow(max(update.rows) + 1)
        if self.copied is not None and not self.copied.query():
            self.copied.synchronize()  # the last copy still reads the pinned rows (rare: each step syncs)
        view = self.host_view
        for row, start, blocks in zip(update.rows, update.starts, update.new_blocks):
            if blocks:
                view[row, start:start + len(blocks)] = blocks
        self.used_rows = max(self.used_rows, max(update.rows, default=-1) + 1)
        if self.on_device is not self.host and self.used_rows:
            # whole rows: a contiguous region, copied straight from the pinned memory (a strided one
            # would first be gathered into pageable memory, and that copy blocks the host)
            self.on_device[:self.used_rows].copy_(self.host[:self.used_rows], non_blocking=True)
            self.copied = torch.cuda.Event()
            self.copied.record()

    def _grow(self, rows: int) -> None:
        size = max(rows, 2 * len(self.host))
        host = pinned_if_cuda(torch.zeros(size, self.width, dtype=torch.long), self.device)
        host[:len(self.host)] = self.host
        on_device = host if self.device.type == "cpu" else torch.zeros_like(host, device=self.device)
        if on_device is not host:
            on_device[:len(self.on_device)] = self.on_device
        self.host, self.on_device, self.host_view = host, on_device, host.numpy()

    def of_step(self, rows: list[int]) -> StepTables:
        return StepTables(self.host, self.on_device, rows)


@dataclass
class StepTables:
    """A step's sequences' block tables: rows `rows` of the persistent tables."""

    host: torch.Tensor  # [all rows, width]
    on_device: torch.Tensor  # the same table on the step's device (the same tensor on the CPU)
    rows: list[int]  # per sequence of the step

    @classmethod
    def of(cls, block_tables: Sequences[Sequences[int]], device: torch.device | str) -> StepTables:
        """Plain lists (tests, a warm-up step): one row each, padded with block 0."""
        device = torch.device(device)
        width = max(len(table) for table in block_tables)
        host = torch.tensor([list(table) + [0] * (width - len(table)) for table in block_tables], dtype=torch.long)
        return cls(host, host.to(device), list(range(len(block_tables))))
