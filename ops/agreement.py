"""python -m ops.agreement: greedy tokens and throughput of our engine in two dtypes, side by side in one run.

    python -m ops.agreement [--dtype bfloat16] [--against float32] [--workloads mixed,long,chat]
                            [--model smollm2-135m] [--first 32] [--json F]

For each workload kind of ops/bench_offline.py (mixed, long prompts, chat with a shared system
prompt), the engine runs every request greedily, EOS ignored, once in each dtype (each in its own
process: the dtypes' packed weights and kernels do not share memory or warm caches), and the table
gives output tokens/s of each and their ratio, and how far the tokens agree, two ways:
- free-running: the share of each request's first --first tokens that are the same before the two
  runs first differ (after one token differs the contexts differ, so later positions are not
  compared), its mean and minimum over the requests, and how many requests agree on all of them;
- teacher-forced: the share of those positions where the measured dtype's greedy choice, given the
  reference's tokens before it, is the reference's token (the measured engine resumes after each
  difference with the reference's token), and at the positions where it is not, how close a call
  the reference itself made there: the logprob gap between its two most likely tokens.
The issue's bar for bf16: at least 95% of the first 32 tokens of each request.

--dtype bf16-weights measures what bf16's weights alone cost: float32 arithmetic throughout (activations, KV
cache, GEMM inputs), with every weight rounded to bf16 first; bf16 arithmetic cannot agree more than this
(beyond the draw of which near-ties its rounding happens to flip).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from ops.bench_offline import WORKLOADS, synthetic_workload, workload
from ops.tool import choices, run_tool, wide_console
from producer.protocol import SamplingParams


def agreement(reference: list[int], other: list[int], first: int) -> float:
    """The share of `reference`'s first `first` tokens that `other` matches before the two first differ."""
    wanted = reference[:first]
    if not wanted:
        raise ValueError("nothing to compare: the reference has no tokens")
    same = next((i for i, (a, b) in enumerate(zip(wanted, other)) if a != b), min(len(wanted), len(other)))
    return same / len(wanted)


def free_running(reference: dict[str, list[int]], other: dict[str, list[int]], first: int) -> dict:
    """agreement() of every request's outputs (by id) against the reference's: its mean and minimum, and how
    many requests agree on all of their first `first` tokens."""
    shares = [agreement(tokens, other[request_id], first) for request_id, tokens in reference.items()]
    return {"requests": len(shares), "mean": sum(shares) / len(shares), "min": min(shares),
            "all_same": sum(share == 1.0 for share in shares)}


def run_requests(engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list]:
    """Every request through the engine at once -> its outputs' tokens (or logprobs, where asked for) by id."""
    outputs: dict[str, list] = {request_id: [] for request_id in requests}
    for request_id, (ids, params) in requests.items():
        engine.add_request(request_id, prompt_ids=ids, params=params)
    while engine.has_unfinished:
        for output in engine.step():
            wants_logprobs = requests[output.request_id][1].logprobs
            outputs[output.request_id] += output.logprobs if wants_logprobs else output.token_ids
    return outputs


def greedy(max_tokens: int, logprobs: int | None = None) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=logprobs)


def top_two_margins(engine, prompts: list[list[int]], first: int) -> dict[str, list[float]]:
    """For each request, the gap in logprob between this engine's two most likely tokens at each of its first
    `first` greedy positions: how close a call each token was."""
    runs = run_requests(engine, {f"r{i}": (ids, greedy(first, logprobs=2)) for i, ids in enumerate(prompts)})
    return {request_id: [token.top[0].logprob - token.top[1].logprob for token in tokens]
            for request_id, tokens in runs.items()}


