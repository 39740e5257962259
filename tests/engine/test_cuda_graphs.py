"""Decode steps through the CUDA-graph buffers (cuda_graphs.py) give the plain step's logits and
cache writes, padding included. On CPU the forward over the buffers runs eagerly (capture=False)
under Triton's interpreter: everything but the capture itself. STREAMBATCH_TEST_DEVICE=cuda
captures and replays for real (the engine test captures through the runner)."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from producer.protocol import SamplingParams
from tests.engine.test_attention import DEVICE, Pager, paged_model, tokens
from tests.engine.test_engine import hf_greedy, make_engine, model_and_reference, prompts_of
from worker.engine.attention import run_model
from worker.engine.block_tables import BlockTables, TableUpdate
from worker.engine.cuda_graphs import DecodeGraphs

pytestmark = pytest.mark.usefixtures("one_thread")

BLOCK_SIZE = 8
PROMPT_LENGTHS = (5, 17, 8, 30, 1)  # on and off block boundaries


def test_batch_sizes_end_at_the_maximum():
    graphs = DecodeGraphs(lambda ids, meta: None, [], BLOCK_SIZE, 4, 40, DEVICE, capture=False)
    assert graphs.sizes == [1, 2, 4, 8, 16, 32, 40] and graphs.max_seqs == 40
    with pytest.raises(ValueError, match="max_seqs >= 1"):
        DecodeGraphs(lambda ids, meta: None, [], BLOCK_SIZE, 4, 0, DEVICE, capture=False)


def prefilled(name: str) -> Pager:
    """A pager whose sequences s0..s4 hold their prompts' K/V (written by the triton backend)."""
    pager = Pager(paged_model(name), BLOCK_SIZE, seed=1, backend="triton")
    pager.step([(f"s{i}", tokens(n, i)) for i, n in enumerate(PROMPT_LENGTHS)])
    return pager


@pytest.mark.parametrize("name", ["random:llama", "random:mistral"])  # mistral: GQA and a sliding window
def test_decodes_through_the_buffers_match_plain_steps_and_write_only_their_slots(name):
    plain = prefilled(name)
    buffered = copy.deepcopy(plain)
    model = paged_model(name)
    graphs = DecodeGraphs(functools.partial(run_model, model), buffered.kv_caches, BLOCK_SIZE, 16, 4, DEVICE,
                          capture=DEVICE == "cuda")
    tables = BlockTables(16, torch.device(DEVICE), rows=2)  # grows to 5 rows
    # 4 rows, then 3 (padded to 4: the row the step before used must now write nothing), then 1.
    for step, keys in enumerate((["s0", "s1", "s2", "s3"], ["s4", "s1", "s3"], ["s2"])):
        work = [(key, tokens(1, 100 + 10 * step + i)) for i, key in enumerate(keys)]
        _, expected = plain.step(work)
        buffered.metadata(work)  # grows the block tables as the plain pager did
        rows = [int(key[1:]) for key in keys]
        tables.apply(TableUpdate(rows, [0] * len(rows), [buffered.tables[key] for key in keys]))
        with torch.inference_mode():
            logits = graphs.run([new[0] for _, new in work], [buffered.computed[key] for key in keys],
                                tables.of_step(rows))
        # every size writes its logits into the one buffer
        assert logits.data_ptr() == graphs.logits.data_ptr() and graphs.logits.shape[0] == 4
        for key, _ in work:
            buffered.computed[key] += 1
        torch.testing.assert_close(logits, expected, atol=1e-5, rtol=0, msg=f"step {step}")
        # Not bit for bit: a GEMM over 4 rows may round differently than over 3. A padding row that
        # wrote would put a whole K/V vector where the plain step left zeros or other values.
        for layer, (caches, reference) in enumerate(zip(buffered.kv_caches, plain.kv_caches)):
            for cache, expected_cache in zip(caches, reference):
                torch.testing.assert_close(cache, expected_cache, atol=1e-5, rtol=0, msg=f"step {step}, layer {layer}")


def test_engine_greedy_tokens_match_hf_with_decodes_through_the_buffers(monkeypatch):
    spec = "random:llama"
    model, reference = model_and_reference(spec, DEVICE)
    prompts = prompts_of(4, seed=7, low=3, high=30)
    # At most 2 rows go through the buffers: a step of 3 or 4 decodes takes the plain path.
    engine = make_engine((spec, model, reference), num_blocks=64, block_size=BLOCK_SIZE, token_budget=32,
                         attention_backend="triton", cuda_graph_max_seqs=2, device=DEVICE)
    rows = []
    buffered_run = DecodeGraphs.run
    monkeypatch.setattr(DecodeGraphs, "run", lambda self, ids, *rest: rows.append(len(ids)) or buffered_run(self, ids, *rest))
    for i, prompt in enumerate(prompts):
        params = SamplingParams(max_tokens=3 + 3 * i, temperature=0.0, ignore_eos=True)  # they end one by one
        engine.add_request(f"r{i}", prompt_ids=prompt, params=params)
    tokens_of = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished:
        for output in engine.step():
            tokens_of[output.request_id] += output.token_ids
    assert [tokens_of[f"r{i}"] for i in range(len(prompts))] == \
        [hf_greedy(reference, prompt, 3 + 3 * i) for i, prompt in enumerate(prompts)]
    assert set(rows) == {1, 2}  # the buffers served the steps of 1 and 2 decodes, and only those
