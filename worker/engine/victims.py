"""Who is preempted when running sequences cannot grow (victim policies)."""

from __future__ import annotations

from worker.engine.scheduler_config import VictimPolicy
from worker.engine.sequence import Sequence


def pick_victim(candidates: list[Sequence], policy: VictimPolicy,
                last_victim: Sequence | None) -> Sequence | None:
    """cheapest: fewest computed tokens, so the least recompute (ties: the newest);
    newest: LIFO, it has generated least; most_blocks: frees the most memory at once.
    Never the same victim twice in a row when there is another choice."""
    if len(candidates) > 1 and last_victim in candidates:
        candidates = [seq for seq in candidates if seq is not last_victim]
    if not candidates:
        return None
    if policy == "newest":
        return max(candidates, key=lambda seq: seq.arrival_time)
    if policy == "most_blocks":
        return max(candidates, key=lambda seq: (len(seq.block_table), seq.arrival_time))
    return min(candidates, key=lambda seq: (seq.num_computed_tokens, -seq.arrival_time))
