"""The worker's configuration: one msgspec Struct, from CLI flags and STREAMBATCH_* variables.

Precedence: the flag, then its variable (`--token-budget` <- STREAMBATCH_TOKEN_BUDGET), then
the default. The engine flags are generated from EngineConfig and SchedulerConfig fields and
go through `EngineConfig.from_options`, so they carry the engine's own names and checks.
"""

from __future__ import annotations

import argparse
import os
import socket
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import msgspec

from producer.protocol import DEFAULT_REPLAY_TTL_S, has_password
from worker.engine.config import EngineConfig
from worker.engine.scheduler_config import SchedulerConfig

ENV_PREFIX = "STREAMBATCH_"
DEFAULT_MODEL = EngineConfig().model  # (EngineConfig.model, on the class, is msgspec's field descriptor)


def default_name() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


# No turn of the loop legitimately takes this long: a blocking read waits at most 1 s, a failed
# turn at most 5 s, a Redis reply 10 s, and an engine step is one token budget's work: seconds, a
# minute on a slow CPU or a first compile.
DEFAULT_STALL_TIMEOUT_S = 300.0


class WorkerConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    engine: EngineConfig = msgspec.field(default_factory=EngineConfig)
    redis_url: str = "redis://localhost:6379/0"
    redis_cluster: bool = False  # the URL names a node of a Redis Cluster (producer/connect.py)
    redis_password_file: str | None = None
    name: str = msgspec.field(default_factory=default_name)
    prefix: str = "sb"
    metrics_port: int | None = None  # 0 picks a free port
    metrics_host: str = "127.0.0.1"
    threads: int | None = None  # torch threads; None keeps torch's default
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    drain_timeout: float = 30.0
    heartbeat_interval: float = 2.0
    reclaim_idle_ms: int = 30_000
    max_deliveries: int = 3
    intake_ahead: int = 8
    replay_maxlen: int = 10_000
    replay_ttl: int = DEFAULT_REPLAY_TTL_S
    stall_timeout: float = DEFAULT_STALL_TIMEOUT_S
    dead_letter_ttl: int = 7 * 24 * 3600
    pin_prefix: list[str] = msgspec.field(default_factory=list)  # text prefixes kept in the KV cache

    def __post_init__(self) -> None:
        checks = [
            (bool(self.name.strip()), "name must not be empty"),
            (self.heartbeat_interval > 0, f"heartbeat_interval must be > 0, got {self.heartbeat_interval}"),
            (self.reclaim_idle_ms >= 3000 * self.heartbeat_interval,
             f"reclaim_idle_ms ({self.reclaim_idle_ms}) must be at least 3 heartbeat intervals, or "
             "live workers would take each other's requests"),
            (self.drain_timeout >= 0, f"drain_timeout must be >= 0, got {self.drain_timeout}"),
            (self.max_deliveries >= 1, f"max_deliveries must be >= 1, got {self.max_deliveries}"),
            (self.intake_ahead >= 1, f"intake_ahead must be >= 1, got {self.intake_ahead}"),
            (self.replay_ttl >= 1, f"replay_ttl must be >= 1 s, got {self.replay_ttl}"),
            (self.stall_timeout > self.heartbeat_interval,
             f"stall_timeout ({self.stall_timeout}) must exceed heartbeat_interval ({self.heartbeat_interval})"),
            (self.dead_letter_ttl >= 1, f"dead_letter_ttl must be >= 1 s, got {self.dead_letter_ttl}"),
            (self.threads is None or self.threads >= 1, f"threads must be >= 1, got {self.threads}"),
            (self.metrics_port is None or 0 <= self.metrics_port <= 65535,
             f"metrics_port must be in [0, 65535], got {self.metrics_port}"),
        ]
        problems = [message for ok, message in checks if not ok]
        if problems:
            raise ValueError("invalid worker config: " + "; ".join(problems))

    @property
    def heartbeat_ttl_ms(self) -> int:
        """The heartbeat key outlives a missed beat by a few seconds."""
        return int((self.heartbeat_interval + 3) * 1000)

    @property
    def block_ms(self) -> int:
        """How long an idle worker's blocking read waits: short enough to keep beating."""
        return max(1, int(min(self.heartbeat_interval / 2, 1.0) * 1000))


