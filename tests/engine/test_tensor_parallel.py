"""Tensor parallelism on the CPU: two ranks (this process and one it starts) over gloo must give the
greedy tokens of one rank, token for token, on a tiny Llama checkpoint with biases on every
projection (split on the host; o_proj's and down_proj's added once, after the all-reduce), the tiny
Qwen2 and Mistral (a sliding window shorter than the prompts), under chunked prefill, prefix
sharing and preemption; a forward failing on rank 0 ends its process, and rank 0's end the other
rank's; and what cannot be split is refused before any process starts."""

import multiprocessing
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from producer.protocol import SamplingParams
from worker.engine.config import EngineConfig
from worker.engine.engine import Engine
from worker.engine.models import load_model, random_model
from worker.engine.parallel import EXIT_RANK_LOST
from worker.engine.sharding import RowParallelLinear

pytestmark = pytest.mark.usefixtures("one_thread")
# A small pool and budget: prompts are prefilled in chunks, and the running set outgrows the pool.
OPTIONS = dict(num_blocks=40, block_size=8, token_budget=48, watermark=0.0)
SHARED_PREFIX = [7 + i for i in range(32)]  # four whole blocks


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def run(engine: Engine, prompts: list[list[int]], params: SamplingParams, tag: str) -> list[list[int]]:
    for i, prompt in enumerate(prompts):
        engine.add_request(f"{tag}{i}", prompt_ids=prompt, params=params)
    tokens: dict[str, list[int]] = {f"{tag}{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished:
        for output in engine.step():
            assert output.error is None, output.error
            tokens[output.request_id] += output.token_ids
    return [tokens[f"{tag}{i}"] for i in range(len(prompts))]


def prompts_of(count: int, seed: int, low: int, high: int, prefix: list[int] = ()) -> list[list[int]]:
    rng = random.Random(seed)
    return [[*prefix, *(rng.randrange(2, 500) for _ in range(rng.randint(low, high)))] for _ in range(count)]


BIASED_CHECKPOINT = "biased-checkpoint"


@pytest.fixture(scope="module")
def biased_checkpoint(tmp_path_factory) -> str:
    """random:llama with random biases on every projection (a random model's are zeros), saved as a
    checkpoint directory: each rank reads it on the host and moves only its part."""
    model = random_model("random:llama:attention_bias=true,mlp_bias=true")
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(".bias"):
                parameter.copy_(0.1 * torch.randn(parameter.shape, generator=generator))
    path = tmp_path_factory.mktemp("biased-llama")
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module", params=[BIASED_CHECKPOINT, "random:qwen2", "random:mistral"])
def engines(request):
    """(one rank, two ranks) on the same model and options; each workload goes through both alike,
    so their schedulers, pools and prefix caches stay in the same state."""
    model = request.getfixturevalue("biased_checkpoint") if request.param == BIASED_CHECKPOINT else request.param
    one = Engine(EngineConfig.from_options(model, **OPTIONS))
    two = Engine(EngineConfig.from_options(model, tensor_parallel=2, **OPTIONS))
    yield one, two
    two.close()


def both(engines, prompts, params, tag):
    one, two = engines
    return run(one, prompts, params, tag), run(two, prompts, params, tag)


def test_each_rank_holds_half_the_heads_and_the_kv_cache_holds_its_own(engines):
    one, two = engines
    assert (two.info.num_heads, two.info.num_kv_heads) == (one.info.num_heads // 2, one.info.num_kv_heads // 2)
    assert two.runner.kv_caches[0][0].shape[1] == one.info.num_kv_heads // 2
    assert two.num_blocks == one.num_blocks  # one pool geometry, one set of block tables for every rank
    attention = two.model.model.layers[0].self_attn
    assert isinstance(attention.o_proj, RowParallelLinear)
    assert attention.o_proj.in_features == one.model.model.layers[0].self_attn.o_proj.in_features // 2
    assert two.ranks.pids and all(process.is_alive() for process in two.ranks.processes)


def test_chunked_prefill_and_mixed_batches_give_one_rank_s_tokens(engines):
    prompts = prompts_of(6, seed=1, low=40, high=110)  # longer than the budget: prefilled in chunks
    tokens_one, tokens_two = both(engines, prompts, greedy(10), "chunked")
    assert tokens_two == tokens_one and all(len(tokens) == 10 for tokens in tokens_one)


def test_shared_prefixes_give_one_rank_s_tokens(engines):
    one, two = engines
    hits = two.pool.prefix_hits
    prompts = prompts_of(5, seed=2, low=3, high=20, prefix=SHARED_PREFIX)
    tokens_one, tokens_two = both(engines, prompts, greedy(8), "prefix")
    assert tokens_two == tokens_one
    assert two.pool.prefix_hits > hits, "the prompts did not share the cached prefix"
    assert two.pool.prefix_hits == one.pool.prefix_hits


def test_preemption_gives_one_rank_s_tokens(engines):
    one, two = engines
    preemptions = two.scheduler.num_preemptions
    prompts = prompts_of(8, seed=3, low=10, high=30)
    tokens_one, tokens_two = both(engines, prompts, greedy(24), "preempted")
    assert tokens_two == tokens_one
    assert two.scheduler.num_preemptions > preemptions, "the pool did not run short"
    assert two.scheduler.num_preemptions == one.scheduler.num_preemptions


def running(pid: int) -> bool:
    """Alive, not a zombie (whether anyone reaps a process whose parent died depends on the machine)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# Rank 0 in a process of its own: its end is what is tested, and rank 1's after it (a rank sees its
# rank 0 vanish alike whether it exited or was killed: its pipe and sockets close, its parent changes).
BROKEN_FORWARD = """
import torch
from producer.protocol import SamplingParams
from worker.engine.config import EngineConfig
from worker.engine.engine import Engine

def broken(input_ids, meta):
    raise RuntimeError("a broken forward")

if __name__ == "__main__":
    torch.set_num_threads(1)
    engine = Engine(EngineConfig.from_options("random:llama", num_blocks=8, tensor_parallel=2))
    print(*engine.ranks.pids, flush=True)
    engine.runner.forward = broken
    engine.add_request("r", prompt_ids=[5, 6, 7], params=SamplingParams(max_tokens=2))
    engine.step()
    print("the engine went on after the failed step", flush=True)
"""


def test_a_forward_failing_on_rank_0_ends_its_process_and_rank_0_s_end_ends_rank_1(tmp_path):
    script = tmp_path / "broken_forward.py"
    script.write_text(BROKEN_FORWARD)
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert result.returncode == EXIT_RANK_LOST, result.stdout + result.stderr
    assert "a step failed on rank 0 (RuntimeError: a broken forward); the ranks are out of step" in result.stderr
    (rank_1,) = map(int, result.stdout.split())  # and nothing printed after the step
    deadline = time.monotonic() + 3
    while running(rank_1):
        assert time.monotonic() < deadline, "rank 1 outlived rank 0"
        time.sleep(0.02)


@pytest.mark.parametrize("options, said", [
    (dict(tensor_parallel=3), "tensor_parallel=3 must divide the model's 4 attention heads, 2 KV heads"),
    (dict(tensor_parallel=2, device="cuda:1"), "give the device type (cuda), not cuda:1"),
    (dict(tensor_parallel=0), "tensor_parallel must be >= 1"),
])
def test_what_cannot_be_split_is_refused_before_any_rank_starts(options, said):
    children = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match=re.escape(said)):
        Engine(EngineConfig.from_options("random:llama", num_blocks=8, **options))
    assert set(multiprocessing.active_children()) == children


def test_a_loaded_model_is_refused_every_rank_loads_its_own():
    model, _ = load_model("random:llama")
    with pytest.raises(ValueError, match="loads the model on every rank"):
        Engine(EngineConfig.from_options("random:llama", num_blocks=8, tensor_parallel=2), model=model)
