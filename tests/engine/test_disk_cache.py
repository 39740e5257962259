"""disk_cache: a lock the OS drops when its holder dies, a bounded wait for a live holder, and
directories that exist only once complete, even when their builder is killed midway."""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.waiting import wait_for
from worker.engine.disk_cache import LockTimeout, build_once, exclusive, rebuild

ROOT = Path(__file__).resolve().parents[2]


def python(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT)


def holding(lock: Path) -> subprocess.Popen:
    """A process that takes `lock`, says so in a file beside it, and sleeps."""
    return python(f"""
        import time
        from pathlib import Path
        from worker.engine.disk_cache import exclusive
        with exclusive(Path({str(lock)!r}), wait_s=5):
            Path({str(lock)!r} + ".held").touch()
            time.sleep(600)
    """)


def test_a_live_holder_bounds_the_wait_and_a_killed_one_releases_at_once(tmp_path):
    lock = tmp_path / "build.lock"
    holder = holding(lock)
    try:
        wait_for(Path(f"{lock}.held").exists)
        told = []
        started = time.monotonic()
        with pytest.raises(LockTimeout, match=f"held by pid {holder.pid} after 0 s"):
            with exclusive(lock, wait_s=0.5, on_wait=told.append):
                pass
        assert 0.5 <= time.monotonic() - started < 5
        assert told == [str(holder.pid)]  # told once, with the holder's pid
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
        started = time.monotonic()
        with exclusive(lock, wait_s=30):  # the lock file is still there; the lock is not
            assert time.monotonic() - started < 1
    finally:
        holder.kill()
        holder.wait()


def test_a_build_killed_midway_leaves_nothing_used_and_the_next_build_completes(tmp_path):
    target = tmp_path / "thing"
    builder = python(f"""
        import time
        from pathlib import Path
        from worker.engine.disk_cache import build_once

        def build(scratch):
            (scratch / "half").write_text("written")
            time.sleep(600)

        build_once(Path({str(target)!r}), build, what="building the thing", wait_s=5)
    """)
    try:
        wait_for(lambda: any(tmp_path.glob(".tmp-thing-*/half")))
        os.kill(builder.pid, signal.SIGKILL)
        builder.wait()
    finally:
        builder.kill()
    assert not target.exists()  # the half-built directory was never published

    phases = []
    built = build_once(target, lambda scratch: (scratch / "whole").write_text("done"), what="building the thing",
                       wait_s=5, on_phase=phases.append)
    assert built == target and (target / "whole").read_text() == "done"
    assert phases == ["building the thing"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".thing.lock", "thing"]  # the leftovers are gone
    assert (target.stat().st_mode & 0o777) == 0o755  # readable by every user of the cache
    # Built once: a second call finds it and builds nothing.
    assert build_once(target, lambda scratch: pytest.fail("built twice"), what="x", wait_s=5) == target


def test_a_second_process_waits_for_the_first_build_and_uses_it(tmp_path):
    target = tmp_path / "thing"
    builder = python(f"""
        import time
        from pathlib import Path
        from worker.engine.disk_cache import build_once

        def build(scratch):
            (Path({str(tmp_path)!r}) / "started").touch()
            time.sleep(1)
            (scratch / "theirs").write_text("theirs")

        build_once(Path({str(target)!r}), build, what="building the thing", wait_s=5)
    """)
    try:
        wait_for((tmp_path / "started").exists)
        phases = []
        built = build_once(target, lambda scratch: pytest.fail("built twice"), what="building the thing",
                           wait_s=30, on_phase=phases.append)
        assert (built / "theirs").read_text() == "theirs"
        assert phases == [f"waiting for another process (pid {builder.pid}) building the thing"]
        assert builder.wait(timeout=30) == 0
    finally:
        builder.kill()


def test_a_failed_build_publishes_nothing(tmp_path):
    def crash(scratch):
        (scratch / "half").write_text("x")
        raise RuntimeError("compiler says no")

    with pytest.raises(RuntimeError, match="compiler says no"):
        build_once(tmp_path / "thing", crash, what="building the thing", wait_s=5)
    assert [p.name for p in tmp_path.iterdir()] == [".thing.lock"]


def test_a_broken_build_is_built_again_once_unless_another_process_did_it_first(tmp_path):
    def build(scratch: Path) -> None:
        (scratch / "lib.so").write_text(f"build {len(builds)}")
        builds.append(scratch)

    builds: list[Path] = []
    target = build_once(tmp_path / "thing", build, what="building", wait_s=5)
    (target / "lib.so").unlink()  # broken under the cache
    found = target.stat()
    assert rebuild(target, found, build, what="building", wait_s=5)
    assert (target / "lib.so").read_text() == "build 1" and len(builds) == 2
    assert not rebuild(target, found, build, what="building", wait_s=5), "the copy found broken is gone already"
    assert len(builds) == 2 and sorted(p.name for p in tmp_path.iterdir()) == [".thing.lock", "thing"]
