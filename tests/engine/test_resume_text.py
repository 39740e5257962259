"""A resumed request's text is exactly an undisturbed run's, token for token: resumed from the
tokens an earlier attempt emitted (`emitted_token_ids`, as another worker does after a crash),
or recomputed by the engine itself after a failed step. A tiny random model with the real
SmolLM2 tokenizer: its first 512 ids are mostly single bytes, so the greedy output is full of
characters split across tokens, and text is held back at many resume points."""

import pytest

from producer.protocol import SamplingParams
from worker.engine.config import EngineConfig
from worker.engine.engine import Engine
from worker.engine.models import load_model

pytestmark = pytest.mark.usefixtures("one_thread")
MODEL = "random:llama"
PROMPT = [405, 472, 232, 37, 149, 511, 278, 265, 224, 487, 418, 441, 172, 261, 200]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
# "in" + a Hebrew letter whose two bytes are two tokens of this run: the stop string is held
# back across two cut points, one of them inside the character.
STOPPED = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=["in\u05e4"])


@pytest.fixture(scope="module")
def model():
    return load_model(MODEL)[0]


@pytest.fixture
def new_engine(model, smollm2_tokenizer):
    return lambda: Engine(EngineConfig.from_options(MODEL, num_blocks=256), model=model,
                          tokenizer=smollm2_tokenizer)


def run(engine: Engine) -> dict[str, list]:
    """-> request id -> its outputs, in order."""
    outputs = {}
    while engine.has_unfinished:
        for output in engine.step():
            outputs.setdefault(output.request_id, []).append(output)
    return outputs


def stream_of(outputs) -> list[tuple[list[int], str]]:
    return [(output.token_ids, output.text) for output in outputs]


@pytest.fixture(params=[GREEDY, STOPPED], ids=["no-stop", "stop-string"])
def undisturbed(request, new_engine, smollm2_tokenizer):
    """(params, outputs) of the request run alone; held back text at some cut points checked."""
    def decode(ids):
        return smollm2_tokenizer.decode(ids, skip_special_tokens=True)

    engine = new_engine()
    engine.add_request("undisturbed", prompt_ids=PROMPT, params=request.param)
    outputs = run(engine)["undisturbed"]
    tokens = [token for output in outputs for token in output.token_ids]
    text = "".join(output.text for output in outputs)
    assert [len(output.token_ids) for output in outputs] == [1] * len(tokens)  # one output per token
    if request.param.stop:
        assert outputs[-1].finish_reason == "stop" and len(tokens) < GREEDY.max_tokens
        assert text == decode(tokens).split(request.param.stop[0])[0]
    else:
        assert outputs[-1].finish_reason == "length" and text == decode(tokens)
    released = [output.text for output in outputs]
    held_back = [cut for cut in range(len(tokens))
                 if "".join(released[:cut]) != decode(tokens[:cut])]
    assert len(held_back) >= 2  # the test resumes where an earlier attempt held text back
    return request.param, outputs


def test_a_request_resumed_at_any_token_goes_on_exactly_like_the_undisturbed_run(new_engine, undisturbed):
    params, outputs = undisturbed
    tokens = [output.token_ids[0] for output in outputs]
    engine = new_engine()
    for cut in range(len(tokens)):  # resumed after `cut` tokens, all in one batch
        engine.add_request(f"cut{cut}", prompt_ids=PROMPT, params=params, emitted_token_ids=tokens[:cut])
    resumed = run(engine)
    for cut in range(len(tokens)):
        assert stream_of(resumed[f"cut{cut}"]) == stream_of(outputs[cut:]), f"resumed after {cut} tokens"
        assert resumed[f"cut{cut}"][-1].finish_reason == outputs[-1].finish_reason


def fail_once(engine: Engine, failing_step: int) -> None:
    """The runner raises at its `failing_step`th call (counted from 1), once."""
    execute, steps = engine.runner.execute, [0]

    def execute_or_fail(plan):
        steps[0] += 1
        if steps[0] == failing_step:
            raise RuntimeError("injected fault")
        return execute(plan)

    engine.runner.execute = execute_or_fail


def test_a_request_recomputed_after_a_failed_step_gives_the_undisturbed_text(new_engine, undisturbed):
    params, outputs = undisturbed
    for failing_step in range(2, len(outputs) + 1):  # from the first decode on
        engine = new_engine()
        engine.add_request("recovered", prompt_ids=PROMPT, params=params)
        fail_once(engine, failing_step)
        recovered = run(engine)["recovered"]
        assert engine.num_failed_steps == 1
        assert stream_of(recovered) == stream_of(outputs), f"failed at step {failing_step}"
        assert recovered[-1].finish_reason == outputs[-1].finish_reason