WORKER_FLAGS = {
    "redis_url": "Redis URL",
    "redis_cluster": "the URL names a node of a Redis Cluster",
    "redis_password_file": "a file holding the Redis password (a compose secret: /run/secrets/redis_worker_password), "
                           "in place of one in the URL",
    "name": "this worker's name, unique among live workers: its heartbeat key, and its consumer in the group "
            "with a suffix new at every start (default: host-pid)",
    "prefix": "key prefix shared with the producers",
    "metrics_port": "serve /metrics (Prometheus), /healthz and /readyz on this port (0: any free port)",
    "metrics_host": "the address the metrics port listens on: this machine only by default; 0.0.0.0 in a "
                    "container, for Prometheus to scrape it over the network",
    "threads": "torch threads",
    "log_level": "debug, info, warning or error",
    "drain_timeout": "seconds SIGTERM lets running requests finish before handing the rest back",
    "heartbeat_interval": "seconds between heartbeats, in-flight refreshes, reclaims and cancel sweeps",
    "reclaim_idle_ms": "take over another worker's request once its entry is idle this long",
    "max_deliveries": "dead-letter a request given to more workers than this (each past the first because "
                      "its holder looked dead)",
    "intake_ahead": "requests kept waiting in the engine; more stay in Redis for idle workers",
    "replay_maxlen": "approximate cap on a request's replay stream (must hold all its events)",
    "replay_ttl": "seconds a finished request's events stay readable",
    "stall_timeout": "seconds without a completed turn of the loop (a hung step) after which /healthz says stuck "
                     "and the worker exits, status 70, so that its restart policy acts and its requests are "
                     "reclaimed",
    "dead_letter_ttl": "seconds a dead letter is kept (the stream is also capped at 100,000 entries)",
}
ENGINE_FLAGS = {"dtype": "float32, bfloat16 (bf16) or float16 (fp16); auto is bfloat16 on CUDA, float32 on CPU",
                "kv_cache_memory": "bytes of K and V for all layers (per rank); None: on CUDA what is free once the "
                                   "model is loaded less 10%% of the device's memory, on the CPU 2 GiB",
                "itl_slo_ms": "a ceiling on running requests' inter-token latency, in ms: a step with decodes takes "
                              "only the prefill tokens that the engine's step cost model, fitted at start-up and "
                              "while serving, says keep it under (the fast lane's first)",
                "compile": "torch.compile the model forward. It pays on some CPUs and not on others (SmolLM2-135M, "
                           "2 cores, mixed, long and chat work): on a Zen 5 compiled ran 1.1-1.3x eager's tokens/s "
                           "in fp32 and 1.2-1.5x in bf16, on a Zen 4 0.89-1.05x in fp32 and 0.90-1.07x in bf16, on an "
                           "AVX2-only Zen 3 0.99-1.18x in fp32, on an "
                           "AMX Xeon 0.91-0.98x in fp32 and 1.11-1.28x in bf16 (a bf16 model's float32 norms and "
                           "activations are what it fuses); measure with "
                           "ops.bench_vs_vllm --modes eager,compiled. The first start compiles for about 2.5 "
                           "minutes, a restart finds the compiled code in 20 s (kept in inductor/ of the streambatch "
                           "cache unless TORCHINDUCTOR_CACHE_DIR says otherwise) against 8 s eager",
                "tensor_parallel": "split the model across this many ranks, one process and device each (rank r on "
                                   "cuda:r); --kv-cache-memory is per rank"}
ENGINE_OPTIONS: dict[str, msgspec.structs.FieldInfo] = {
    field.name: field for struct, skip in ((EngineConfig, {"model", "scheduler"}), (SchedulerConfig, {"max_model_len"}))
    for field in msgspec.structs.fields(struct) if field.name not in skip
}


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m worker", description="Serve an LLM from Redis lane streams.",
                                     epilog=f"Every flag can also come from {ENV_PREFIX}<NAME>, "
                                            f"e.g. {ENV_PREFIX}TOKEN_BUDGET.")
    parser.add_argument("--model", help=f"model name or path (default {DEFAULT_MODEL})")
    defaults = {field.name: field.default for field in msgspec.structs.fields(WorkerConfig)}
    for name, description in WORKER_FLAGS.items():
        default = defaults[name] if name != "name" else None
        action = argparse.BooleanOptionalAction if isinstance(default, bool) else "store"
        parser.add_argument(flag(name), action=action,
                            help=description + (f" (default {default})" if default is not None else ""))
    parser.add_argument(flag("pin_prefix"), action="append", metavar="TEXT",
                        help="keep this text prefix (tokenized as a prompt is) in the KV cache, never evicted; "
                             "repeatable, one from the variable. Pins for every worker, chat system prompts "
                             "included: `python -m producer pin`")
    engine = parser.add_argument_group("engine options (see worker/engine/config.py)")
    for name, field in ENGINE_OPTIONS.items():
        action = argparse.BooleanOptionalAction if field.type is bool else "store"
        described = f"{ENGINE_FLAGS[name]}; " if name in ENGINE_FLAGS else ""
        engine.add_argument(flag(name), action=action, help=f"{described}default {field.default}")
    return parser


def parse_config(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> WorkerConfig:
    """Flags, then variables, then defaults; exits with a usage message on a bad value."""
    parser = build_parser()
    environ = os.environ if environ is None else environ
    flags = vars(parser.parse_args(argv))
    raw: dict[str, Any] = {}
    for name, value in flags.items():
        value = value if value is not None else environ.get(ENV_PREFIX + name.upper())
        if name == "pin_prefix" and isinstance(value, str):
            value = [value]  # the variable holds one pin
        if value is not None:
            raw[name] = value
    model = raw.pop("model", DEFAULT_MODEL)
    try:
        engine_options = {name: _engine_option(name, raw.pop(name)) for name in list(raw) if name in ENGINE_OPTIONS}
        engine = EngineConfig.from_options(model, **engine_options)
        return msgspec.convert(raw | {"engine": engine}, WorkerConfig, strict=False)
    except (msgspec.ValidationError, ValueError) as error:
        parser.error(str(error))


def password_on_command_line(argv: Sequence[str] | None = None) -> bool:
    """Whether --redis-url, given as a flag, carries a password (which `ps` shows)."""
    url = build_parser().parse_known_args(argv)[0].redis_url
    return url is not None and has_password(url)


def _engine_option(name: str, value: Any) -> Any:
    try:
        return msgspec.convert(value, ENGINE_OPTIONS[name].type, strict=False)
    except msgspec.ValidationError as error:
        raise ValueError(f"{flag(name)}: {error}") from None
