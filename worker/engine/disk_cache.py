"""Directories built once per machine and shared by every process on it: the converted model
and the native kernels, under $STREAMBATCH_CACHE (default ~/.cache/streambatch).

A directory is built under an flock, which the operating system drops when its holder dies
however it dies, in a temporary directory renamed into place once complete. So a directory
that exists is complete; a build killed midway leaves only its temporary directory, which the
next builder deletes; and no process waits on a dead one, nor longer than its `wait_s` on a
live one. (torch's extension builder marks its build with a lock *file* instead: one killed
midway left it behind, and every later load waited on it forever.) The lock is a plain fcntl
call rather than the filelock package, whose Unix lock turns into a file-exists lock, with the
same failure, on file systems without flock.
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
    lock = target.with_name(f".{target.name}.lock")
    with exclusive(lock, wait_s, on_wait=lambda pid: on_phase(f"waiting for another process (pid {pid}) {what}")):
        if target.is_dir():  # the process we waited for built it
            return target
        prefix = f".tmp-{target.name}-"
        for leftover in target.parent.glob(prefix + "*"):  # of builders that died: we hold the lock
            shutil.rmtree(leftover, ignore_errors=True)
        on_phase(what)
        scratch = Path(tempfile.mkdtemp(prefix=prefix, dir=target.parent))
        scratch.chmod(0o755)  # mkdtemp makes it private; the build is for every user of the cache
        try:
            build(scratch)
            scratch.rename(target)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return target
