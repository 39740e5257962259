"""What each load generator process reports of a window (the time since its previous report)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class HostWindow:
    """A process of synthetic workers (workers.py)."""
    workers: int
    cpu_s: float  # the process's CPU time (all its threads)
    steps: int
    tokens: int
    scheduled: int  # sequences per step, summed over steps
    # per request taken in (s): XADD -> a worker's claim (the intake's admission), and XADD -> the
    # worker's engine, which takes requests in between steps
    intake_s: list[float] = field(default_factory=list)
    started_s: list[float] = field(default_factory=list)


@dataclass
class LoadWindow:
    """A process of producers and consumers (load.py)."""
    cpu_s: float  # the process's CPU time: submitting, following, decoding
    events: int  # token events delivered to the consumers
    tokens: int
    completed: int
    failures: dict[str, int] = field(default_factory=dict)  # by error code or exception
