"""The SLO tuner: the SLO check, the search on the simulator, and one small run of `python -m ops.tune`
on the tiny random model against a private worker (the cost model's fit: tests/engine/test_cost_model.py)."""

import json
import random

import pytest

from ops.cost_model import Calibration
from ops.load.report import summarize
from ops.load.trace import TraceRequest
from ops.tune import (HIGHEST_LOAD, SLO, Figures, Outcome, Setting, candidates, chosen, grid, highest_load, main,
                      ratios, search, simulated_run)
from worker.engine.cost_model import CostModel

@pytest.mark.parametrize("figures, met", [
    (Figures(10.0, 0.8, 0.1, 0), True),  # on the bounds
    (Figures(10.0, 0.81, 0.1, 0), False),
    (Figures(10.0, 0.5, 0.11, 0), False),
    (Figures(10.0, 0.5, 0.05, 1), False),  # a failed request misses the SLOs, however fast the rest
    (Figures(10.0, 0.5, None, 0), True),  # one-token outputs have no inter-token gaps
    (Figures(0.0, None, None, 0), False),  # nothing came back
])
def test_slo_check(figures, met):
    assert SLO(ttft_p99_s=0.8, itl_p99_s=0.1).met_by(figures) is met


def ttft_growing_with_load(edge: float):
    """Figures whose P99 TTFT passes 0.8 s at load `edge`."""
    return lambda load: Figures(100.0 * load, 0.8 * load / edge, 0.01, 0)


@pytest.mark.parametrize("edge, bracket", [(6.0, (4.0, 8.0)), (0.3, (0.25, 0.5))])
def test_highest_load_brackets_the_edge_then_bisects_it(edge, bracket):
    load, figures = highest_load(ttft_growing_with_load(edge), SLO(0.8, 0.1), refinements=3)
    low, high = bracket
    assert edge / (high / low) ** (1 / 2 ** 3) <= load <= edge
    assert figures == ttft_growing_with_load(edge)(load)


def test_highest_load_when_no_load_or_every_load_meets_the_slos():
    assert highest_load(lambda load: Figures(1.0, 10.0, 0.01, 0), SLO(0.8, 0.1)) == (0.0, None)
    load, _ = highest_load(lambda load: Figures(load, 0.1, 0.01, 0), SLO(0.8, 0.1))
    assert load == HIGHEST_LOAD


def calibration(cost: CostModel) -> Calibration:
    return Calibration("synthetic", cost.fixed_s, cost.per_token_s, cost.per_kv_read_s, kv_tokens=100_000,
                       max_model_len=4096, num_samples=0, mean_relative_error=0.0)


def test_a_simulated_run_is_reported_on_the_simulated_clock():
    # every step costs 1 s: the prefill step gives the first token, each decode step one more
    trace = [TraceRequest(arrival_s=0.0, prompt_ids=list(range(3, 13)), max_tokens=3)]
    result = simulated_run(trace, Setting(256, 0.3, 0.1, 16), calibration(CostModel(1.0, 0.0, 0.0)))
    assert Figures.of(summarize(result)) == Figures(output_tokens_per_s=1.0, ttft_p99_s=1.0, itl_p99_s=1.0, failed=0)


def test_the_search_finds_the_known_best_of_a_tiny_space():
    # 400-token prompts at 1 ms a token: a 1024-token budget prefills one in a single 0.41 s step, which every
    # decode sharing it waits for (ITL over 0.1 s as soon as requests overlap); a 64-token budget never makes
    # a step longer than 74 ms, so it holds the ITL SLO at higher loads and only the TTFT bound stops it
    rng = random.Random(0)
    trace = [TraceRequest(arrival_s=float(i), prompt_ids=[rng.randrange(3, 500) for _ in range(400)], max_tokens=20)
             for i in range(12)]
    outcomes = search(trace, grid([1024, 64], [0.3], [0.1], [16]), SLO(2.0, 0.1),
                      calibration(CostModel(0.01, 0.001, 0.0)))
    best, other = outcomes
    assert best.setting.token_budget == 64
    assert best.load > other.load > 0
    assert best.score > other.score
    assert best.predicted.itl_p99_s <= 0.1 and best.predicted.ttft_p99_s <= 2.0


def test_the_chosen_setting_is_the_best_confirmed_one_within_the_slos_and_ratios_compare_to_the_prediction():
    slo = SLO(1.0, 0.1)
    predicted = Figures(100.0, 0.5, 0.05, 0)
    first = Outcome(Setting(2048, 0.3, 0.1, 16), predicted, 4.0, predicted, confirmed=Figures(90.0, 1.5, 0.05, 0))
    second = Outcome(Setting(512, 0.3, 0.1, 16), predicted, 2.0, predicted, confirmed=Figures(50.0, 0.6, 0.08, 0))
    third = Outcome(Setting(256, 0.3, 0.1, 16), predicted, 1.0, predicted)  # not confirmed
    assert chosen([first, second, third], slo) is second
    assert chosen([first, third], slo) is None
    assert ratios(second) == pytest.approx({"throughput": 0.5, "ttft_p99": 1.2, "itl_p99": 1.6})


def test_candidates_to_confirm_skip_settings_the_simulator_cannot_tell_apart():
    same, other = Figures(100.0, 0.5, 0.05, 0), Figures(80.0, 0.5, 0.05, 0)
    outcomes = [Outcome(Setting(512, 0.3, 0.0, 16), same, 4.0, same),
                Outcome(Setting(512, 0.3, 0.2, 16), same, 4.0, same),  # a watermark the pool never reached
                Outcome(Setting(256, 0.3, 0.0, 16), other, 2.0, other),
                Outcome(Setting(128, 0.3, 0.0, 16), other, 1.0, other),
                Outcome(Setting(2048, 0.3, 0.0, 16), other, 0.0, None)]  # missed the SLOs at every load
    assert candidates(outcomes, 2) == [outcomes[0], outcomes[2]]
    assert candidates(outcomes, 10) == [outcomes[0], outcomes[2], outcomes[3]]


def test_tune_command_on_the_tiny_model(tmp_path):
    out = tmp_path / "tune"
    code = main(["--model", "random:llama", "--count", "8", "--rate", "4", "--token-budgets", "64,256",
                 "--fast-lane-shares", "0.3", "--watermarks", "0.1", "--block-sizes", "16", "--confirm", "1",
                 "--calibration-steps", "30", "--cost-model", str(tmp_path / "cost.json"),
                 "--worker-args", "--threads 1 --num-blocks 256", "--ttft-p99", "30", "--itl-p99", "10",
                 "--out", str(out)])
    assert code == 0
    written = json.loads((out / "tune.json").read_text())
    assert len(written["outcomes"]) == 2
    confirmed = [outcome for outcome in written["outcomes"] if outcome["confirmed"] is not None]
    assert len(confirmed) == 1 and confirmed[0]["confirmed"]["failed"] == 0
    assert (out / "tune.png").stat().st_size > 0
    assert json.loads((tmp_path / "cost.json").read_text())["model"] == "random:llama"
