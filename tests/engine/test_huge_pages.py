"""huge_pages.py: the CPU KV pool and our GEMM's packed weights are advised for transparent huge pages (the
kernel records the advice as the mapping's "hg" flag in /proc/self/smaps), and stay usable: the pool
zero-filled, the weights computing as before. (No unadvised control tensor: in a process that ran other
tests, malloc may hand it memory an earlier pool had advised.)"""

import sys
from pathlib import Path

import pytest
import torch

from worker.engine import huge_pages, kernels
from worker.engine.linear import pack_linear_layers
from worker.engine.models import ModelInfo, allocate_kv_cache

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def mapping_flags(address: int) -> set[str]:
    """The VmFlags of the mapping of this process that holds `address`."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and head == "VmFlags:":
            return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not sys.platform.startswith("linux") or not THP.exists() or "[never]" in THP.read_text(),
                    reason="needs Linux with transparent huge pages")
def test_the_cpu_kv_pool_is_advised_for_huge_pages():
    info = ModelInfo(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64, vocab_size=10, max_model_len=4096,
                     eos_token_ids=(0,), dtype=torch.float32)
    caches = allocate_kv_cache(info, num_blocks=1024, block_size=16)  # 8 MiB per tensor
    for k_cache, v_cache in caches:
        for cache in (k_cache, v_cache):
            assert "hg" in mapping_flags(cache.data_ptr() + cache.nbytes // 2)
            assert not cache.any()


@pytest.mark.skipif(not sys.platform.startswith("linux") or not THP.exists() or "[never]" in THP.read_text(),
                    reason="needs Linux with transparent huge pages")
def test_our_gemm_s_packed_weights_share_huge_pages_and_compute_as_before():
    """Twelve layers of 1.3 MiB each, none a huge page alone: after pack_linear_layers their packed weights
    lie side by side in memory advised for huge pages (all but those in the buffer's partial first and last
    2 MiB), and the model's output is what it was."""
    if kernels.native() is None:
        pytest.fail("the native kernels did not build")
    model = torch.nn.Sequential(*(torch.nn.Linear(576, 576) for _ in range(12)))
    x = torch.randn(5, 576)
    expected = model(x)
    assert pack_linear_layers(model) == 12
    weights = [layer.packed_weight for layer in model]
    assert all(layer.native for layer in model)
    assert all(b.data_ptr() > a.data_ptr() for a, b in zip(weights, weights[1:]))
    for weight in weights[2:-2]:
        assert "hg" in mapping_flags(weight.data_ptr() + weight.nbytes // 2)
    torch.testing.assert_close(model(x), expected, atol=1e-4, rtol=1e-4)


def test_a_buffer_smaller_than_a_huge_page_is_left_as_it_is():
    small = huge_pages.zeros((1000,), torch.float32)
    assert not huge_pages.advise(small) and not small.any()
