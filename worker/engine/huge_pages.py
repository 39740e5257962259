"""Large CPU buffers on transparent huge pages (2 MiB), where Linux offers them: the KV pool and the
packed weights of our GEMM.

Decode attention jumps from block to block of the pool; on 4 KiB pages every jump is a TLB miss and
the hardware prefetcher stops at each page's end. On a Zen 4, a pool advised this way made the decode
kernel 1.0-1.14x faster (python -m ops.bench_decode_attention's cases). A decode step streams every
layer's weights once (SmolLM2's: 212 MB in bf16, far past what the TLB maps on 4 KiB pages): see
linear.pack_linear_layers for what huge pages gave them. The advice must come before the
memory is first touched, so these buffers are allocated empty, advised, then filled. Where the kernel
has no transparent huge pages (or is not Linux) the buffer is simply on normal pages."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

import torch

log = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
MADV_HUGEPAGE = 14  # linux/mman.h


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros on the CPU, its whole 2 MiB pages advised for huge pages before they are touched."""
    tensor = torch.empty(shape, dtype=dtype)
    advise(tensor)
    return tensor.zero_()


def empty_side_by_side(shapes: list[torch.Size], dtype: torch.dtype) -> list[torch.Tensor]:
    """Empty CPU tensors of these shapes side by side in one buffer whose whole 2 MiB pages are advised for huge
    pages, each starting on a cache line: tensors smaller than a huge page (most of a small model's weights) share
    them, where each alone would get none. Fill them after."""
    line = max(1, 64 // dtype.itemsize)
    starts, end = [], 0
    for shape in shapes:
        starts.append(end)
        end += -(-shape.numel() // line) * line
    buffer = torch.empty(end, dtype=dtype)
    advise(buffer)
    return [buffer[start:start + shape.numel()].view(shape) for start, shape in zip(starts, shapes)]


def advise(tensor: torch.Tensor) -> bool:
    """madvise(MADV_HUGEPAGE) over the whole huge pages inside the tensor's memory; False where none fit or
    the system refuses (the tensor stays usable either way)."""
    if not sys.platform.startswith("linux"):
        return False
    first = tensor.data_ptr()
    start = -(-first // HUGE_PAGE) * HUGE_PAGE
    end = (first + tensor.numel() * tensor.element_size()) // HUGE_PAGE * HUGE_PAGE
    if end <= start:
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), MADV_HUGEPAGE) != 0:
        log.debug("madvise(MADV_HUGEPAGE) refused: errno %d", ctypes.get_errno())
        return False
    return True
