"""python -m ops.bench_decode_attention: the native decode-attention kernel (paged_decode) against this
machine's read bandwidth, measured in the same run (issue 26).

A decode step's attention reads every running sequence's keys and values once, so its bound is the
memory's read bandwidth (a 256 MiB read, ops/roofline/peaks.py). For each case, one decode step's
attention over all the model's layers, each layer on a KV pool of its own as the engine allocates it:
  16 sequences of 600-1,800 tokens, and 64 of 100-600,
  with each sequence's blocks in order (as a prefill leaves them) or scattered over the pool (as the
  blocks that decode steps take one at a time end up, after many requests have come and gone),
in float32 and in bfloat16. Printed: ms per step, GB/s of KV read, and that as a share of the read
bandwidth. The kernel's output is checked against SDPA first.

    python -m ops.bench_decode_attention [--model random:smollm2] [--repeats 7]
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from rich.console import Console
from rich.table import Table

from ops.roofline.peaks import bandwidth
from ops.tool import run_tool, wide_console
from worker.engine import kernels
from worker.engine.attention import read_kv
from worker.engine.models import ModelInfo, allocate_kv_cache, random_model

CASES = ((16, 600, 1800), (64, 100, 600))  # sequences, shortest and longest context
BLOCK_SIZE = 16
SEED = 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ops.bench_decode_attention", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random:smollm2",
                        help="a random: spec, for its attention shapes (default random:smollm2)")
    parser.add_argument("--repeats", type=int, default=7, help="timed steps per case; the best counts")
    args = parser.parse_args(argv)
    console = wide_console(110)
    return run_tool("bench_decode_attention", lambda: measure(console, args), console)


def measure(console: Console, args: argparse.Namespace) -> None:
    if kernels.native() is None:
        raise ValueError("the native kernels are not available here (STREAMBATCH_NATIVE_KERNELS=0, or no build)")
    info = ModelInfo.from_model(random_model(args.model, device="meta"))
    read_gbps, _ = bandwidth()
    console.print(f"{args.model}: {info.num_layers} layers, {info.num_heads} heads, {info.num_kv_heads} KV heads "
                  f"of {info.head_dim}; read bandwidth {read_gbps:.1f} GB/s ({torch.get_num_threads()} threads)")
    table = Table("sequences", "context", "dtype", "blocks", "ms/step", "GB/s", "% of read bandwidth",
                  title="paged_decode, one decode step over all layers")
    for num_seqs, shortest, longest in CASES:
        for dtype in (torch.float32, torch.bfloat16):
            for scattered in (False, True):
                seconds, moved = time_case(info, num_seqs, shortest, longest, dtype, scattered, args.repeats)
                table.add_row(str(num_seqs), f"{shortest}-{longest}", str(dtype).removeprefix("torch."),
                              "scattered" if scattered else "in order", f"{seconds * 1e3:.1f}",
                              f"{moved / seconds / 1e9:.1f}", f"{moved / seconds / 1e9 / read_gbps:.0%}")
    console.print(table)


@torch.inference_mode()
def time_case(info: ModelInfo, num_seqs: int, shortest: int, longest: int, dtype: torch.dtype, scattered: bool,
              repeats: int) -> tuple[float, int]:
    """(best seconds of one step's attention over all layers, KV bytes it reads)."""
    rng = random.Random(SEED)
    lens = [rng.randint(shortest, longest) for _ in range(num_seqs)]
    counts = [-(-length // BLOCK_SIZE) for length in lens]
    num_blocks = 2 * sum(counts)  # half the pool in use: scattered blocks spread over all of it
    order = list(range(num_blocks))
    if scattered:
        rng.shuffle(order)
    tables = torch.zeros(num_seqs, max(counts), dtype=torch.long)
    taken = iter(order)
    for seq, count in enumerate(counts):
        tables[seq, :count] = torch.tensor([next(taken) for _ in range(count)])
    generator = torch.Generator().manual_seed(SEED)
    caches = allocate_kv_cache(info, num_blocks, BLOCK_SIZE, dtype)
    for k_cache, v_cache in caches:
        k_cache.copy_(torch.randn(k_cache.shape, generator=generator))
        v_cache.copy_(torch.randn(v_cache.shape, generator=generator))
    q = torch.randn(num_seqs, info.num_heads, info.head_dim, generator=generator).to(dtype)
    seq_lens, scale = torch.tensor(lens), info.head_dim ** -0.5
    check(q, *caches[0], tables, seq_lens, scale)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for k_cache, v_cache in caches:
            kernels.paged_decode(q, k_cache, v_cache, tables, seq_lens, scale, None)
        best = min(best, time.perf_counter() - start)
    moved = sum(lens) * info.kv_bytes_per_block(1, dtype)
    return best, moved


def check(q, k_cache, v_cache, tables, seq_lens, scale) -> None:
    """The kernel's output against SDPA over each sequence's gathered keys and values."""
    out = kernels.paged_decode(q, k_cache, v_cache, tables, seq_lens, scale, None)
    tolerance = 1e-4 if q.dtype == torch.float32 else 2e-2  # bf16: the output's own rounding
    for seq, length in enumerate(seq_lens.tolist()):
        k, v = read_kv(k_cache, v_cache, tables[seq:seq + 1], length, "native")
        want = torch.nn.functional.scaled_dot_product_attention(
            q[seq:seq + 1, :, None].float(), k.float(), v.float(), scale=scale, enable_gqa=True)[0, :, 0]
        error = (out[seq].float() - want).abs().max().item()
        if error > tolerance:
            raise ValueError(f"paged_decode differs from SDPA by {error:.3g} (sequence {seq}, {length} tokens)")


if __name__ == "__main__":
    raise SystemExit(main())
