"""The same CPU for every Redis master: each redis-server in a cgroup of its own (cgroup v1's cpu
controller, as root), the masters with one CFS quota for all.

A master may then use at most `cores` of a core, so that it saturates before the load generators
do on a small machine, and a master of the cluster gets exactly what the single node gets. The
period is as short as the quota allows (10 ms, or what the kernel's smallest quota, 1 ms, needs):
a node that spends its quota early in a period waits for the next, and with the kernel's default
100 ms that wait would show in every latency measured; unused quota carries over up to one quota
(cpu.cfs_burst_us), so a node that was idle takes a burst of twice its quota before it waits.
Replicas get a group without a quota: their CPU is measured, not capped (a replica that waits
for its quota would stretch every WAIT of the cluster's writes). The groups' parent gets a large
cpu.shares, so that other work on the machine cannot keep a node from its quota.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

CPU_CONTROLLER = Path("/sys/fs/cgroup/cpu")
MIN_QUOTA_US = 1000  # the kernel refuses less
PERIOD_US = 10_000
PARENT_SHARES = 16 * 1024  # as much weight as 16 busy processes of the root group


@dataclass(frozen=True)
class Throttling:
    periods: int  # CFS periods in which the group ran
    throttled: int  # of those, periods that ended with it throttled (its quota spent)
    throttled_s: float


class CpuCaps:
    def __init__(self, cores: float) -> None:
        self.parent = CPU_CONTROLLER / f"streambatch-fleet-{os.getpid()}"
        self.groups: dict[str, Path] = {}
        self.capped: list[str] = []
        self._cap(cores)

    def _cap(self, cores: float) -> None:
        if not cores > 0:
            raise ValueError(f"a node's CPU cap must be above 0 cores, got {cores}")
        self.cores = cores
        self.period_us = max(PERIOD_US, round(MIN_QUOTA_US / cores))
        self.quota_us = round(cores * self.period_us)

    def __enter__(self) -> CpuCaps:
        if not os.access(CPU_CONTROLLER, os.W_OK) or not (CPU_CONTROLLER / "cpu.cfs_quota_us").exists():
            raise PermissionError(f"cannot cap the Redis nodes' CPU: {CPU_CONTROLLER} (cgroup v1's cpu controller) "
                                  "is missing or not writable here (run as root)")
        self.parent.mkdir()
        (self.parent / "cpu.shares").write_text(str(PARENT_SHARES))
        return self

    def add(self, name: str, pid: int, capped: bool) -> None:
        """Put process `pid` (a node) in a group of its own, `capped` by the quota or not."""
        group = self.parent / name
        group.mkdir()
        self.groups[name] = group
        if capped:
            self.capped.append(name)
            self._write(group)
        (group / "cgroup.procs").write_text(str(pid))

    def _write(self, group: Path) -> None:
        (group / "cpu.cfs_burst_us").write_text("0")  # first: a burst may not exceed the quota
        (group / "cpu.cfs_period_us").write_text(str(self.period_us))
        (group / "cpu.cfs_quota_us").write_text(str(self.quota_us))
        (group / "cpu.cfs_burst_us").write_text(str(self.quota_us))

    @contextlib.contextmanager
    def raised(self, cores: float) -> Iterator[None]:
        """Every capped node at `cores` for a while, then back to its cap."""
        cap = self.cores
        self._set(cores)
        try:
            yield
        finally:
            self._set(cap)

    def _set(self, cores: float) -> None:
        self._cap(cores)
        for name in self.capped:
            self._write(self.groups[name])

    def throttling(self, name: str) -> Throttling:
        stat = dict(line.split() for line in (self.groups[name] / "cpu.stat").read_text().splitlines())
        return Throttling(int(stat["nr_periods"]), int(stat["nr_throttled"]), int(stat["throttled_time"]) / 1e9)

    def __exit__(self, *exc) -> None:
        """Any process still in a group goes back to the root group; then the groups go."""
        for group in self.groups.values():
            for pid in (group / "cgroup.procs").read_text().split():
                try:
                    (CPU_CONTROLLER / "cgroup.procs").write_text(pid)
                except ProcessLookupError:  # it ended meanwhile
                    pass
            group.rmdir()
        self.groups = {}
        self.parent.rmdir()
