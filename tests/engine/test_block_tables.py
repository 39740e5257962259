"""The runners' persistent block tables: a step writes only the blocks its sequences gained; rows
are reused once their sequence has finished or lost its table (a preemption)."""

import torch

from producer.protocol import SamplingParams
from worker.engine.block_tables import BlockTables, RowAssigner
from worker.engine.sequence import FinishReason, Sequence


def seq(name: str, blocks: list[int]) -> Sequence:
    s = Sequence(name, [5, 6, 7], SamplingParams())
    s.block_table = list(blocks)
    return s


def rows_of(tables: BlockTables, seqs: list[Sequence], update) -> list[list[int]]:
    tables.apply(update)
    return [tables.host[row, :len(s.block_table)].tolist() for row, s in zip(update.rows, seqs)]


def test_a_step_writes_what_each_row_gained_and_rows_are_reused():
    assigner, tables = RowAssigner(), BlockTables(8, torch.device("cpu"), rows=1)
    a, b = seq("a", [4, 9]), seq("b", [3])
    update = assigner.update([a, b])
    assert (update.rows, update.starts, update.new_blocks) == ([0, 1], [0, 0], [[4, 9], [3]])
    assert rows_of(tables, [a, b], update) == [[4, 9], [3]]  # the table grew to 2 rows
    a.block_table.append(7)  # a gained a block, b none
    update = assigner.update([a, b])
    assert (update.starts, update.new_blocks) == ([2, 1], [[7], []])
    assert rows_of(tables, [a, b], update) == [[4, 9, 7], [3]]
    a.finish(FinishReason.LENGTH, 0.0)
    b.block_table = [11, 12]  # preempted and admitted again: a new table, written whole
    c = seq("c", [1, 2, 5])
    update = assigner.update([b, c])
    assert (update.rows, update.starts, update.new_blocks) == ([1, 2], [0, 0], [[11, 12], [1, 2, 5]])
    assert rows_of(tables, [b, c], update) == [[11, 12], [1, 2, 5]]
    d = seq("d", [6])  # a left: its row is free for the next newcomer
    update = assigner.update([b, c, d])
    assert update.rows == [1, 2, 0] and update.new_blocks == [[], [], [6]]
    assert rows_of(tables, [b, c, d], update) == [[11, 12], [1, 2, 5], [6]]


def test_a_waiting_sequence_keeps_its_row():
    assigner = RowAssigner()
    a, b = seq("a", [4]), seq("b", [3])
    assigner.update([a, b])
    assert assigner.update([a]).rows == [0]  # b sat this step out (a chunk the budget left out)
    assert assigner.update([a, b]).starts == [1, 1]  # and kept its row, its blocks written
