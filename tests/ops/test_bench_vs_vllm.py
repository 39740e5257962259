"""ops/bench_vs_vllm.py: our engine and vLLM on the same workloads. vLLM itself is not installed here: its
child (ops/vllm_child.py) runs against a stand-in `vllm` module that echoes each request's first prompt id."""

import json
import os
import sys
from types import SimpleNamespace

import pytest
from rich.console import Console

from ops.bench_offline import workload
from ops.bench_vs_vllm import (READY, compare, default_venv, main, model_directory, run_vllm, table_of,
                               vllm_dtype_agreement, vllm_environment, vllm_job, vllm_python, workloads_of)

FAKE_VLLM = '''
import json, os
from types import SimpleNamespace


class SamplingParams:
    def __init__(self, temperature, max_tokens, ignore_eos):
        assert temperature == 0.0 and ignore_eos
        self.max_tokens = max_tokens


class LLM:
    def __init__(self, **options):
        if not os.path.isdir(options["model"]):
            raise FileNotFoundError(f"no model at {options['model']}")
        self.log({"options": options, "bind": os.environ["VLLM_CPU_OMP_THREADS_BIND"],
                  "offline": os.environ["HF_HUB_OFFLINE"]})

    def log(self, entry):
        with open(os.environ["FAKE_VLLM_LOG"], "a") as log:
            log.write(json.dumps(entry) + "\\n")

    def generate(self, prompts, params, use_tqdm):
        params = params if isinstance(params, list) else [params] * len(prompts)
        self.log({"generate": len(prompts)})
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[prompt["prompt_token_ids"][0]] * p.max_tokens)])
                for prompt, p in zip(prompts, params)]
'''


@pytest.fixture
def fake_vllm(tmp_path, monkeypatch):
    """A venv whose python is ours with the stand-in `vllm` on its path -> (venv, the stand-in's log)."""
    (tmp_path / "fake").mkdir()
    (tmp_path / "fake" / "vllm.py").write_text(FAKE_VLLM)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "fake"))
    monkeypatch.setenv("FAKE_VLLM_LOG", str(tmp_path / "log"))
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    (venv / "bin" / "python").chmod(0o755)
    (venv / READY).write_text("")
    return venv, tmp_path / "log"


def logged(log):
    return [json.loads(line) for line in log.read_text().splitlines()]


