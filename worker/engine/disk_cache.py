"""Directories built once per machine and shared by every process on it: the converted model
and the native kernels, under $STREAMBATCH_CACHE (default ~/.cache/streambatch).

A directory is built under an flock, which the operating system drops when its holder dies
however it dies, in a temporary directory renamed into place once complete. So a directory
that exists is complete; a build killed midway leaves only its temporary directory, which the
next builder deletes; and no process waits on a dead one, nor longer than its `wait_s` on a
live one. A directory that exists but does not work (its files deleted or damaged since) is
built again once, by `rebuild`, under the same lock. (torch's extension builder marks its
build with a lock *file* instead: one killed midway left it behind, and every later load
waited on it forever.) The lock is a plain fcntl call rather than the filelock package, whose
Unix lock turns into a file-exists lock, with the same failure, on file systems without flock.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

Phase = Callable[[str], None]  # told what a long start-up step is doing now, for status displays


def quiet(phase: str) -> None:
    """A Phase that tells no one."""


def cache_dir() -> Path:
    return Path(os.environ.get("STREAMBATCH_CACHE") or Path.home() / ".cache" / "streambatch")


class LockTimeout(TimeoutError):
    """Another live process held the lock longer than we were willing to wait."""


@contextmanager
def exclusive(lock_path: Path, wait_s: float, on_wait: Callable[[str], None] = quiet) -> Iterator[None]:
    """Hold an exclusive flock on `lock_path` for the block. If another process holds it, say so
    once through `on_wait` (with its pid) and wait at most `wait_s` seconds, then raise LockTimeout."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + wait_s
        told = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
                if not told:
                    on_wait(holder)
                    told = True
                if time.monotonic() >= deadline:
                    raise LockTimeout(f"{lock_path} is still held by pid {holder} after {wait_s:.0f} s") from None
                time.sleep(0.2)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)  # who holds it, for the messages of those who wait
        yield
    finally:
        os.close(fd)  # drops the lock


def build_once(target: Path, build: Callable[[Path], None], *, what: str, wait_s: float,
               on_phase: Phase = quiet) -> Path:
    """-> `target`, built by `build(temporary_directory)` unless it exists: under the target's lock,
    in a temporary directory beside it that is renamed to `target` when `build` returns.
    `what` says what building is ("converting the model"), for `on_phase`."""
    if target.is_dir():
        return target
    with exclusive(_lock_of(target), wait_s, on_wait=_waiting(what, on_phase)):
        if not target.is_dir():  # else the process we waited for built it
            _build(target, build, what, on_phase)
    return target


def rebuild(target: Path, found: os.stat_result, build: Callable[[Path], None], *, what: str, wait_s: float,
            on_phase: Phase = quiet) -> bool:
    """Build `target` again, found unusable (its files deleted or damaged under the cache) when its
    stat was `found`: under the lock, unless another process replaced it meanwhile, which then
    is the build to use. -> whether this call built it."""
    with exclusive(_lock_of(target), wait_s, on_wait=_waiting(what, on_phase)):
        if target.is_dir() and not _same_directory(target.stat(), found):
            return False
        if target.is_dir():  # moved aside first: a rename is atomic, so no reader sees half a directory
            target.rename(target.with_name(f"{_scratch_prefix(target)}discarded"))
        _build(target, build, what, on_phase)
    return True


def _build(target: Path, build: Callable[[Path], None], what: str, on_phase: Phase) -> None:
    """Under the target's lock: clear what dead builders left, build in scratch, rename into place."""
    prefix = _scratch_prefix(target)
    for leftover in target.parent.glob(prefix + "*"):  # of builders that died (we hold the lock)
        shutil.rmtree(leftover, ignore_errors=True)
    on_phase(what)
    scratch = Path(tempfile.mkdtemp(prefix=prefix, dir=target.parent))
    scratch.chmod(0o755)  # mkdtemp makes it private; the build is for every user of the cache
    try:
        build(scratch)
        scratch.rename(target)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _lock_of(target: Path) -> Path:
    return target.with_name(f".{target.name}.lock")


def _scratch_prefix(target: Path) -> str:
    return f".tmp-{target.name}-"


def _waiting(what: str, on_phase: Phase) -> Callable[[str], None]:
    return lambda pid: on_phase(f"waiting for another process (pid {pid}) {what}")


def _same_directory(now: os.stat_result, found: os.stat_result) -> bool:
    return (now.st_ino, now.st_dev, now.st_mtime_ns) == (found.st_ino, found.st_dev, found.st_mtime_ns)
