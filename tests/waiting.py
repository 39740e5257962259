"""Waiting in tests: a condition polled until it holds, or a failure that says what did not happen."""

import time
from collections.abc import Callable

# A process that imports torch and transformers (a worker, a gateway) can take tens of seconds to
# start while the rest of the suite loads both cores of a small CI machine.
START_TIMEOUT_S = 120.0


def wait_for(condition: Callable[[], object], timeout: float = 30.0, message: str = "the condition",
             ignoring: tuple[type[BaseException], ...] = ()) -> object:
    """The condition's first true value; the errors in `ignoring` count as not yet."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = condition()
        except ignoring:
            value = None
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout:g} s: {message}"
        time.sleep(0.02)
