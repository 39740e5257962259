"""A step that raises does not end the engine: everyone is recomputed on a fresh scheduler and
gets exactly the tokens of an undisturbed run; a poison request (one whose steps always fail)
is ended with an error after max_step_failures failed steps, alone, while the rest are served."""

import pytest

from producer.protocol import SamplingParams
from worker.engine.config import EngineConfig
from worker.engine.engine import Engine
from worker.engine.models import load_model

pytestmark = pytest.mark.usefixtures("one_thread")
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PROMPTS = {f"r{i}": list(range(10 + i, 30 + 3 * i)) for i in range(5)}


@pytest.fixture(scope="module")
def model():
    return load_model("random:llama")[0]


def engine_of(model, **options) -> Engine:
    return Engine(EngineConfig.from_options("random:llama", num_blocks=256, token_budget=64, **options), model=model)


def inject(engine, broken) -> None:
    """`broken(plan, step)` runs before each runner call (steps counted from 1) and may raise."""
    execute, steps = engine.runner.execute, [0]

    def faulty(plan):
        steps[0] += 1
        broken(plan, steps[0])
        return execute(plan)

    engine.runner.execute = faulty


def run(engine, prompts, broken=lambda plan, step: None, limit=500):
    """-> request id -> (tokens, final output), with `broken` injected (see inject)."""
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt_ids=prompt, params=GREEDY)
    inject(engine, broken)
    tokens, finals = {request_id: [] for request_id in prompts}, {}
    for _ in range(limit):
        if not engine.has_unfinished:
            break
        for output in engine.step():
            tokens[output.request_id] += output.token_ids
            if output.finished:
                finals[output.request_id] = output
    assert not engine.has_unfinished
    return {request_id: (tokens[request_id], finals[request_id]) for request_id in prompts}


@pytest.fixture(scope="module")
def undisturbed(model):
    return {request_id: tokens for request_id, (tokens, _) in run(engine_of(model), PROMPTS).items()}


def test_a_step_that_fails_once_costs_nobody_a_token(model, undisturbed):
    def once(plan, step):
        if step == 4:  # mid-decode for some, mid-prefill for others (64-token budget)
            raise RuntimeError("injected fault")

    engine = engine_of(model)
    results = run(engine, PROMPTS, once)
    assert engine.num_failed_steps == 1
    for request_id, (tokens, final) in results.items():
        assert tokens == undisturbed[request_id] and final.finish_reason == "length" and not final.poisoned


def test_a_poison_request_is_ended_alone_and_everyone_else_is_served(model, undisturbed):
    def poison(plan, step):
        if any(seq.request_id == "r2" for seq in plan.scheduled) and step > 1:
            raise ValueError("this input breaks the model")

    engine = engine_of(model, max_step_failures=2)
    results = run(engine, PROMPTS, poison)
    tokens, final = results["r2"]
    assert final.poisoned and final.finish_reason == "error"
    assert final.error == "ended after 2 failed engine steps: ValueError: this input breaks the model"
    assert engine.num_failed_steps == 2  # the second time it ran alone among suspects: only it was blamed
    for request_id, (tokens, final) in results.items():
        if request_id != "r2":
            assert tokens == undisturbed[request_id] and final.finish_reason == "length" and not final.poisoned
    assert engine.pool.num_free_blocks == engine.pool.num_blocks  # nothing leaked


def test_a_failure_inside_the_scheduler_is_recovered_too(model, undisturbed):
    engine = engine_of(model)
    schedule, calls = engine.scheduler.schedule, [0]

    def broken_schedule():
        calls[0] += 1
        if calls[0] == 3:
            raise AssertionError("scheduler bug")
        return schedule()

    engine.scheduler.schedule = broken_schedule  # the fresh scheduler after recovery is sound
    results = run(engine, PROMPTS)
    assert engine.num_failed_steps == 1
    assert {request_id: tokens for request_id, (tokens, _) in results.items()} == undisturbed


def test_a_cancel_of_a_suspect_still_ends_it(model):
    def second(plan, step):
        if step == 2:
            raise RuntimeError("injected fault")

    engine = engine_of(model)
    for request_id, prompt in PROMPTS.items():
        engine.add_request(request_id, prompt_ids=prompt, params=GREEDY)
    inject(engine, second)
    engine.step()
    engine.step()  # fails: the requests in it become suspects
    assert engine.suspects
    suspect = engine.suspects[-1]
    assert engine.abort(suspect)
    finals = {}
    while engine.has_unfinished:
        finals |= {output.request_id: output for output in engine.step() if output.finished}
    assert finals[suspect].finish_reason == "cancelled"
    assert all(finals[r].finish_reason == "length" for r in PROMPTS if r != suspect)


def test_a_request_that_breaks_at_a_later_position_is_still_ended_alone(model, undisturbed):
    engine = engine_of(model, max_step_failures=2)

    def late(plan, step):
        if any(seq.request_id == "r1" and len(seq.output_token_ids) >= 4 for seq in plan.scheduled):
            raise RuntimeError("breaks at its 5th token")

    results = run(engine, PROMPTS, late)
    tokens, final = results["r1"]
    assert final.poisoned and tokens == undisturbed["r1"][:4]  # what it reported before stays reported
    assert all(results[r][0] == undisturbed[r] for r in PROMPTS if r != "r1")
