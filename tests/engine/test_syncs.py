"""On a GPU a step waits for the device once: to read its sampled tokens (and logprobs) back.

Counted by torch.cuda.set_sync_debug_mode, which flags every wait (a blocking copy from pageable
memory, .tolist(), nonzero, synchronize): meta tensors (test_sampler.py) show reads of device values
but not blocking copies. Runs where CUDA is (STREAMBATCH_TEST_DEVICE=cuda, ops/gpu_check.sh)."""

import pytest
import torch

from producer.protocol import SamplingParams
from worker.engine.config import EngineConfig
from worker.engine.engine import Engine
from worker.engine.host_copy import counting_syncs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="counts a CUDA device's syncs")

# Every kind of row: greedy, filtered and seeded, penalized, with logprobs.
PARAMS = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
          SamplingParams(max_tokens=10, temperature=0.8, top_k=20, top_p=0.9, min_p=0.05, seed=7, ignore_eos=True),
          SamplingParams(max_tokens=8, temperature=1.0, repetition_penalty=1.2, presence_penalty=0.5,
                         frequency_penalty=0.3, ignore_eos=True),
          SamplingParams(max_tokens=11, temperature=0.7, logprobs=3, ignore_eos=True),
          SamplingParams(max_tokens=9, temperature=1.2, ignore_eos=True)]


def test_a_step_waits_for_the_device_once():
    # a budget that chunks the prompts beside decodes; graphs for 2 decodes, eager decodes above
    engine = Engine(EngineConfig.from_options("random:llama", device="cuda", dtype="float32", num_blocks=64,
                                              block_size=8, token_budget=24, cuda_graph_max_seqs=2))
    for i, params in enumerate(PARAMS):
        engine.add_request(f"r{i}", prompt_ids=list(range(3, 13 + 7 * i)), params=params)
    counts, extra = [], {}
    while engine.has_unfinished:
        with counting_syncs() as syncs:
            engine.step()
        counts.append(len(syncs))
        if len(syncs) > 1:  # where the host waited (our frames), to say in the failure
            extra[len(counts)] = [" <- ".join(frame for frame in reversed(stack) if "/torch/" not in frame)
                                  for stack in syncs]
    assert counts and set(counts) == {1}, f"syncs per step {counts}; where, in steps with more: {extra}"