def test_without_vllms_venv_the_error_names_the_setup_command(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("STREAMBATCH_CACHE", str(tmp_path))  # no venv where --setup puts it
    with pytest.raises(ValueError, match=r"python -m ops\.bench_vs_vllm --setup`"):
        vllm_python(default_venv())
    half_made = tmp_path / "venv"  # a --setup that stopped midway: a python but no mark
    (half_made / "bin").mkdir(parents=True)
    (half_made / "bin" / "python").touch()
    with pytest.raises(ValueError, match=rf"--setup --venv {half_made}`"):
        vllm_python(half_made)
    assert main(["--venv", str(half_made), "--workloads", "mixed"]) == 1
    assert "--setup" in capsys.readouterr().out


def test_vllm_gets_every_core_none_reserved_and_no_hub():
    environment = vllm_environment({"PATH": "/bin"})
    assert environment["VLLM_CPU_OMP_THREADS_BIND"] == f"0-{len(os.sched_getaffinity(0)) - 1}"
    assert environment["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert environment["HF_HUB_OFFLINE"] == "1"
    assert float(environment["VLLM_CPU_KVCACHE_SPACE"]) > 0
    assert environment["PATH"] == "/bin"


def test_the_vllm_child_loads_once_and_runs_every_workload_in_request_order(tmp_path, fake_vllm):
    venv, log = fake_vllm
    workloads = {"mixed": [([5, 6], 3), ([7], 2)], "chat": [([8, 9, 10], 4)]}
    result = run_vllm(vllm_python(venv), vllm_job(tmp_path, "bfloat16", "eager", workloads))
    assert result["mixed"]["outputs"] == {"r0": [5, 5, 5], "r1": [7, 7]}
    assert result["chat"]["outputs"] == {"r0": [8, 8, 8, 8]}
    assert result["mixed"]["tokens"] == 5 and result["chat"]["tokens"] == 4  # the warm-up's not counted
    assert result["mixed"]["seconds"] >= 0
    load, *generates = logged(log)
    assert load["options"] == {"model": str(tmp_path), "dtype": "bfloat16", "enforce_eager": True}
    assert load["bind"] == vllm_environment({})["VLLM_CPU_OMP_THREADS_BIND"] and load["offline"] == "1"
    assert generates == [{"generate": 1}, {"generate": 2}, {"generate": 1}, {"generate": 1}]  # warm-up, then all


def test_a_failed_vllm_child_says_why(tmp_path, fake_vllm):
    venv, _ = fake_vllm
    with pytest.raises(ValueError, match="(?s)compiled.*no model at"):
        run_vllm(vllm_python(venv), vllm_job(tmp_path / "missing", "float32", "compiled", {"mixed": [([1], 1)]}))


def test_the_prompts_handed_to_vllm_are_the_offline_benchmarks_own(smollm2_tokenizer):
    from worker.engine.models import smollm2_cache

    directory = model_directory("smollm2-135m")
    assert directory == smollm2_cache()  # the weights our engine loads
    job = json.loads(json.dumps(vllm_job(directory, "float32", "compiled", workloads_of(directory, ["chat"], 6, 2))))
    assert job["eager"] is False
    offline_benchmarks = workload(smollm2_tokenizer, 2, 6, "chat")
    assert job["workloads"]["chat"] == [[ids, max_tokens] for ids, max_tokens in offline_benchmarks]


def test_a_model_vllm_cannot_load_is_refused():
    with pytest.raises(ValueError, match="HF model directory"):
        model_directory("random:llama")


def test_the_row_compares_throughput_and_our_tokens_against_vllms():
    theirs = {"outputs": {"r0": [1, 2, 3, 4], "r1": [5, 6, 7, 8]}, "tokens": 8, "seconds": 4.0}
    ours = {"outputs": {"r0": [1, 2, 3, 4], "r1": [5, 9, 7, 8]}, "tokens": 8, "seconds": 2.0}
    row = compare(ours, theirs, first=4)
    assert row == {"requests": 2, "ours_tokens_per_s": 4.0, "vllm_tokens_per_s": 2.0, "ratio": 2.0,
                   "mean": 0.625, "min": 0.25, "all_same": 1}
    console = Console(record=True, width=250)
    console.print(table_of([{"workload": "mixed", "dtype": "float32", "mode": "eager"} | row], "smollm2-135m", 4))
    line = next(line for line in console.export_text().splitlines() if "mixed" in line)
    assert [cell.strip() for cell in line.split("│")[1:-1]] == [
        "mixed", "float32", "eager", "2", "4.0", "2.0", "2.00x", "62.5% / 25.0%", "1/2"]


def test_a_run_puts_our_engine_and_vllm_on_the_same_requests(tmp_path, fake_vllm, model_dir, capsys):
    venv, log = fake_vllm
    figures = tmp_path / "figures.json"
    assert main(["--venv", str(venv), "--model", str(model_dir), "--workloads", "mixed", "--count", "3",
                 "--dtypes", "float32", "--modes", "eager", "--first", "4", "--json", str(figures)]) == 0
    [row] = json.loads(figures.read_text())["rows"]
    assert (row["workload"], row["dtype"], row["mode"], row["requests"]) == ("mixed", "float32", "eager", 3)
    assert row["ratio"] == pytest.approx(row["ours_tokens_per_s"] / row["vllm_tokens_per_s"])
    assert logged(log)[0]["options"]["model"] == str(model_dir)
    # printed whole where the output is no terminal (rich assumes 80 columns there: "ours/…", "float…")
    header = next(line for line in capsys.readouterr().out.splitlines() if "workload" in line)
    assert "ours/vLLM" in header and "first 4 agreeing: mean / min" in header


def test_compiled_mode_compiles_both_engines_and_eager_neither(tmp_path, fake_vllm, model_dir, monkeypatch):
    venv, log = fake_vllm
    compiled = []

    def our_run(model, dtype, kind, count, seed, first, compile):
        compiled.append(compile)
        return {"outputs": {"r0": [0], "r1": [0]}, "tokens": 2, "seconds": 1.0}

    monkeypatch.setattr("ops.bench_vs_vllm.run_child", our_run)
    assert main(["--venv", str(venv), "--model", str(model_dir), "--workloads", "mixed", "--count", "2",
                 "--dtypes", "float32", "--modes", "eager,compiled"]) == 0
    assert compiled == [False, True]
    assert [entry["options"]["enforce_eager"] for entry in logged(log) if "options" in entry] == [True, False]


def test_vllms_own_bfloat16_is_compared_with_its_float32_in_each_mode_where_both_ran():
    def run(*outputs):
        return {"mixed": {"outputs": {f"r{i}": tokens for i, tokens in enumerate(outputs)}}}

    runs = {("float32", "eager"): run([1, 2, 3, 4], [5, 6, 7, 8]),
            ("bfloat16", "eager"): run([1, 2, 9, 9], [5, 6, 7, 8]),
            ("bfloat16", "compiled"): run([1, 2, 3, 4], [5, 6, 7, 8])}  # no float32 compiled run: nothing to compare
    assert vllm_dtype_agreement(runs, first=4) == [
        {"workload": "mixed", "mode": "eager", "requests": 2, "mean": 0.75, "min": 0.5, "all_same": 1}]


class ConfigSeen(Exception):
    """Raised by a stand-in Engine with the config it was given."""


def test_compiled_reaches_our_engines_config_through_the_agreement_child(monkeypatch):
    import subprocess

    import ops.agreement

    commands = []
    monkeypatch.setattr(subprocess, "run",
                        lambda command, **_: commands.append(command) or SimpleNamespace(stdout="RESULT {}", stderr=""))
    ops.agreement.run_child("smollm2-135m", "float32", "mixed", 2, 0, 32, compile=True)
    [command] = commands
    assert command[1:3] == ["-m", "ops.agreement"]

    def engine(config):
        raise ConfigSeen(config)

    monkeypatch.setattr("worker.engine.engine.Engine", engine)
    with pytest.raises(ConfigSeen) as seen:
        ops.agreement.main(command[3:])  # the child's own command line
    assert seen.value.args[0].compile is True
