"""The engine against HF `generate` (fp32, same weights): greedy output must be
token-identical in every scheduling situation, and seeded sampling reproducible."""

import copy
import random

import pytest
import torch

from producer.protocol import SamplingParams
from worker.engine.config import EngineConfig
from worker.engine.engine import Engine
from worker.engine.inputs import PromptError
from worker.engine.models import load_model

pytestmark = pytest.mark.usefixtures("one_thread")
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def model_and_reference(spec, device="cpu"):
    """(paged model, HF reference with stock attention): the same float32 weights on the same device,
    the reference a copy taken before an engine fuses the model's projections. (A seed draws other
    weights on a GPU than on the CPU, and dtype "auto" is bfloat16 there.)"""
    model, _ = load_model(spec, dtype="float32", device=device)
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("sdpa")
    return model, reference


@pytest.fixture(scope="module", params=["random:llama", "random:qwen2"])
def family(request):
    """(spec, paged model, HF reference with stock attention), loaded once per family."""
    return request.param, *model_and_reference(request.param)


def make_engine(family, **options):
    spec, model, _ = family
    options.setdefault("num_blocks", 512)
    return Engine(EngineConfig.from_options(spec, **options), model=model)


def hf_greedy(reference, prompt, max_tokens):
    with torch.inference_mode():
        out = reference.generate(torch.tensor([prompt], device=reference.device), max_new_tokens=max_tokens,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def run(engine, prompts, params=GREEDY, **kwargs):
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt_ids=prompt, params=params, **kwargs)
    tokens = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished:
        for output in engine.step():
            tokens[output.request_id] += output.token_ids
    return [tokens[f"r{i}"] for i in range(len(prompts))]


def prompts_of(count, seed=0, low=3, high=120, vocab=500):
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(rng.randint(low, high))] for _ in range(count)]


@pytest.fixture(scope="module")
def expected(family):
    _, _, reference = family
    prompts = prompts_of(32)
    return prompts, [hf_greedy(reference, p, GREEDY.max_tokens) for p in prompts]


def test_each_request_alone_matches_hf(family, expected):
    prompts, want = expected
    for prompt, tokens in list(zip(prompts, want))[:6]:
        assert run(make_engine(family), [prompt]) == [tokens]


def test_32_mixed_requests_batched_match_hf(family, expected):
    prompts, want = expected
    assert run(make_engine(family), prompts) == want


def test_chunked_prefill_with_a_tiny_budget_matches_hf(family, expected):
    prompts, want = expected
    assert run(make_engine(family, token_budget=7), prompts[:8]) == want[:8]


def test_forced_preemption_matches_hf(family, expected):
    prompts, want = expected
    engine = make_engine(family, num_blocks=24, block_size=8, watermark=0.0)
    assert run(engine, prompts[:12]) == want[:12]
    assert engine.scheduler.num_preemptions > 0


def test_prefix_cache_hits_match_hf(family):
    _, _, reference = family
    system = prompts_of(1, seed=7, low=40, high=40)[0]
    prompts = [system + suffix for suffix in prompts_of(6, seed=8, low=1, high=20)]
    engine = make_engine(family)
    got = [run(engine, [prompt])[0] for prompt in prompts]  # one after another: later ones hit
    assert got == [hf_greedy(reference, p, GREEDY.max_tokens) for p in prompts]
    assert engine.pool.prefix_hits >= 5 * 32


def test_resumed_request_continues_exactly(family, expected):
    prompts, want = expected
    engine = make_engine(family)
    for i, k in enumerate([1, 5, 11]):
        engine.add_request(f"resumed{i}", prompt_ids=prompts[i], params=GREEDY, emitted_token_ids=want[i][:k])
    rest = {}
    while engine.has_unfinished:
        for output in engine.step():
            rest.setdefault(output.request_id, []).extend(output.token_ids)
    for i, k in enumerate([1, 5, 11]):
        assert rest[f"resumed{i}"] == want[i][k:]


def test_short_and_long_request_batched_give_the_logits_of_each_alone(family):
    spec, model, _ = family
    long_prompt, short_prompt = prompts_of(1, seed=3, low=100, high=100)[0], [5, 6, 7, 8, 9]
    alone = []
    for prompt in (long_prompt, short_prompt):
        engine = make_engine(family)
        engine.add_request("x", prompt_ids=prompt, params=GREEDY)
        alone.append(logits_of_first_step(engine)[0])
    engine = make_engine(family)
    engine.add_request("long", prompt_ids=long_prompt, params=GREEDY)
    engine.add_request("short", prompt_ids=short_prompt, params=GREEDY)
    together = logits_of_first_step(engine)
    assert torch.allclose(together[0], alone[0], atol=1e-4)
    assert torch.allclose(together[1], alone[1], atol=1e-4)


