"""streambatch worker: the engine and the service around it.

`from worker import LLM` is the offline API; it is loaded lazily so that the pure parts
(`worker.engine.scheduler`, `worker.engine.blocks`) import without torch.
"""

from typing import Any

__all__ = ["LLM"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from worker.llm import LLM
        return LLM
    raise AttributeError(f"module 'worker' has no attribute {name!r}")
