"""The model forward compiled with torch.compile (opt-in: EngineConfig.compile).

In eager mode a decode step of a small model spends much of its time in transformers' Python
and in many tiny ops per layer (norms, rotary embedding, activations, residual adds): SmolLM2's
16-row decode step here spent ~26 of ~90 ms there. Compiled, the whole forward is one graph:
those ops fused into a few generated kernels per layer, our GEMM and paged attention called as
operators (torch.ops.streambatch.*), no per-module Python.

One graph serves every step: the token and row counts are unbacked sizes (no recompile for a
new batch size, nor for 0 or 1 rows), and guards on the model's modules are skipped (~2 ms a
step): the runner never changes the model after compiling it. Without those guards dynamo would
serve any model of the same class from the first one's graph, so each compiled forward passes a
key of its own, a string, which dynamo does guard. Attention's metadata cannot be a graph input
(plain Python data); the operator reads it from attention.step_metadata.

Measured here (SmolLM2-135M fp32, 16-row decode steps of ~350-token contexts, 2 threads, A/B in
one process): eager 112-132 ms, compiled 75-105 ms. Compiling takes 3.5 minutes on 2 cores with a
cold cache, 25 s once torch's on-disk cache holds it; so it is not the default. That cache goes
under ours (compile_cache_dir), not torch's default in /tmp, which a reboot or a container's tmpfs
empties: a restarted worker finds it.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from typing import Callable

import torch
from torch._dynamo.decorators import mark_unbacked
from torch._inductor.runtime.cache_dir_utils import default_cache_dir

from worker.engine.attention import AttentionMetadata, model_logits, step_metadata
from worker.engine.disk_cache import cache_dir

_keys = itertools.count()


def _keyed_logits(key: str, model: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
                  logits_rows: torch.Tensor, kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    if not key:  # reading the key is what makes dynamo guard on its value
        raise ValueError("a compiled forward needs its model's key")
    return model_logits(model, input_ids, position_ids, logits_rows, kv_caches=kv_caches)


def compile_cache_dir() -> Path:
    """Where torch keeps what it compiled: TORCHINDUCTOR_CACHE_DIR where chosen, else (and from now on) inductor/
    in our cache directory, which lasts as long as the converted model and the native kernels; torch's default
    where that cannot be written (a read-only image). Torch writes its default into the variable on first use
    (an import of ours does), so that value counts as not chosen."""
    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if chosen is None or os.path.abspath(chosen) == os.path.abspath(default_cache_dir()):
        lasting = cache_dir() / "inductor"
        try:
            lasting.mkdir(parents=True, exist_ok=True)
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(lasting)
        except OSError:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = default_cache_dir()
    return Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])


def compile_forward(model: torch.nn.Module) -> Callable[[torch.Tensor, AttentionMetadata], torch.Tensor]:
    """-> forward(input_ids [T], meta) -> logits [rows, vocab], as attention.run_model; compiled
    on its first call, its code kept in compile_cache_dir."""
    compile_cache_dir()
    key = f"model-{next(_keys)}"
    options = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
    if next(model.parameters()).device.type == "cpu":
        options["cpp_wrapper"] = True  # the graph's calls from C++, not Python: 15 -> 6 ms a step (SmolLM2)
    compiled = torch.compile(_keyed_logits, fullgraph=True, options=options)

    def forward(input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        input_ids, positions, rows = input_ids[None], meta.positions[None], meta.logits_rows
        for tensor, dim in ((input_ids, 1), (positions, 1), (rows, 0)):
            mark_unbacked(tensor, dim)
        with step_metadata(meta):
            return compiled(key, model, input_ids, positions, rows, meta.kv_caches)

    return forward
