"""A C++ extension of torch built once per machine and shared by its processes.

Builds live under $STREAMBATCH_CACHE/kernels, one directory per key of everything that makes a
build differ (sources, flags, torch, Python, the CPU's instruction set extensions, since the
flags may say -march=native): changed sources or another CPU get a build of their own, never a
stale one. disk_cache.build_once makes a build safe to kill midway and bounds the wait for
another process's build. torch's builder runs inside our private temporary directory, so its
own lock file can never block anyone else.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from worker.engine.disk_cache import Phase, build_once, cache_dir, quiet, rebuild

log = logging.getLogger(__name__)
BUILD_WAIT_S = float(os.environ.get("STREAMBATCH_BUILD_WAIT", 900))  # for another process's build


@dataclass(frozen=True)
class Extension:
    name: str
    sources: tuple[Path, ...]
    headers: tuple[Path, ...] = ()  # included by the sources: part of what a build is of
    cflags: tuple[str, ...] = ()
    ldflags: tuple[str, ...] = ()

    @property
    def build_dir(self) -> Path:
        """Where this machine's build lives (present once complete)."""
        digest = hashlib.sha256()
        for source in self.sources + self.headers:
            digest.update(source.read_bytes())
        digest.update(repr((self.cflags, self.ldflags, torch.__version__, sys.version_info[:2], _cpu_flags())).encode())
        return cache_dir() / "kernels" / f"{self.name}-{digest.hexdigest()[:16]}"

    @property
    def is_built(self) -> bool:
        return self.build_dir.is_dir()

    def load(self, on_phase: Phase = quiet, wait_s: float | None = None) -> ModuleType:
        """The imported module, built first if missing, and built again once if the build found
        does not load (its library deleted or damaged). Raises what the build or the import
        raised, or disk_cache.LockTimeout when another process's build took longer than `wait_s`
        (default BUILD_WAIT_S)."""
        target, built = self.build_dir, []
        wait_s = BUILD_WAIT_S if wait_s is None else wait_s
        what = f"building {self.name} ({len(self.sources)} C++ files)"
        started = time.monotonic()
        build_once(target, lambda scratch: built.append(self._compile(scratch)), wait_s=wait_s, what=what,
                   on_phase=on_phase)
        if not built:
            found = target.stat()
            try:
                return self._import(target)
            except ImportError as error:  # also what a missing or truncated library raises
                log.warning("the build at %s does not load (%s): building it again", target, error)
            if not rebuild(target, found, lambda scratch: built.append(self._compile(scratch)), wait_s=wait_s,
                           what=what, on_phase=on_phase):
                return self._import(target)  # another process built it again meanwhile
        log.info("built %s in %.0f s: %s", self.name, time.monotonic() - started, target)
        return built[0]

    def _import(self, target: Path) -> ModuleType:
        spec = importlib.util.spec_from_file_location(self.name, target / f"{self.name}.so")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    def _compile(self, scratch: Path) -> ModuleType:
        """Build and import the extension in `scratch`."""
        from torch.utils.cpp_extension import load

        if shutil.which("ninja") is None:  # pip's ninja, beside this interpreter, is on no PATH outside the venv
            os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
        return load(name=self.name, sources=[str(source) for source in self.sources], build_directory=str(scratch),
                    extra_cflags=list(self.cflags), extra_ldflags=list(self.ldflags))


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((line for line in cpuinfo if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""
