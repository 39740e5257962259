"""Pinned prefixes through the engine: by name, whole blocks, never evicted under pressure, again
after a recovery, refused (not crashing) when they do not fit; a chat pin is the head of the chat
requests that start with it."""

import random

import pytest

from producer.protocol import SamplingParams
from worker.engine.config import EngineConfig
from worker.engine.engine import Engine
from worker.engine.inputs import PromptError, encode_prompt
from worker.engine.models import load_model

pytestmark = pytest.mark.usefixtures("one_thread")
SYSTEM = list(range(100, 148))  # three blocks of 16
PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    return load_model("random:llama")[0]


def engine_of(model, num_blocks=32, **options) -> Engine:
    return Engine(EngineConfig.from_options("random:llama", num_blocks=num_blocks, max_model_len=128, **options),
                  model=model)


def serve(engine, prompts: dict[str, list[int]]) -> dict[str, int]:
    """Run the prompts to the end together; -> request id -> prompt tokens served from the cache."""
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt_ids=prompt, params=PARAMS)
    cached = {}
    while engine.has_unfinished:
        for output in engine.step():
            if output.finished:
                assert output.finish_reason == "length", output.error
                cached[output.request_id] = output.usage.cached_tokens
    return cached


def flood(engine, count=12, seed=0) -> None:
    """Unrelated prompts, many times the pool together: every cached-free block is evicted."""
    rng = random.Random(seed)
    serve(engine, {f"flood{seed}-{i}": [rng.randrange(200, 500) for _ in range(100)] for i in range(count)})


@pytest.mark.parametrize("pinned", [True, False])
def test_a_pinned_prefix_is_never_evicted_under_pressure(model, pinned):
    engine = engine_of(model)
    if pinned:
        assert engine.pin("system", prompt_ids=SYSTEM + [7, 8]) == 3  # the 2 tokens past the blocks are dropped
    serve(engine, {"warm": SYSTEM + [5]})
    flood(engine)
    later = serve(engine, {f"later{i}": SYSTEM + [10 + i] for i in range(3)})
    assert list(later.values()) == ([48] * 3 if pinned else [0] * 3)
    assert engine.pool.num_pinned_blocks == (3 if pinned else 0)


def test_pins_are_applied_again_after_a_recovery(model):
    engine = engine_of(model)
    engine.pin("system", prompt_ids=SYSTEM)
    serve(engine, {"warm": SYSTEM + [5]})
    execute, calls = engine.runner.execute, [0]

    def fails_once(plan):
        calls[0] += 1
        if calls[0] == 1:
            raise RuntimeError("injected")
        return execute(plan)

    engine.runner.execute = fails_once
    old_pool = engine.pool
    serve(engine, {"during": SYSTEM + [6]})  # its step fails: a fresh pool, recomputed from scratch
    assert engine.num_failed_steps == 1 and engine.pool is not old_pool
    flood(engine)
    assert serve(engine, {"later": SYSTEM + [9]}) == {"later": 48}


def test_unpin_lets_the_prefix_be_evicted(model):
    engine = engine_of(model)
    engine.pin("system", prompt_ids=SYSTEM)
    serve(engine, {"warm": SYSTEM + [5]})
    assert engine.unpin("system") and not engine.unpin("system") and engine.pins == {}
    flood(engine)
    assert serve(engine, {"later": SYSTEM + [9]}) == {"later": 0}
    assert engine.pool.num_pinned_blocks == 0


def test_a_pin_that_does_not_fit_is_refused_and_the_engine_serves_on(model):
    engine = engine_of(model, num_blocks=12)  # a request of the model length (128) needs 8: 4 can be pinned
    with pytest.raises(ValueError, match=r"'big' \(5 blocks\) does not fit: .* at most 4 blocks can be pinned"):
        engine.pin("big", prompt_ids=list(range(100, 180)))
    assert engine.pin("system", prompt_ids=SYSTEM) == 3
    with pytest.raises(ValueError, match="the pins would hold 5 of the 12 KV blocks"):
        engine.pin("other", prompt_ids=list(range(300, 332)))
    assert engine.pin("head", prompt_ids=SYSTEM[:32]) == 2  # its blocks are the system pin's: no more room taken
    with pytest.raises(ValueError, match="shorter than one KV block"):
        engine.pin("tiny", prompt_ids=[1, 2, 3])
    with pytest.raises(ValueError, match="already pinned"):
        engine.pin("system", prompt_ids=SYSTEM)
    with pytest.raises(PromptError, match="no tokenizer"):
        engine.pin("text", prompt="You are a pirate.")
    assert sorted(engine.pins) == ["head", "system"]
    assert serve(engine, {"a": list(range(200, 320))}) == {"a": 0}  # the longest request still fits


def test_a_pinned_system_prompt_is_the_head_of_chat_requests_with_it(model, smollm2_tokenizer):
    engine = Engine(EngineConfig.from_options("random:llama", num_blocks=64, max_model_len=512), model=model,
                    tokenizer=smollm2_tokenizer)
    system = {"role": "system", "content": "You are a careful assistant for a shipping company. " * 4}
    blocks = engine.pin("system", messages=[system])
    chat = encode_prompt(smollm2_tokenizer, messages=[system, {"role": "user", "content": "Where is my parcel?"}],
                         max_prompt_tokens=512)
    pinned = engine.pins["system"]
    # rendered, the system message is 46 tokens; with a generation prompt it would be 50, and a third
    # block would end in the assistant's marker, where a chat request has its user message
    assert blocks == 2 and chat[:len(pinned)] == pinned
    text = "Answer in French. " * 8
    engine.pin("text", prompt=text)
    assert encode_prompt(smollm2_tokenizer, prompt=text + "What time is it?", max_prompt_tokens=512)[
        :len(engine.pins["text"])] == engine.pins["text"]
