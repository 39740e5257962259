"""Extension: a real C++ build killed with SIGKILL in the middle of compiling, then loaded by the
next process, and built again once its library is deleted from the cache; builds keyed by what
they are built from; and the kernels' fallback, with one warning, when another process's build
outlasts the wait."""

import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path


from worker.engine import extension, kernels
from worker.engine.disk_cache import exclusive
from worker.engine.extension import Extension

ROOT = Path(__file__).resolve().parents[2]
# pybind11 alone (not torch/extension.h) keeps the compile to a few seconds.
SOURCE = """
#include <pybind11/pybind11.h>
int add_one(int x) { return x + 1; }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("add_one", &add_one); }
"""


def load_in_a_process(source: Path, cache: Path, **popen) -> subprocess.Popen:
    code = f"""
        from pathlib import Path
        from worker.engine.extension import Extension
        module = Extension("sb_test_add_one", (Path({str(source)!r}),)).load()
        print("loaded", module.add_one(41))
    """
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, text=True,
                            env=os.environ | {"STREAMBATCH_CACHE": str(cache)}, stdout=subprocess.PIPE, **popen)


def test_a_build_killed_while_compiling_does_not_block_the_next_load(tmp_path):
    source = tmp_path / "add_one.cpp"
    source.write_text(SOURCE)
    cache = tmp_path / "cache"
    # Its own process group, so the kill takes ninja and the compiler too, as `docker kill` would.
    first = load_in_a_process(source, cache, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not any((cache / "kernels").glob(".tmp-sb_test_add_one-*/build.ninja")):
            assert first.poll() is None and time.monotonic() < deadline, "the build did not start"
            time.sleep(0.05)
        time.sleep(1)  # the compiler is running now (it takes several seconds)
        assert first.poll() is None, "the build finished before it could be killed"
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    assert not list((cache / "kernels").glob("sb_test_add_one-*")), "a half build was published"

    second = load_in_a_process(source, cache)
    out, _ = second.communicate(timeout=240)
    assert second.returncode == 0 and out.strip() == "loaded 42"
    names = sorted(p.name for p in (cache / "kernels").iterdir())
    assert len(names) == 2 and names[0].startswith(".sb_test_add_one-") and names[0].endswith(".lock")
    assert names[1].startswith("sb_test_add_one-")  # the killed build's scratch directory is gone
    third = load_in_a_process(source, cache)  # loads the build, builds nothing
    assert third.communicate(timeout=60)[0].strip() == "loaded 42"

    [build] = (cache / "kernels").glob("sb_test_add_one-*")
    (build / "sb_test_add_one.so").unlink()  # a cache cleaner took the library, left the directory
    fourth = load_in_a_process(source, cache, stderr=subprocess.PIPE)
    out, err = fourth.communicate(timeout=240)
    assert fourth.returncode == 0 and out.strip() == "loaded 42", err
    assert "does not load" in err and "building it again" in err
    assert (build / "sb_test_add_one.so").is_file()  # built again, in the same place, once
    assert sorted(p.name for p in (cache / "kernels").iterdir()) == names


def test_builds_are_keyed_by_sources_and_flags(tmp_path, monkeypatch):
    monkeypatch.setenv("STREAMBATCH_CACHE", str(tmp_path))
    source = tmp_path / "add_one.cpp"
    source.write_text(SOURCE)
    plain = Extension("sb_key", (source,))
    assert plain.build_dir.parent == tmp_path / "kernels" and not plain.is_built
    assert Extension("sb_key", (source,), cflags=("-O3",)).build_dir != plain.build_dir
    before = plain.build_dir
    source.write_text(SOURCE + "// changed\n")
    assert plain.build_dir != before  # a stale build is never loaded for new sources


def test_kernels_fall_back_with_one_warning_when_another_build_outlasts_the_wait(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("STREAMBATCH_CACHE", str(tmp_path))
    monkeypatch.setattr(kernels, "_native", kernels._UNSET)  # restored to the loaded kernels afterwards
    monkeypatch.setattr(extension, "BUILD_WAIT_S", 0.5)
    target = kernels.kernels_extension().build_dir
    lock = target.with_name(f".{target.name}.lock")
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from pathlib import Path
        from worker.engine.disk_cache import exclusive
        with exclusive(Path({str(lock)!r}), wait_s=5):
            Path({str(tmp_path)!r}, "held").touch()
            time.sleep(600)
    """)], cwd=ROOT)
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "held").exists():
            assert time.monotonic() < deadline
            time.sleep(0.02)
        phases = []
        with caplog.at_level(logging.WARNING, logger="worker.engine.kernels"):
            assert kernels.native(phases.append) is None
            assert kernels.native() is None  # decided once
        warnings = [record.getMessage() for record in caplog.records]
        assert len(warnings) == 1 and "using the torch paths" in warnings[0]
        assert f"held by pid {holder.pid}" in warnings[0]
        assert phases == [f"waiting for another process (pid {holder.pid}) building {target.name.rsplit('-', 1)[0]} "
                          f"({len(kernels.kernels_extension().sources)} C++ files)"]
    finally:
        holder.kill()
        holder.wait()
    with exclusive(lock, wait_s=1):  # and nothing of ours still holds it
        pass
