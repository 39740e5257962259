"""Offline throughput, side by side in one run, on the same model, dtype and threads.

Workload: 64 requests, chat-templated prompts of 20-200 tokens, max_tokens 16 (half),
64 (a quarter) and 256 (a quarter), EOS ignored, fixed seed. Systems:
  ours           our engine, continuous policy, forward compiled (as vLLM's CPU build runs)
  ours-eager     the same, forward not compiled (the engine's default: no compile wait)
  ours-static    our engine, static policy, batches of 16, forward compiled
  hf-static      HF generate, static batches of 16, left-padded
  hf-single      HF generate, one request at a time
  hf-cb          transformers' continuous batching (init_continuous_batching)
Each system runs in its own subprocess (clean peak RSS, no shared state); the table gives
output tokens/s, the ratio to hf-static, peak RSS, and for our engine the KV utilisation
at peak and the share of this machine's roofline at the batch size reached.

    python -m ops.bench_offline [--dtype float32|bfloat16] [--systems ours,hf-static,...] [--rounds N]

With --rounds N every system runs N times, the systems taking turns (the machine's speed
drifts over minutes): the table gives each system's median run, the median of the per-round
ratios to hf-static, and the range of its runs.
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import subprocess
import sys
import time

import torch

SYSTEMS = ("ours", "ours-eager", "ours-static", "hf-static", "hf-single", "hf-cb")
WORDS = ("time data river model light stone music garden window paper city mountain story "
         "engine question answer market energy planet signal memory bridge winter coffee").split()


# How many requests each workload kind has (requests_of).
WORKLOADS = {"mixed": 64, "long": 48, "chat": 96}
LONG_PROMPT_TOKENS = (600, 1800)  # a third of the long workload's prompts; the rest 20-200 tokens
CHAT_SHARED_SHARE = 0.6  # of the chat workload's requests start with the same system prompt
SYSTEM_PROMPT_LENGTH = 200  # that system prompt's words (or ids, without a tokenizer)
WORD_BY_WORD_TOKENS = 256  # a prompt's last tokens added a word at a time (see workload)


def output_lengths(rng: random.Random, count: int) -> list[int]:
    """max_tokens 16 (half), 64 (a quarter) and 256 (the rest), shuffled."""
    lengths = [16] * (count // 2) + [64] * (count // 4) + [256] * (count - count // 2 - count // 4)
    rng.shuffle(lengths)
    return lengths


def requests_of(kind: str, rng: random.Random, count: int | None, prompt) -> list[tuple[list[int], int]]:
    """(prompt ids, max_tokens) pairs of a workload kind: mixed (prompts of 20-200 tokens), long (a third of
    them 600-1,800 tokens) or chat (60% after one shared system prompt); `count` (default WORKLOADS[kind])
    requests, max_tokens from output_lengths. `prompt(rng, tokens, shared)` makes the ids: at least `tokens`
    of them, after the system prompt when `shared`."""
    if kind not in WORKLOADS:
        raise ValueError(f"unknown workload {kind!r}: choose from {', '.join(WORKLOADS)}")
    count = WORKLOADS[kind] if count is None else count
    lengths = output_lengths(rng, count)
    long = set(rng.sample(range(count), count // 3)) if kind == "long" else set()
    shared = set(rng.sample(range(count), round(CHAT_SHARED_SHARE * count))) if kind == "chat" else set()
    requests = []
    for i, max_tokens in enumerate(lengths):
        tokens = rng.randint(*LONG_PROMPT_TOKENS) if i in long else rng.randint(20, 200)
        requests.append((prompt(rng, tokens, i in shared), max_tokens))
    return requests


def workload(tokenizer, seed: int = 0, count: int | None = None, kind: str = "mixed") -> list[tuple[list[int], int]]:
    """(prompt ids, max_tokens) pairs (requests_of), chat-templated prompts of random words."""
    words_rng = random.Random(seed + 1)
    system = " ".join(words_rng.choice(WORDS) for _ in range(SYSTEM_PROMPT_LENGTH))

    def render(words: list[str], shared: bool) -> list[int]:
        messages = [{"role": "system", "content": system}] if shared else []
        messages.append({"role": "user", "content": " ".join(words)})
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)

    system_tokens = len(render([], True))

    def prompt(rng: random.Random, tokens: int, shared: bool) -> list[int]:
        target, words = tokens + (system_tokens if shared else 0), []
        while len(ids := render(words, shared)) < target:
            # Words are a token or two: far from the target they go in by the hundred (a long prompt
            # is not tokenized once per word), the last WORD_BY_WORD_TOKENS one at a time.
            words += [rng.choice(WORDS) for _ in range(max(1, target - len(ids) - WORD_BY_WORD_TOKENS))]
        return list(ids)

    return requests_of(kind, random.Random(seed), count, prompt)


def synthetic_workload(vocab_size: int, seed: int = 0, count: int | None = None,
                       kind: str = "mixed") -> list[tuple[list[int], int]]:
    """The same shapes for a model without a tokenizer (a random one): random ids, the shared system
    prompt SYSTEM_PROMPT_LENGTH fixed ones."""
    ids_rng = random.Random(seed + 1)
    system = [ids_rng.randrange(vocab_size) for _ in range(SYSTEM_PROMPT_LENGTH)]

    def prompt(rng: random.Random, tokens: int, shared: bool) -> list[int]:
        return (system if shared else []) + [rng.randrange(vocab_size) for _ in range(tokens)]

    return requests_of(kind, random.Random(seed), count, prompt)


def run_ours(model_name: str, dtype: str, requests, policy: str, compile: bool) -> dict:
    from ops.roofline.peaks import linear_shapes
    from producer.protocol import SamplingParams
    from worker.engine.config import EngineConfig
    from worker.engine.engine import Engine

    options = {"dtype": dtype, "policy": policy, "compile": compile}
    if policy == "static":
        options["max_num_seqs"] = 16
    # Start-up and a warm-up request outside the timing (the native kernels build on first use,
    # the forward compiles when the engine starts), as for HF.
    started = time.perf_counter()
    engine = Engine(EngineConfig.from_options(model_name, **options))
    engine.add_request("warm-up", prompt_ids=requests[0][0], params=SamplingParams(max_tokens=2, ignore_eos=True))
    while engine.has_unfinished:
        engine.step()
    start_up = time.perf_counter() - started
    started = time.perf_counter()
    for i, (ids, max_tokens) in enumerate(requests):
        engine.add_request(f"r{i}", prompt_ids=ids,
                           params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    tokens, steps, peak = 0, [], None  # steps: (tokens computed, rows sampled)
    while engine.has_unfinished:
        outputs = engine.step()
        sampled = sum(len(o.token_ids) for o in outputs)
        tokens += sampled
        steps.append((engine.last_step_tokens, sampled))
        stats = engine.pool.stats(engine.scheduler.running)
        if peak is None or stats.used > peak.used:
            peak = stats
    elapsed = time.perf_counter() - started
    return {"tokens": tokens, "seconds": elapsed, "mean_batch": sum(s for _, s in steps) / len(steps),
            "kv_utilisation_at_peak": peak.kv_utilisation, "peak_blocks": peak.used, "steps": steps,
            "weights": linear_weights(engine.model), "shapes": linear_shapes(engine.model),
            "dtype_bytes": engine.info.dtype.itemsize,  # the weights' (a bf16 model on the CPU computes in float32)
            "start_up_seconds": start_up}


def linear_weights(model) -> dict:
    """Matmul weights (embedding lookups cost no FLOPs): the layers', and the lm_head's."""
    from worker.engine.linear import PackedLinear

    head = model.get_output_embeddings()
    layers = sum(m.in_features * m.out_features for m in model.modules()
                 if isinstance(m, (torch.nn.Linear, PackedLinear)) and m is not head)
    return {"layers": layers, "head": head.in_features * head.out_features}


def load_hf(dtype: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from worker.engine.models import parse_dtype, smollm2_cache

    path = smollm2_cache()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=parse_dtype(dtype), attn_implementation="sdpa")
    tokenizer = AutoTokenizer.from_pretrained(path)
    return model.eval(), tokenizer


@torch.inference_mode()
def run_hf(dtype: str, requests, batch_size: int) -> dict:
    model, tokenizer = load_hf(dtype)
    model.generate(input_ids=torch.tensor([requests[0][0]]), max_new_tokens=2, pad_token_id=0)  # warm-up
    started, tokens = time.perf_counter(), 0
    for first in range(0, len(requests), batch_size):
        batch = requests[first:first + batch_size]
        width = max(len(ids) for ids, _ in batch)
        input_ids = torch.tensor([[0] * (width - len(ids)) + ids for ids, _ in batch])
        attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids, _ in batch])
        model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                       max_new_tokens=max(m for _, m in batch), eos_token_id=None, pad_token_id=0)
        tokens += sum(m for _, m in batch)  # useful tokens; the rest of each row is waste
    return {"tokens": tokens, "seconds": time.perf_counter() - started}


@torch.inference_mode()
def run_hf_cb(dtype: str, requests) -> dict:
    from transformers import ContinuousBatchingConfig, GenerationConfig

    model, tokenizer = load_hf(dtype)
    generation = GenerationConfig(do_sample=False, max_new_tokens=256, eos_token_id=None, pad_token_id=0)
    config = ContinuousBatchingConfig(num_blocks=128, max_batch_tokens=512)  # pages of 256 tokens
    manager = model.init_continuous_batching(generation_config=generation, continuous_batching_config=config)
    manager.start()
    started, tokens = time.perf_counter(), 0
    for i, (ids, max_tokens) in enumerate(requests):
        manager.add_request(input_ids=ids, request_id=f"r{i}", max_new_tokens=max_tokens)
    for _ in requests:
        result = manager.get_result(timeout=600)
        if result is None or result.error:
            raise RuntimeError(f"transformers continuous batching failed: {result and result.error}")
        tokens += len(result.generated_tokens)
    elapsed = time.perf_counter() - started
    manager.stop()
    return {"tokens": tokens, "seconds": elapsed}


def roofline(weights: dict, dtype_bytes: int, steps: list, tokens: int, peaks, dtype: torch.dtype) -> dict:
    """The best this machine could do on the steps our engine actually ran: each step reads
    every weight once and does 2 x weights FLOPs per computed token (lm_head: per sampled
    row); whichever of memory and compute is slower bounds the step (attention ignored).
    `peaks`: ops.roofline.peaks.measure's, at the model's own GEMM shapes."""
    from ops.roofline.peaks import dtype_name

    flops, bandwidth = peaks.gemm_gflops(dtype_name(dtype)) * 1e9, peaks.bandwidth_gbps * 1e9
    weight_bytes = (weights["layers"] + weights["head"]) * dtype_bytes
    best = sum(max(weight_bytes / bandwidth, 2 * (weights["layers"] * computed + weights["head"] * sampled) / flops)
               for computed, sampled in steps)
    return {"gflops": flops / 1e9, "gbps": bandwidth / 1e9, "tokens_per_s": tokens / best}


def child(system: str, dtype: str, seed: int) -> None:
    from transformers import AutoTokenizer

    from ops.roofline.peaks import measure as measure_peaks
    from worker.engine.models import parse_dtype, smollm2_cache

    torch.manual_seed(seed)
    requests = workload(AutoTokenizer.from_pretrained(smollm2_cache()), seed)
    if system.startswith("ours"):
        result = run_ours("smollm2-135m", dtype, requests, "static" if system == "ours-static" else "continuous",
                          compile=system != "ours-eager")
        peaks = measure_peaks(result.pop("shapes"), [parse_dtype(dtype)], quick=True)
        result["roofline"] = roofline(result["weights"], result["dtype_bytes"], result.pop("steps"),
                                      result["tokens"], peaks, parse_dtype(dtype))
    elif system == "hf-cb":
        result = run_hf_cb(dtype, requests)
    else:
        result = run_hf(dtype, requests, 1 if system == "hf-single" else 16)
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps(result))


def run_child(system: str, dtype: str, seed: int) -> dict | None:
    """One system in a fresh subprocess -> its result, or None (reported) if it failed."""
    out = subprocess.run([sys.executable, "-m", "ops.bench_offline", "--child", system, "--dtype", dtype,
                          "--seed", str(seed)], capture_output=True, text=True)
    line = next((l for l in out.stdout.splitlines() if l.startswith("RESULT ")), None)
    if line is None:
        print(f"{system} failed:\n{out.stderr[-3000:]}", file=sys.stderr)
        return None
    result = json.loads(line[len("RESULT "):])
    print(f"{system}: {result['tokens'] / result['seconds']:.1f} tok/s", file=sys.stderr)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.dtype, args.seed)

    from rich.console import Console
    from rich.table import Table

    from worker.engine.models import smollm2_cache
    smollm2_cache()  # convert the bundled model once, before any timing
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    systems = args.systems.split(",")
    for system in systems:
        if system not in SYSTEMS:
            parser.error(f"unknown system {system!r}; choose from {SYSTEMS}")
    runs: dict[str, list[dict | None]] = {system: [] for system in systems}  # per round, None where it failed
    for _ in range(args.rounds):
        for system in systems:
            runs[system].append(run_child(system, args.dtype, args.seed))
    rate = lambda r: r["tokens"] / r["seconds"]  # noqa: E731
    table = Table(title=f"Offline throughput, SmolLM2-135M {args.dtype}, {torch.get_num_threads()} threads, "
                        f"64 requests, {args.rounds} round(s)")
    for column in ("system", "output tok/s", "x hf-static", "runs tok/s", "peak RSS MB", "notes"):
        table.add_column(column, justify="right")
    for system, results in runs.items():
        done = sorted((r for r in results if r is not None), key=rate)
        if not done:
            continue
        r = done[len(done) // 2]  # the median run
        ratios = [rate(ours) / rate(base) for ours, base in zip(results, runs.get("hf-static", []))
                  if ours is not None and base is not None]
        ratio = f"{statistics.median(ratios):.2f}" if ratios else "-"
        notes = ""
        if "roofline" in r:
            roof = r["roofline"]
            notes = (f"start-up {r['start_up_seconds']:.0f} s, mean batch {r['mean_batch']:.1f}, "
                     f"KV use at peak {r['kv_utilisation_at_peak']:.1%}; "
                     f"roofline {roof['tokens_per_s']:.0f} tok/s ({roof['gflops']:.0f} GFLOP/s, "
                     f"{roof['gbps']:.0f} GB/s): {rate(r) / roof['tokens_per_s']:.0%} of it")
        table.add_row(system, f"{rate(r):.1f}", ratio, f"{rate(done[0]):.1f}-{rate(done[-1]):.1f}",
                      f"{r['peak_rss_mb']:.0f}", notes)
    Console(width=200).print(table)


if __name__ == "__main__":
    main()
