"""A child process's log: its stdout and stderr, and, on STACKS_SIGNAL, every thread's stack (the
parent sends it to a child that does not answer, to say where it is stuck)."""

from __future__ import annotations

import faulthandler
import signal
import sys
from pathlib import Path

STACKS_SIGNAL = signal.SIGUSR1


def log_to(log: Path) -> None:
    sys.stdout = sys.stderr = log.open("w", buffering=1)
    faulthandler.register(STACKS_SIGNAL, file=sys.stderr, all_threads=True)
