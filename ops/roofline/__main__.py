"""python -m ops.roofline: this machine's roofline, and each step of a run of our engine against it (issue 26).

First the peaks, measured here (peaks.py): for float32, and for bfloat16 where the CPU computes it natively
(avx512_bf16 / AMX), the best GFLOP/s of a GEMM at the model's own linear shapes for chunks of 64-2,048 rows,
over torch's F.linear and the engine's PackedLinear; and the memory bandwidth of a 256 MiB read and copy.
Then one of ops/bench_offline.py's workloads, every request at once, greedy, EOS ignored:
  mixed  64 requests, prompts of 20-200 tokens
  long   48 requests, 16 of them with prompts of 600-1,800 tokens
  chat   96 requests, 60% of them after one shared system prompt
(max_tokens 16, 64 or 256) through our engine twice, each time on a fresh KV pool: once plain, for each
step's time, and once with each step's parts timed (steps.py), for where it goes; the difference is the
timing's overhead.
The peaks' best GEMM and the bandwidth are measured again after the runs, to show how far the machine's
speed moved meanwhile (these machines are shared). Each step's FLOPs and bytes come from the model's geometry
(costs.py); the steps are classed prefill-heavy, mixed or decode, and each class gets its GFLOP/s and GB/s
against the peaks, its share of the roofline, its linear layers' own GFLOP/s against the GEMM peak, and
where its time went: linear layers, attention, sampling, the model's other ops and the host (report.py).

    python -m ops.roofline [--model smollm2-135m] [--dtype float32|bfloat16] [--workload mixed|long|chat]
                           [--quick] [--json FILE] [--plot FILE]

--quick: a quarter of the requests and of their output tokens, chunks of 64 and 512 rows, two timed calls
per GEMM: about 30 s on random:smollm2 and 7 s on random:llama (2 cores; the full mixed run on the bundled
model takes 90 s). The forward runs eager (a compiled one has no seams to time); prompts longer than the
model's context keep their end.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from rich.console import Console

from ops.bench_offline import WORKLOADS, synthetic_workload, workload
from ops.roofline import peaks as machine
from ops.roofline.costs import Geometry, step_json, summarize
from ops.roofline.report import classes_table, peaks_table, plot, split_table
from ops.roofline.steps import StepClock, pair, run, warm_up
from ops.tool import run_tool, wide_console
from worker.config import DEFAULT_MODEL
from worker.engine.config import EngineConfig
from worker.engine.engine import Engine
from worker.engine.models import parse_dtype

QUICK_SHARE = 4  # --quick: a quarter of the requests, each a quarter of the output tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ops.roofline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"any model the worker takes, random:smollm2 included (default {DEFAULT_MODEL})")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--workload", default="mixed", choices=tuple(WORKLOADS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a check's run: see above")
    parser.add_argument("--token-budget", type=int, help="the engine's tokens per step (default the engine's)")
    parser.add_argument("--max-num-seqs", type=int, help="the engine's cap on running sequences (default none)")
    parser.add_argument("--num-blocks", type=int, help="the KV pool, in blocks (default the engine's, 2 GiB)")
    parser.add_argument("--json", type=Path, help="write every figure here, each step's included")
    parser.add_argument("--plot", type=Path, help="write the plot here (PNG)")
    args = parser.parse_args(argv)
    console = wide_console(175)
    return run_tool("roofline", lambda: measure(console, args), console)


def measure(console: Console, args: argparse.Namespace) -> None:
    options = {"dtype": args.dtype, "compile": False, "truncate": "left", "token_budget": args.token_budget,
               "max_num_seqs": args.max_num_seqs, "num_blocks": args.num_blocks}
    config = EngineConfig.from_options(args.model, **{k: v for k, v in options.items() if v is not None})
    console.print(f"loading {args.model} ({args.dtype})")
    engine = Engine(config)
    requests = requests_for(engine, args.workload, args.seed, args.quick)
    threads = torch.get_num_threads()
    console.print(f"measuring this machine's peaks ({threads} threads)")
    peaks = machine.measure(machine.linear_shapes(engine.model), machine.dtypes_to_measure(parse_dtype(args.dtype)),
                            args.quick)
    console.print(peaks_table(peaks, threads))

    prompt_tokens, tokens = sum(len(ids) for ids, _ in requests), sum(max_tokens for _, max_tokens in requests)
    console.print(f"running the {args.workload} workload: {len(requests)} requests, "
                  f"{prompt_tokens:,} prompt tokens, {tokens:,} output tokens; "
                  "once plain, once timed by parts")
    warm_up(engine)
    with StepClock(engine, by_parts=False) as clock:
        plain_s, plain_steps = run(engine, requests, clock)
    # A fresh KV pool on the same model: nothing of the first run in the prefix cache.
    engine = Engine(config, model=engine.model, tokenizer=engine.tokenizer)
    with StepClock(engine) as clock:
        timed_s, timed_steps = run(engine, requests, clock)
    steps = pair(plain_steps, timed_steps)
    geometry = Geometry.of(engine)
    summary = summarize(steps, geometry, peaks.gemm_gflops(args.dtype), peaks.bandwidth_gbps)
    console.print(classes_table(summary, args.dtype, peaks))
    console.print(split_table(summary))
    overhead = timed_s / plain_s - 1
    console.print(f"{tokens / timed_s:,.1f} output tokens/s timed by parts, {tokens / plain_s:,.1f} plain: the "
                  f"timing's overhead {overhead:+.1%} ({timed_s:.2f} s against {plain_s:.2f} s)")
    gemm_after, bandwidth_after = machine.recheck(peaks, parse_dtype(args.dtype), args.quick)
    gemm_before = peaks.gemm_gflops(args.dtype)
    console.print(f"the peaks again after the runs: GEMM {gemm_after:,.0f} GFLOP/s ({gemm_after / gemm_before:.0%} of "
                  f"before), bandwidth {bandwidth_after:,.1f} GB/s ({bandwidth_after / peaks.bandwidth_gbps:.0%} of before); "
                  "the shares above hold only as far as these stayed near 100%")
    figures = {"model": args.model, "dtype": args.dtype, "workload": args.workload, "quick": args.quick,
               "threads": threads, "requests": len(requests), "prompt_tokens": prompt_tokens,
               "output_tokens": tokens,
               "engine": {"token_budget": config.scheduler.token_budget, "max_num_seqs": config.scheduler.max_num_seqs,
                          "num_blocks": engine.num_blocks},
               "peaks": peaks.as_json(), "peaks_after": {"gemm_gflops": gemm_after, "bandwidth_gbps": bandwidth_after},
               "geometry": vars(geometry),
               "seconds": {"plain": plain_s, "timed": timed_s, "overhead": overhead},
               "classes": summary, "steps": [step_json(step, geometry) for step in steps]}
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(figures, indent=2))
    if args.plot is not None:
        console.print(f"[bold]plot:[/] {plot(steps, summary, geometry, args.dtype, peaks, args.plot)}")


def requests_for(engine: Engine, kind: str, seed: int, quick: bool) -> list[tuple[list[int], int]]:
    count = WORKLOADS[kind] // QUICK_SHARE if quick else None
    requests = (workload(engine.tokenizer, seed, count, kind) if engine.tokenizer is not None
                else synthetic_workload(engine.info.vocab_size, seed, count, kind))
    if quick:
        requests = [(ids, max(1, max_tokens // QUICK_SHARE)) for ids, max_tokens in requests]
    return requests


if __name__ == "__main__":
    raise SystemExit(main())