def differences(engine, prompts: list[list[int]], reference: dict[str, list[int]], first: int) -> dict[str, list[int]]:
    """Teacher-forced agreement: the positions among each request's first `first` reference tokens where this
    engine's greedy choice, given the reference's tokens before it, is another token. Between two differences
    this engine's own tokens are the reference's, so it runs free there: a request takes one round per
    difference, each round resuming right after the last difference with the reference's token."""
    found: dict[str, list[int]] = {request_id: [] for request_id in reference}
    starts = {request_id: 0 for request_id, tokens in reference.items() if tokens}
    while starts:
        runs = run_requests(engine, {
            f"{request_id}@{start}": (prompts[int(request_id[1:])] + reference[request_id][:start],
                                      greedy(len(reference[request_id][:first]) - start))
            for request_id, start in starts.items()})
        resumed = {}
        for request_id, start in starts.items():
            wanted = reference[request_id][start:first]
            at = next((i for i, (a, b) in enumerate(zip(wanted, runs[f"{request_id}@{start}"])) if a != b), None)
            if at is not None:
                found[request_id].append(start + at)
                if at + 1 < len(wanted):
                    resumed[request_id] = start + at + 1
        starts = resumed
    return found


WEIGHTS_ONLY = "bf16-weights"  # a --dtype: float32 with its weights rounded to bf16 (round_weights_to_bf16)


def round_weights_to_bf16(model: torch.nn.Module) -> None:
    """Every parameter of a float32 model rounded to its nearest bf16 value, kept in float32."""
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(parameter.to(torch.bfloat16))


def run_engine(model: str, dtype: str, kind: str, count: int | None, seed: int, first: int,
               reference: dict[str, list[int]] | None = None, margins: bool = False, compile: bool = False) -> dict:
    """Every request of one workload through the engine -> output token ids by request, tokens/s; then, asked
    for `margins`, the top-two margins of each request's first tokens, and given the reference's outputs, where
    its greedy choices differ from the reference's tokens (differences)."""
    from worker.engine.config import EngineConfig
    from worker.engine.engine import Engine
    from worker.engine.models import load_model

    config = EngineConfig.from_options(model, dtype="float32" if dtype == WEIGHTS_ONLY else dtype, compile=compile)
    if dtype == WEIGHTS_ONLY:
        loaded, tokenizer = load_model(config.model, config.dtype, config.device)
        round_weights_to_bf16(loaded)
        engine = Engine(config, loaded, tokenizer)
    else:
        engine = Engine(config)
    tokenizer = engine.tokenizer
    requests = (workload(tokenizer, seed, count, kind) if tokenizer is not None
                else synthetic_workload(engine.model.config.vocab_size, seed, count, kind))
    run_requests(engine, {"warm-up": (requests[0][0], greedy(2))})
    started = time.perf_counter()
    outputs = run_requests(engine, {f"r{i}": (ids, greedy(max_tokens)) for i, (ids, max_tokens) in enumerate(requests)})
    seconds = time.perf_counter() - started
    prompts = [ids for ids, _ in requests]
    result = {"outputs": outputs, "tokens": sum(map(len, outputs.values())), "seconds": seconds,
              "dtype": dtype if dtype == WEIGHTS_ONLY else str(engine.info.dtype).removeprefix("torch.")}
    if margins:
        result["margins"] = top_two_margins(engine, prompts, first)
    if reference is not None:
        result["differences"] = differences(engine, prompts, reference, first)
    return result


