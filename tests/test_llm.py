"""The offline API on the real bundled model (SmolLM2-135M): greedy output token-identical
to HF generate, text through the detokenizer, chat templates, stop strings."""

import pytest
import torch

from producer import SamplingParams
from worker import LLM

pytestmark = pytest.mark.real_model

CHATS = [[{"role": "user", "content": "What is the capital of France?"}],
         [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Name a colour."}],
         [{"role": "user", "content": "Write a haiku about the sea."}]]


@pytest.fixture(scope="module")
def llm():
    return LLM("smollm2-135m", num_blocks=256, token_budget=64)


@pytest.fixture(scope="module")
def reference(llm):
    from transformers import AutoModelForCausalLM

    from worker.engine.models import smollm2_cache
    return AutoModelForCausalLM.from_pretrained(smollm2_cache(), dtype=torch.float32,
                                                attn_implementation="sdpa").eval()


def test_greedy_chat_matches_hf_generate(llm, reference):
    params = SamplingParams(max_tokens=24, temperature=0.0)
    completions = llm.generate(CHATS, params, progress=False)
    tokenizer = llm.engine.tokenizer
    for chat, completion in zip(CHATS, completions):
        ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
        with torch.inference_mode():
            out = reference.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)
        want = out[0, len(ids):].tolist()
        assert completion.token_ids == want
        assert completion.text == tokenizer.decode(want, skip_special_tokens=True)
        assert completion.finish_reason == ("stop" if want[-1] == 2 else "length")
        assert completion.usage.prompt_tokens == len(ids)


def test_strings_token_ids_and_stop_strings(llm):
    text, ids = llm.generate(["The sky is", [504, 3276, 314]],
                             SamplingParams(max_tokens=8, temperature=0.0), progress=False)
    assert text.text and len(ids.token_ids) == 8
    stopped = llm.generate("Count: one, two, three,", SamplingParams(max_tokens=30, temperature=0.0, stop=[","]),
                           progress=False)[0]
    assert stopped.finish_reason == "stop" and "," not in stopped.text


def test_logprobs_are_the_raw_models_with_each_tokens_text(llm, reference):
    prompt = [504, 3276, 314]
    [completion] = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, logprobs=3), progress=False)
    with torch.inference_mode():
        logits = reference(torch.tensor([prompt + completion.token_ids])).logits[0, len(prompt) - 1:-1]
    want = logits.float().log_softmax(dim=1)
    decode = llm.engine.tokenizer.decode
    assert len(completion.logprobs) == len(completion.token_ids) == 6
    for position, (token_id, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        values, ids = want[position].topk(3)
        assert entry.logprob == pytest.approx(float(want[position, token_id]), abs=1e-3)
        assert [alt.id for alt in entry.top] == ids.tolist()
        assert [alt.logprob for alt in entry.top] == pytest.approx(values.tolist(), abs=1e-3)
        assert entry.text == decode([token_id])
        assert [alt.text for alt in entry.top] == [decode([i]) for i in ids.tolist()]
