"""huge_pages.py: the CPU KV pool is advised for transparent huge pages (the kernel records the advice
as the mapping's "hg" flag in /proc/self/smaps), and stays zero-filled and usable. (No unadvised control
tensor: in a process that ran other tests, malloc may hand it memory an earlier pool had advised.)"""

import sys
from pathlib import Path

import pytest
import torch

from worker.engine import huge_pages
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


def test_a_buffer_smaller_than_a_huge_page_is_left_as_it_is():
    small = huge_pages.zeros((1000,), torch.float32)
    assert not huge_pages.advise(small) and not small.any()
