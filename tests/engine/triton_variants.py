"""What Triton's runtime would compile for a launch, computed without a GPU.

`Launches` records every launch of triton_attention's kernels (run as usual, interpreted on CPU,
or not run at all). `variant` gives the key under which Triton's JIT caches a compiled kernel for a
launch's arguments (its specialization of each argument: type, value 1 or divisible by 16, pointer
alignment; its constexprs), as JITFunction.run computes it for an sm_90 target.

Run as `python -m tests.engine.triton_variants` (without TRITON_INTERPRET: the interpreter replaces
triton.language's functions, and a compile needs the real ones), it records the launches of
triton_attention.warm_up for Llama-3-8B's decode in bf16 on an H200's 132 multiprocessors without
running them, compiles each variant for sm_90 with the ptxas bundled with triton, and prints, as
JSON lines, each one's registers a thread and its global loads: 2-byte ones and cp.async copies.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass, field

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

from worker.engine import triton_attention

KERNELS = ("_attention_kernel", "_reduce_segments_kernel", "_write_kv_kernel")
SM90 = GPUTarget("cuda", 90, 32)


@dataclass
class Launch:
    name: str
    args: tuple
    kwargs: dict


@dataclass
class Launches:
    seen: list[Launch] = field(default_factory=list)
    run: bool = True  # launch the kernels too

    def install(self, monkeypatch) -> Launches:
        for name in KERNELS:
            monkeypatch.setattr(triton_attention, name, _Recording(name, getattr(triton_attention, name), self))
        return self


class _Recording:
    def __init__(self, name, kernel, launches: Launches) -> None:
        self.name, self.kernel, self.launches = name, kernel, launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.seen.append(Launch(self.name, args, kwargs))
            if self.launches.run:
                self.kernel[grid](*args, **kwargs)
        return launch


def _jit(name: str) -> JITFunction:
    kernel = getattr(triton_attention, name)
    if isinstance(kernel, _Recording):
        kernel = kernel.kernel
    if isinstance(kernel, JITFunction):
        return kernel
    return JITFunction(kernel.fn, **kernel.kwargs)  # an InterpretedFunction keeps the decorator's options


def _bind(launch: Launch):
    jit, backend = _jit(launch.name), make_backend(SM90)
    bound, specialization, options = create_function_from_signature(jit.signature, jit.params, backend)(
        *launch.args, **launch.kwargs)
    return jit, backend, bound, specialization, options


def variant(launch: Launch) -> tuple:
    _, _, _, specialization, _ = _bind(launch)
    return launch.name, str(specialization)


def compile_sm90(launch: Launch) -> tuple[str, int]:
    """-> (PTX, registers a thread) of the variant the launch would compile (not interpreted)."""
    jit, backend, bound, specialization, options = _bind(launch)
    _, signature, constexprs, attrs = jit._pack_args(backend, launch.kwargs, bound, specialization, options)
    compiled = triton.compile(ASTSource(jit, signature, constexprs, attrs), target=SM90)
    with tempfile.TemporaryDirectory() as scratch:
        cubin = os.path.join(scratch, "kernel.cubin")
        with open(cubin, "wb") as file:
            file.write(compiled.asm["cubin"])
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        usage = subprocess.run([tool, "--dump-resource-usage", cubin], capture_output=True, text=True,
                               check=True).stdout
    return compiled.asm["ptx"], int(re.search(r"REG:(\d+)", usage).group(1))


def main() -> None:
    import pytest
    import torch

    from worker.engine.attention import kv_cache_shapes

    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(triton_attention, "multiprocessors", lambda device: 132)
        launches = Launches(run=False).install(monkeypatch)
        k_shape, v_shape = kv_cache_shapes(4, 16, 8, 128, "triton")
        triton_attention.warm_up(torch.zeros(k_shape, dtype=torch.bfloat16),
                                 torch.zeros(v_shape, dtype=torch.bfloat16), 32, None)
    for launch in launches.seen:
        ptx, registers = compile_sm90(launch)
        print(json.dumps({"kernel": launch.name, "segments": launch.kwargs.get("NUM_SEGMENTS"),
                          "registers": registers, "cp_async": ptx.count("cp.async."),
                          "two_byte_loads": len(re.findall(r"ld\.global(?:\.\w+)*\.[bu]16\s", ptx))}))


if __name__ == "__main__":
    main()
