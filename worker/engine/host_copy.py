"""Copies between the host and a GPU that never make the host wait, and one wait per step to read back.

A copy from pageable host memory (a tensor built from a Python list) blocks the host until the
device has it, behind whatever the stream is still doing: a hidden sync that serializes the host's
work for the next step with the device's for this one. From pinned memory, copied with
non_blocking=True, the host goes on at once (torch keeps the pinned block from reuse until the copy
has run). The other way, the sampled tokens (and logprobs) are copied into pinned memory together
and read after one synchronize: the step's one sync. On the CPU all of it is a no-op.
"""

from __future__ import annotations

import traceback
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch


def pinned_if_cuda(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    return host.pin_memory() if device.type == "cuda" else host


def to_device(device: torch.device, *host: torch.Tensor) -> list[torch.Tensor]:
    """Host tensors on `device`, in one copy per dtype: same-dtype tensors are flattened into one
    pinned buffer, and each comes back as a view of its part."""
    if device.type != "cuda":
        return [tensor.to(device) for tensor in host]
    out: list[torch.Tensor | None] = [None] * len(host)
    for dtype in dict.fromkeys(tensor.dtype for tensor in host):
        chosen = [i for i, tensor in enumerate(host) if tensor.dtype == dtype]
        flat = torch.cat([host[i].reshape(-1) for i in chosen]).pin_memory().to(device, non_blocking=True)
        for i, part in zip(chosen, flat.split([host[i].numel() for i in chosen])):
            out[i] = part.view(host[i].shape)
    return out


def values_to_device(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A Python list as a tensor on `device`, without a blocking copy."""
    return to_device(device, torch.tensor(values, dtype=dtype))[0]


def to_host(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Device tensors on the host, after a single wait for the device."""
    if not tensors or tensors[0].device.type != "cuda":
        return [tensor.cpu() for tensor in tensors]
    host = [torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True) for tensor in tensors]
    for target, tensor in zip(host, tensors):
        target.copy_(tensor, non_blocking=True)
    torch.cuda.current_stream(tensors[0].device).synchronize()
    return host


@contextmanager
def counting_syncs() -> Iterator[list[list[str]]]:
    """Inside the block, one entry per time the host waited for a CUDA device: what
    torch.cuda.set_sync_debug_mode("warn") warns about (blocking copies, .item(), .tolist(),
    nonzero, synchronize), each as the Python frames that led to it ("file:line", innermost last)."""
    previous_mode = torch.cuda.get_sync_debug_mode()
    syncs: list[list[str]] = []

    def record(message, category, filename, lineno, file=None, line=None) -> None:
        if "synchroniz" in str(message):
            syncs.append([f"{frame.filename}:{frame.lineno}" for frame in traceback.extract_stack()[:-1]
                          if frame.filename != warnings.__file__])

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the first switch of the mode waits for the device itself: not counted
        torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record  # catch_warnings puts the previous one back
        try:
            yield syncs
        finally:
            torch.cuda.set_sync_debug_mode(previous_mode)
