"""python -m worker.prepare: do once per machine what a worker's first start would otherwise do,
so that no worker (and no test) waits on it: build the native kernels, and convert the bundled
model from its GGUF. `make setup` runs it; so will an image build. Each line says what was built,
where, and how long it took; a second run finds everything cached and says so.

    python -m worker.prepare [--model smollm2-135m]   (--model '' skips the model)
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from worker.engine.disk_cache import Phase


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worker.prepare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="the model to convert if it is the bundled one")
    args = parser.parse_args(argv)
    from worker.engine import kernels, models

    extension = kernels.kernels_extension()
    _timed("native kernels", lambda on_phase: extension.build_dir if kernels.native(on_phase) else None,
           extension.is_built)
    if args.model == models.SMOLLM2_NAME:
        _timed(f"model {args.model}", models.smollm2_cache, models.smollm2_cache_dir().is_dir())
    return 0


def _timed(what: str, make: Callable[[Phase], Path | None], cached: bool) -> None:
    started = time.monotonic()
    path = make(lambda phase: print(f"{what}: {phase} ...", flush=True))
    took = time.monotonic() - started
    if path is None:
        print(f"{what}: not available; workers will use the torch paths (see the warning above)", flush=True)
    else:
        print(f"{what}: {'cached' if cached else f'ready in {took:.0f} s'} at {path}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
