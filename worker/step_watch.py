"""Keeping a worker visibly alive through a long engine step, and not through a hung one.

Claims are refreshed and the heartbeat beaten between steps (housekeeping, service.py). One
step longer than the reclaim threshold (a long prefill on a slow CPU, a first compile) would
make the worker look dead: other workers would reclaim its requests and fence it off, and the
requests would ping-pong. So while a step runs past a heartbeat interval, a thread does the
keeping-alive in its place. The step itself (torch) releases the GIL; the thread only talks
to Redis.

A step that never ends must not hold its requests for ever that way. The same thread watches
the loop: once it has not completed a turn for --stall-timeout (what /healthz calls stuck), it
stops keeping anything alive and calls `on_stall`, which ends the process (service.py): its
entries go idle and other workers reclaim them, and a restart policy (compose, systemd) that
acts on an exit, not on an unhealthy verdict, starts it again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import redis
import structlog

from worker.flight import Flight


class StepWatch:
    def __init__(self, interval: float, keep_alive: Callable[[list[Flight]], None],
                 stalled: Callable[[], str | None], on_stall: Callable[[str], None],
                 log: structlog.typing.FilteringBoundLogger) -> None:
        """`keep_alive(flights)` refreshes the claims of the step's flights and the heartbeat;
        `stalled()` says why the loop is stuck, if it is (Health.stall)."""
        self.interval, self.keep_alive, self.log = interval, keep_alive, log
        self.stalled, self.on_stall = stalled, on_stall
        self._step: tuple[list[Flight], float] | None = None  # (flights, when kept alive last)
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="step-watch", daemon=True)
        self._thread.start()

    @contextmanager
    def step(self, flights: list[Flight]) -> Iterator[None]:
        with self._lock:
            self._step = (flights, time.monotonic())
        try:
            yield
        finally:
            with self._lock:
                self._step = None

    def close(self) -> None:
        self._closed.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._closed.wait(self.interval / 4):
            reason = self.stalled()
            if reason is not None:
                self.on_stall(reason)
                return  # nothing is kept alive any more
            step = self._step
            if step is None or time.monotonic() - step[1] < self.interval:
                continue
            flights, _ = step
            try:
                self.keep_alive(flights)
                self.log.info("worker.long_step_kept_alive", in_flight=len(flights))
            except redis.RedisError as error:  # the loop sees Redis trouble for itself after the step
                self.log.warning("worker.keep_alive_failed", error=str(error))
            with self._lock:
                if self._step is step:  # still the same step
                    self._step = (flights, time.monotonic())
