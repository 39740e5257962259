"""Where a step's time goes (ops/bench_gpu.py's "profile" section), as torch.profiler records it,
summed by kind (matrix products, attention, the rest) and by name, per step, beside the step's own
time. On a GPU: its kernels' device time, and what they leave of the step (launch gaps, the host);
on the CPU (the dry run): each op's own CPU time.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch
from rich.table import Table

TOP_KERNELS = 8
# Names, lower-cased: cuBLAS's and CUTLASS's matrix products and torch's and ours on the CPU; our
# Triton attention kernels and the CPU's attention op.
KINDS = (("matmul", ("gemm", "cutlass", "xmma", "nvjet", "gemv", "splitk", "addmm", "aten::mm", "bmm",
                     "packed_linear")),
         ("attention", ("_attention_kernel", "_reduce_segments_kernel", "_write_kv_kernel", "paged_attention",
                        "scaled_dot_product")))


def kind_of(kernel: str) -> str:
    name = kernel.lower()
    return next((kind for kind, marks in KINDS if any(mark in name for mark in marks)), "other")


def profile_steps(step: Callable[[], object], steps: int, step_s: float, device: torch.device) -> dict:
    """`step` run `steps` times under the profiler (after a warm-up call): each kernel's (or CPU op's)
    time per step, and each kind's; `step_s` is the step's own time, measured apart."""
    step()
    on_gpu = device.type == "cuda"
    activities = [torch.profiler.ProfilerActivity.CPU] + [torch.profiler.ProfilerActivity.CUDA] * on_gpu
    with torch.profiler.profile(activities=activities) as profiler:
        for _ in range(steps):
            step()
        if on_gpu:
            torch.cuda.synchronize(device)
    kernels: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])  # name -> [seconds, launches]
    for event in profiler.events():
        if on_gpu and event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name][0] += event.device_time_total / 1e6  # microseconds
            kernels[event.name][1] += 1
        elif not on_gpu and event.device_type == torch.autograd.DeviceType.CPU:
            kernels[event.name][0] += event.self_cpu_time_total / 1e6
            kernels[event.name][1] += 1
    kinds: dict[str, float] = defaultdict(float)
    for name, (seconds, _) in kernels.items():
        kinds[kind_of(name)] += seconds / steps
    busy_s = sum(kinds.values())
    top = sorted(kernels.items(), key=lambda item: -item[1][0])[:TOP_KERNELS]
    return {"step_s": step_s, "kernels_s": busy_s, "idle_share": max(0.0, 1 - busy_s / step_s),
            "launches_per_step": sum(launches for _, launches in kernels.values()) / steps,
            "kinds": {kind: {"seconds": seconds, "share": seconds / step_s} for kind, seconds in kinds.items()},
            "top": [{"kernel": name, "kind": kind_of(name), "seconds": seconds / steps,
                     "share": seconds / steps / step_s, "launches": launches / steps}
                    for name, (seconds, launches) in top]}


def profile_table(title: str, profile: dict) -> Table:
    table = Table(title=f"{title}: {profile['step_s'] * 1e3:.2f} ms a step, kernels "
                        f"{profile['kernels_s'] * 1e3:.2f} ms ({profile['launches_per_step']:.0f} launches), "
                        f"idle {profile['idle_share']:.0%}")
    for column in ("kernel", "kind", "ms a step", "share of the step", "launches a step"):
        table.add_column(column, justify="right")
    for kind, figures in sorted(profile["kinds"].items(), key=lambda item: -item[1]["seconds"]):
        table.add_row(f"all {kind}", kind, f"{figures['seconds'] * 1e3:.3f}", f"{figures['share']:.1%}", "")
    for row in profile["top"]:
        table.add_row(row["kernel"][:70], row["kind"], f"{row['seconds'] * 1e3:.3f}", f"{row['share']:.1%}",
                      f"{row['launches']:g}")
    return table
