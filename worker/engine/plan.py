"""What one step computes: the scheduler's output and the runner's input."""

from __future__ import annotations

from dataclasses import dataclass, field

from worker.engine.sequence import Sequence


@dataclass
class StepPlan:
    scheduled: dict[Sequence, int] = field(default_factory=dict)  # seq -> new tokens; decodes first
    preempted: list[Sequence] = field(default_factory=list)
    finished: list[Sequence] = field(default_factory=list)  # rejected or aborted since last step
    num_tokens: int = 0

    def add(self, seq: Sequence, num_tokens: int) -> None:
        self.scheduled[seq] = self.scheduled.get(seq, 0) + num_tokens
        self.num_tokens += num_tokens

    def remove(self, seq: Sequence) -> None:
        self.num_tokens -= self.scheduled.pop(seq, 0)

    def samples(self, seq: Sequence) -> bool:
        """True when this step computes the sequence's last known token: it gets a new one."""
        return seq.num_computed_tokens + self.scheduled[seq] == len(seq.token_ids)