def run_child(model: str, dtype: str, kind: str, count: int | None, seed: int, first: int,
              reference: dict[str, list[int]] | None = None, margins: bool = False, compile: bool = False) -> dict:
    """run_engine in a process of its own (the reference's outputs handed over in a file)."""
    command = [sys.executable, "-m", "ops.agreement", "--child", "--model", model, "--dtype", dtype,
               "--workloads", kind, "--seed", str(seed), "--first", str(first)]
    command += ["--count", str(count)] if count else []
    command += ["--margins"] if margins else []
    command += ["--compile"] if compile else []
    with tempfile.NamedTemporaryFile("w", suffix=".json") as handed:
        if reference is not None:
            json.dump(reference, handed)
            handed.flush()
            command += ["--reference-outputs", handed.name]
        done = subprocess.run(command, capture_output=True, text=True)
    line = next((line for line in done.stdout.splitlines() if line.startswith("RESULT ")), None)
    if line is None:
        raise ValueError(f"the {dtype} run of the {kind} workload failed:\n{done.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def compare(reference: dict, other: dict, first: int) -> dict:
    """Free-running agreement (tokens matched before the first difference) and teacher-forced agreement (the
    share of positions whose greedy choice, after the reference's tokens, is the reference's), with the
    reference's top-two margin where they differ."""
    forced = [1 - len(other["differences"][request_id]) / len(tokens[:first])
              for request_id, tokens in reference["outputs"].items()]
    margins = sorted(reference["margins"][request_id][position]
                     for request_id, positions in other["differences"].items() for position in positions)
    return free_running(reference["outputs"], other["outputs"], first) | {
            "forced_mean": sum(forced) / len(forced), "forced_min": min(forced),
            "differences": len(margins), "margin_median": statistics.median(margins) if margins else None,
            "margin_max": margins[-1] if margins else None,
            "reference_tokens_per_s": reference["tokens"] / reference["seconds"],
            "tokens_per_s": other["tokens"] / other["seconds"]}


def measure(args: argparse.Namespace, console: Console) -> None:
    kinds = choices(args.workloads, WORKLOADS, "workload")
    figures = {}
    for kind in kinds:
        with console.status(f"{kind}: {args.against}"):
            reference = run_child(args.model, args.against, kind, args.count, args.seed, args.first, margins=True)
        with console.status(f"{kind}: {args.dtype}"):
            measured = run_child(args.model, args.dtype, kind, args.count, args.seed, args.first, reference["outputs"])
        figures[kind] = compare(reference, measured, args.first)
        console.print(f"{kind}: {args.against} {figures[kind]['reference_tokens_per_s']:.1f} tok/s, "
                      f"{args.dtype} {figures[kind]['tokens_per_s']:.1f} tok/s")
    table = Table("workload", "requests", f"{args.against} tok/s", f"{args.dtype} tok/s", "ratio",
                  f"first {args.first} tokens agreeing: mean / min", "requests all agreeing",
                  "teacher-forced: mean / min", f"differences ({args.against}'s top-2 margin: median / max)",
                  title=f"{args.model}: {args.dtype} against {args.against}, greedy, in one run")
    for kind, row in figures.items():
        margins = ("" if not row["differences"]
                   else f" ({row['margin_median']:.3f} / {row['margin_max']:.3f})")
        table.add_row(kind, str(row["requests"]), f"{row['reference_tokens_per_s']:.1f}", f"{row['tokens_per_s']:.1f}",
                      f"{row['tokens_per_s'] / row['reference_tokens_per_s']:.2f}x",
                      f"{row['mean']:.1%} / {row['min']:.1%}", f"{row['all_same']}/{row['requests']}",
                      f"{row['forced_mean']:.1%} / {row['forced_min']:.1%}", f"{row['differences']}{margins}")
    console.print(table)
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ops.agreement", description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="bfloat16",
                        help=f"the dtype measured, or {WEIGHTS_ONLY} (float32 with its weights rounded to bf16)")
    parser.add_argument("--against", default="float32", help="the reference dtype")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="of ops/bench_offline.py, comma-separated")
    parser.add_argument("--model", default="smollm2-135m", help="any model the worker takes")
    parser.add_argument("--first", type=int, default=32, help="tokens of each request compared")
    parser.add_argument("--count", type=int, help="requests per workload (default: the workload's own)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="the figures")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--reference-outputs", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--margins", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)  # the child's forward compiled
    args = parser.parse_args(argv)
    if args.child:
        random.seed(args.seed)
        reference = None if args.reference_outputs is None else json.loads(args.reference_outputs.read_text())
        print("RESULT " + json.dumps(run_engine(args.model, args.dtype, args.workloads, args.count, args.seed,
                                                args.first, reference, args.margins, args.compile)))
        return 0
    console = wide_console(150)
    return run_tool("agreement", lambda: measure(args, console), console)


if __name__ == "__main__":
    sys.exit(main())
