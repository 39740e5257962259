"""python -m ops.agreement: greedy tokens and throughput of our engine in two dtypes, side by side in one run.

    python -m ops.agreement [--dtype bfloat16] [--against float32] [--workloads mixed,long,chat]
                            [--model smollm2-135m] [--first 32] [--json F]

For each workload kind of ops/bench_offline.py (mixed, long prompts, chat with a shared system
prompt), the engine runs every request greedily, EOS ignored, once in each dtype (each in its own
process: the dtypes' packed weights and kernels do not share memory or warm caches), and the table
gives output tokens/s of each and their ratio, and how far the tokens agree: the share of each
request's first --first tokens that are the same before the two runs first differ (after one token
differs the contexts differ, so later positions are not compared), its mean and minimum over the
requests, and how many requests agree on all of them. The issue's bar for bf16: at least 95% of the
first 32 tokens of each request.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ops.bench_offline import WORKLOADS, synthetic_workload, workload
from ops.tool import run_tool


def agreement(reference: list[int], other: list[int], first: int) -> float:
    """The share of `reference`'s first `first` tokens that `other` matches before the two first differ."""
    wanted = reference[:first]
    if not wanted:
        raise ValueError("nothing to compare: the reference has no tokens")
    same = next((i for i, (a, b) in enumerate(zip(wanted, other)) if a != b), min(len(wanted), len(other)))
    return same / len(wanted)


def run_engine(model: str, dtype: str, kind: str, count: int | None, seed: int) -> dict:
    """Every request of one workload through the engine -> output token ids by request, tokens/s."""
    from producer.protocol import SamplingParams
    from worker.engine.config import EngineConfig
    from worker.engine.engine import Engine

    engine = Engine(EngineConfig.from_options(model, dtype=dtype))
    tokenizer = engine.tokenizer
    requests = (workload(tokenizer, seed, count, kind) if tokenizer is not None
                else synthetic_workload(engine.model.config.vocab_size, seed, count, kind))
    engine.add_request("warm-up", prompt_ids=requests[0][0], params=SamplingParams(max_tokens=2, ignore_eos=True))
    while engine.has_unfinished:
        engine.step()
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(requests))}
    started = time.perf_counter()
    for i, (ids, max_tokens) in enumerate(requests):
        engine.add_request(f"r{i}", prompt_ids=ids,
                           params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished:
        for output in engine.step():
            outputs[output.request_id] += output.token_ids
    seconds = time.perf_counter() - started
    return {"outputs": outputs, "tokens": sum(map(len, outputs.values())), "seconds": seconds,
            "dtype": str(engine.model.dtype).removeprefix("torch.")}


def run_child(model: str, dtype: str, kind: str, count: int | None, seed: int) -> dict:
    command = [sys.executable, "-m", "ops.agreement", "--child", "--model", model, "--dtype", dtype,
               "--workloads", kind, "--seed", str(seed)] + (["--count", str(count)] if count else [])
    done = subprocess.run(command, capture_output=True, text=True)
    line = next((line for line in done.stdout.splitlines() if line.startswith("RESULT ")), None)
    if line is None:
        raise ValueError(f"the {dtype} run of the {kind} workload failed:\n{done.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def compare(reference: dict, other: dict, first: int) -> dict:
    shares = [agreement(tokens, other["outputs"][request_id], first)
              for request_id, tokens in reference["outputs"].items()]
    return {"requests": len(shares), "mean": sum(shares) / len(shares), "min": min(shares),
            "all_same": sum(share == 1.0 for share in shares),
            "reference_tokens_per_s": reference["tokens"] / reference["seconds"],
            "tokens_per_s": other["tokens"] / other["seconds"]}


def measure(args: argparse.Namespace, console: Console) -> None:
    kinds = args.workloads.split(",")
    for kind in kinds:
        if kind not in WORKLOADS:
            raise ValueError(f"unknown workload {kind!r}: choose from {', '.join(WORKLOADS)}")
    figures = {}
    for kind in kinds:
        runs = {}
        for dtype in (args.against, args.dtype):
            with console.status(f"{kind}: {dtype}"):
                runs[dtype] = run_child(args.model, dtype, kind, args.count, args.seed)
            console.print(f"{kind}: {dtype} {runs[dtype]['tokens'] / runs[dtype]['seconds']:.1f} tok/s")
        figures[kind] = compare(runs[args.against], runs[args.dtype], args.first)
    table = Table("workload", "requests", f"{args.against} tok/s", f"{args.dtype} tok/s", "ratio",
                  f"first {args.first} tokens agreeing: mean / min", "requests all agreeing",
                  title=f"{args.model}: {args.dtype} against {args.against}, greedy, in one run")
    for kind, row in figures.items():
        table.add_row(kind, str(row["requests"]), f"{row['reference_tokens_per_s']:.1f}", f"{row['tokens_per_s']:.1f}",
                      f"{row['tokens_per_s'] / row['reference_tokens_per_s']:.2f}x",
                      f"{row['mean']:.1%} / {row['min']:.1%}", f"{row['all_same']}/{row['requests']}")
    console.print(table)
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ops.agreement", description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="bfloat16", help="the dtype measured")
    parser.add_argument("--against", default="float32", help="the reference dtype")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="of ops/bench_offline.py, comma-separated")
    parser.add_argument("--model", default="smollm2-135m", help="any model the worker takes")
    parser.add_argument("--first", type=int, default=32, help="tokens of each request compared")
    parser.add_argument("--count", type=int, help="requests per workload (default: the workload's own)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="the figures")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        random.seed(args.seed)
        print("RESULT " + json.dumps(run_engine(args.model, args.dtype, args.workloads, args.count, args.seed)))
        return 0
    return run_tool("agreement", lambda: measure(args, Console()), Console())


if __name__ == "__main__":
    sys.exit(main())
