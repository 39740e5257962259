"""How an ops tool's command ends: its expected failures (a deployment that would not start, a bad
option, a file it cannot read, a Redis it cannot reach) as one red line and exit status 1, Ctrl-C or
SIGTERM as 130, after the tool has stopped whatever it started (its context managers run on the way
out); how it reads a comma-separated choice of known names; and the console its tables print on."""

from __future__ import annotations

import signal
from collections.abc import Callable

import redis
from rich.console import Console
from rich.markup import escape


class ToolError(Exception):
    """A step of a tool failed; the message says which and what to do."""


def run_tool(name: str, action: Callable[[], None], console: Console) -> int:
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop what it started, as on Ctrl-C
    try:
        action()
    except (ToolError, ValueError, OSError, redis.RedisError) as error:
        console.print(f"[red]{name} failed:[/] {escape(str(error))}")
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


def choices(value: str, known, what: str) -> list[str]:
    """A comma-separated option -> its items, each one of `known` (else a ValueError naming them)."""
    chosen = value.split(",")
    for choice in chosen:
        if choice not in known:
            raise ValueError(f"unknown {what} {choice!r}: choose from {', '.join(known)}")
    return chosen


def wide_console(width: int) -> Console:
    """A console at least `width` columns wide: rich assumes 80 where the output is no terminal (a
    log, a pipe), which cuts a wide table's figures to "1…". No emoji codes: "random:llama:" is none."""
    return Console(width=max(Console().width, width), emoji=False)
