"""The load generators against one topology: processes of synthetic workers (workers.py) and
processes of producers and consumers (load.py), grown as the ramp adds workers.

Processes come from a fork server that has imported the worker (torch included) once, so that a
new process of workers starts in a moment rather than after seconds of imports; this process
never imports it.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path

from ops.demo import last_lines
from ops.fleet.child_log import STACKS_SIGNAL
from ops.fleet.load import drive
from ops.fleet.nodes import Topology
from ops.fleet.scenario import Scenario
from ops.fleet.windows import HostWindow, LoadWindow
from ops.tool import ToolError

START_TIMEOUT_S = 120.0
REPLY_TIMEOUT_S = 60.0  # a window's answer (the workers' one reads every admission's attempt key)
STOP_TIMEOUT_S = 30.0


def workers_process(*args) -> None:
    """workers.serve, named here without importing it: the fork server has it loaded, this process never."""
    from ops.fleet.workers import serve
    serve(*args)


class Child:
    """A process of ours and its end of the pipe."""

    def __init__(self, context, target, args: tuple, log: Path) -> None:
        self.control, remote = context.Pipe()
        self.log = log
        self.process = context.Process(target=target, args=(*args, log, remote), daemon=True)
        self.process.start()
        remote.close()

    def ask(self, command, expect: str, timeout: float = REPLY_TIMEOUT_S):
        self.control.send(command)
        return self.reply(expect, timeout)

    def reply(self, expect: str, timeout: float):
        if not self.control.poll(timeout):
            if self.process.is_alive():  # where it is stuck: its threads' stacks (child_log.py)
                os.kill(self.process.pid, STACKS_SIGNAL)
                time.sleep(0.5)
            raise ToolError(f"{self.log.stem} did not answer within {timeout:.0f} s; its log:\n"
                            f"{last_lines(self.log, 60)}")
        try:
            kind, value = self.control.recv()
        except EOFError:
            raise ToolError(f"{self.log.stem} ended (status {self.process.exitcode}); its log:\n"
                            f"{last_lines(self.log)}") from None
        if kind == "error":
            raise ToolError(f"{self.log.stem} could not start: {value}")
        assert kind == expect, (kind, expect)
        return value

    def stop(self) -> None:
        if self.process.is_alive():
            try:
                self.ask("stop", "stopped", STOP_TIMEOUT_S)
            except (ToolError, OSError):
                pass  # ended already, or wedged: killed below
        self.process.join(STOP_TIMEOUT_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


class Generators:
    def __init__(self, topology: Topology, scenario: Scenario, workers_per_process: int, load_processes: int,
                 scratch: Path, seed: int) -> None:
        self.topology, self.scenario = topology, scenario
        self.workers_per_process, self.load_processes = workers_per_process, load_processes
        self.scratch, self.seed = scratch, seed
        self.context = multiprocessing.get_context("forkserver")
        self.context.set_forkserver_preload(["ops.fleet.workers", "ops.fleet.load"])
        self.hosts: list[Child] = []
        self.loads: list[Child] = []
        self.workers = 0

    def __enter__(self) -> Generators:
        try:
            masters_slots = self.topology.masters_slots()
            for index in range(self.load_processes):
                self.loads.append(Child(self.context, drive, (self.topology.url, self.topology.cluster, self.scenario,
                                                              masters_slots, self.seed + index),
                                        self.scratch / f"{self.topology.kind}-load-{index}.log"))
            for load in self.loads:
                load.reply("ready", START_TIMEOUT_S)
        except BaseException:
            self.__exit__()
            raise
        return self

    def grow(self, workers: int, in_flight: int) -> None:
        """Start processes for the workers missing up to `workers`, then have the load keep `in_flight`
        requests in flight."""
        started = []
        while self.workers < workers:
            count = min(self.workers_per_process, workers - self.workers)
            names = [f"fleet-{self.topology.kind}-{self.workers + i}" for i in range(count)]
            started.append(Child(self.context, workers_process,
                                 (self.topology.url, self.topology.cluster, names, self.scenario),
                                 self.scratch / f"{self.topology.kind}-workers-{len(self.hosts)}.log"))
            self.hosts.append(started[-1])
            self.workers += count
        for host in started:
            host.reply("ready", START_TIMEOUT_S)
        for index, load in enumerate(self.loads):
            load.control.send(("target", in_flight // len(self.loads) + (index < in_flight % len(self.loads))))

    def unfollowed(self, rate: float) -> None:
        """No consumers from now on: requests submitted at `rate` per second, nobody following them."""
        for load in self.loads:
            load.control.send(("unfollowed", rate / len(self.loads)))

    def window(self) -> tuple[list[HostWindow], list[LoadWindow]]:
        """What every process did since the previous call."""
        for child in self.hosts + self.loads:
            child.control.send("window")
        return ([host.reply("window", REPLY_TIMEOUT_S) for host in self.hosts],
                [load.reply("window", REPLY_TIMEOUT_S) for load in self.loads])

    def __exit__(self, *exc) -> None:
        """The load first (it cancels its requests), then the workers."""
        for child in self.loads + self.hosts:
            child.stop()
