"""The engine's options: one struct, the same names as the worker's flags."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from worker.engine.scheduler_config import SchedulerConfig

# What serves a step's cache writes and attention (attention.py): the C++ decode kernels (CPU),
# gather + SDPA, or the Triton kernels for the whole step (triton_attention.py).
AttentionBackend = Literal["native", "torch", "triton"]


class EngineConfig(msgspec.Struct, forbid_unknown_fields=True):
    model: str = "smollm2-135m"
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU (models.parse_dtype)
    device: str = "cpu"
    block_size: int = 16
    num_blocks: int | None = None  # overrides kv_cache_memory
    # Bytes of K and V for all layers, on each tensor-parallel rank. None: on CUDA what is free once the
    # model is loaded, less a headroom (models.kv_cache_memory); on the CPU 2 GiB.
    kv_cache_memory: int | None = None
    enable_prefix_caching: bool = True
    compile: bool = False  # torch.compile the model forward (compiled.py): faster steps, a minute to compile
    attention_backend: AttentionBackend | None = None  # None: attention.default_backend(device)
    # Decode steps of up to this many sequences replay CUDA graphs (cuda_graphs.py; triton backend); 0: never
    cuda_graph_max_seqs: int = 256
    max_model_len: int | None = None  # None: the model's own
    truncate: Literal["reject", "left"] = "reject"  # an over-long prompt: refuse it, or keep its end
    max_step_failures: int = 2  # failed steps a request may be part of before it is ended as poison
    tensor_parallel: int = 1  # ranks (one process and device each) the model is split across (parallel.py)
    scheduler: SchedulerConfig = msgspec.field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.max_step_failures < 1:
            raise ValueError(f"max_step_failures must be >= 1, got {self.max_step_failures}")
        if self.cuda_graph_max_seqs < 0:
            raise ValueError(f"cuda_graph_max_seqs must be >= 0, got {self.cuda_graph_max_seqs}")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")
        if self.tensor_parallel < 1:
            raise ValueError(f"tensor_parallel must be >= 1, got {self.tensor_parallel}")
        kind, _, index = self.device.partition(":")  # no torch here: the worker's --help loads none
        if self.tensor_parallel > 1 and index:
            raise ValueError(f"tensor_parallel ranks take devices 0..{self.tensor_parallel - 1} of those visible: "
                             f"give the device type ({kind}), not {self.device}")

    @classmethod
    def from_options(cls, model: str, **options: Any) -> EngineConfig:
        """Flat keyword options (as `LLM(model, **options)` and the CLI take them) -> config."""
        scheduler_fields = set(SchedulerConfig.__struct_fields__) - {"max_model_len"}
        engine_fields = set(cls.__struct_fields__) - {"scheduler", "model"}
        unknown = set(options) - scheduler_fields - engine_fields
        if unknown:
            raise TypeError(f"unknown option(s) {sorted(unknown)}; known: {sorted(engine_fields | scheduler_fields)}")
        scheduler = SchedulerConfig(**{k: v for k, v in options.items() if k in scheduler_fields})
        return cls(model=model, scheduler=scheduler, **{k: v for k, v in options.items() if k in engine_fields})