def logits_of_first_step(engine):
    plan = engine.scheduler.schedule()
    _, logits = engine.runner.execute(plan)
    return logits


SEEDED = [SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True),
          SamplingParams(max_tokens=10, temperature=0.7, top_k=20, seed=99, ignore_eos=True)]


def test_seeded_sampling_is_identical_alone_batched_preempted_and_resumed(family, expected):
    prompts, _ = expected
    alone = [run(make_engine(family), [prompts[i]], params=SEEDED[i])[0] for i in range(2)]
    assert alone[0] != alone[1]
    engine = make_engine(family)
    for i in range(2):
        engine.add_request(f"s{i}", prompt_ids=prompts[i], params=SEEDED[i])
    for j, prompt in enumerate(prompts[2:10]):  # strangers with other parameters
        engine.add_request(f"x{j}", prompt_ids=prompt, params=SamplingParams(max_tokens=8, temperature=1.5))
    batched = {"s0": [], "s1": []}
    while engine.has_unfinished:
        for output in engine.step():
            if output.request_id in batched:
                batched[output.request_id] += output.token_ids
    assert [batched["s0"], batched["s1"]] == alone
    squeezed = make_engine(family, num_blocks=20, block_size=8, watermark=0.0)
    assert run(squeezed, prompts[:2] + prompts[2:8], params=SEEDED[0])[0] == alone[0]
    assert squeezed.scheduler.num_preemptions > 0
    engine = make_engine(family)
    engine.add_request("resumed", prompt_ids=prompts[1], params=SEEDED[1], emitted_token_ids=alone[1][:4])
    assert collect(engine) == alone[1][4:]


def collect(engine):
    tokens = []
    while engine.has_unfinished:
        for output in engine.step():
            tokens += output.token_ids
    return tokens


def test_bad_prompts_are_refused_with_a_clear_error(family):
    engine = make_engine(family, max_model_len=64)
    with pytest.raises(PromptError, match="max_tokens"):
        engine.add_request("a", prompt_ids=[1, 2], params=SamplingParams(max_tokens=64))
    with pytest.raises(PromptError):
        engine.add_request("b", prompt_ids=list(range(60)), params=SamplingParams(max_tokens=10))
    with pytest.raises(PromptError, match="tokenizer"):
        engine.add_request("c", prompt="hello")


def test_abort_and_eos_finish_with_reasons(family):
    engine = make_engine(family)
    engine.add_request("cancel-me", prompt_ids=[3, 4, 5], params=SamplingParams(max_tokens=50, temperature=0))
    engine.step()
    assert engine.abort("cancel-me")
    (output,) = engine.step()
    assert output.finish_reason == "cancelled" and output.usage.completion_tokens == 1
    assert engine.pool.stats().used == 0


def test_under_an_itl_slo_tokens_stay_hf_s_and_steps_with_decodes_stay_within_it(family, expected):
    prompts, want = expected
    engine = make_engine(family, itl_slo_ms=4.0, token_budget=512)
    assert engine.costs is not None and engine.scheduler.cost is engine.costs.model  # fitted at start-up
    assert not engine.requests and engine.pool.stats().used == 0  # the calibration left nothing behind
    held = []
    schedule = engine.scheduler.schedule

    def noting_schedule():
        plan = schedule()
        chunks = [(seq, n) for seq, n in plan.scheduled.items() if not seq.is_decoding]
        if chunks and len(chunks) < len(plan.scheduled):  # decodes and prefill together: held to the SLO
            cost = engine.scheduler.cost
            # what CostModel.prefill_allowance leaves out: a second chunk's sampled row, and the cached
            # prefix that a chunk's attention reads besides its own tokens
            rows = sum(1 for seq, _ in chunks if plan.samples(seq))
            unbudgeted = (cost.per_row_s * max(0, rows - 1)
                          + cost.per_kv_read_s * sum(seq.num_computed_tokens for seq, _ in chunks))
            held.append(cost.step_time(plan) - unbudgeted)
        return plan
    engine.scheduler.schedule = noting_schedule
    assert run(engine, prompts[:16]) == want[:16]
    # the model's own prediction, exactly (none held where the decodes alone fill the SLO: a slow machine)
    assert max(held, default=0.0) <= 0.004 + 1e-9
