"""The step cost model: its fit, the prefill allowance an ITL SLO leaves, its live refits, and the
scheduler held to the SLO with it."""

import random

import pytest

from producer.protocol import SamplingParams
from worker.engine.blocks import BlockPool
from worker.engine.cost_model import REFIT_STEPS, CostModel, LiveCosts, StepSample, fit, with_publish
from worker.engine.scheduler import Scheduler
from worker.engine.scheduler_config import SchedulerConfig
from worker.engine.sequence import Sequence

TRUE_COST = CostModel(fixed_s=0.005, per_token_s=3e-5, per_kv_read_s=2e-7, per_row_s=4e-5)


def shapes(count: int, seed: int = 0) -> list[tuple[int, int, int]]:
    rng = random.Random(seed)
    return [(tokens, rng.randint(1, 200_000), rng.randint(1, min(tokens, 256)))
            for tokens in (rng.randint(1, 2048) for _ in range(count))]


def coefficients(cost: CostModel) -> tuple[float, ...]:
    return cost.fixed_s, cost.per_token_s, cost.per_kv_read_s, cost.per_row_s


def exact(shape, cost=TRUE_COST) -> StepSample:
    return StepSample(*shape, cost.engine_time(*shape))


def test_fit_recovers_known_coefficients_from_exact_samples():
    assert coefficients(fit([exact(shape) for shape in shapes(200)])) == pytest.approx(coefficients(TRUE_COST), rel=1e-6)


def test_fit_is_not_pulled_off_by_steps_that_stalled_waiting_for_a_core():
    samples = [StepSample(*shape, TRUE_COST.engine_time(*shape) * (3 if i % 20 == 0 else 1))
               for i, shape in enumerate(shapes(400))]  # 5% of the steps took 3x as long
    assert coefficients(fit(samples)) == pytest.approx(coefficients(TRUE_COST), rel=1e-6)
    assert coefficients(fit(samples, trim=0)) != pytest.approx(coefficients(TRUE_COST), rel=0.05)


def test_fit_never_gives_a_negative_cost():
    # the samples say reading KV saves time: least squares alone would give it a negative cost
    samples = [StepSample(tokens, reads, rows, 0.01 + 1e-4 * tokens - 1e-8 * reads) for tokens, reads, rows in shapes(100)]
    cost = fit(samples)
    assert cost.per_kv_read_s == 0
    assert cost.fixed_s >= 0 and cost.per_token_s > 0


def test_the_publish_terms_come_from_the_gaps_between_steps():
    gaps = [StepSample(0, 0, rows, 0.002 + 1e-5 * rows) for rows in range(1, 200, 7)]
    cost = with_publish(TRUE_COST, gaps)
    assert (cost.publish_s, cost.per_row_s) == pytest.approx((0.002, TRUE_COST.per_row_s + 1e-5), rel=1e-6)
    assert cost.time_of(10, 100, 3) == pytest.approx(TRUE_COST.engine_time(10, 100, 3) + 0.002 + 3e-5)


def test_the_prefill_allowance_fills_the_turn_up_to_the_slo():
    cost = CostModel(fixed_s=0.010, per_token_s=1e-4, per_kv_read_s=0.0, per_row_s=1e-3, publish_s=0.002)
    # 20 decodes: 10 + 2 + 20 x (0.1 + 1) ms = 34 ms; a chunk that ends a prompt samples a row (1 ms more)
    allowance = cost.prefill_allowance(20, 0, 20, 0.050)
    assert allowance == pytest.approx((50 - 34 - 1) / 0.1, abs=1)
    assert cost.time_of(20 + allowance, 0, 21) <= 0.050 < cost.time_of(20 + allowance + 2, 0, 21)
    assert cost.prefill_allowance(400, 0, 400, 0.050) == 0  # the decodes alone are over it


def test_live_costs_follow_the_machine_s_speed_and_the_gaps_between_steps():
    live = LiveCosts([exact(shape) for shape in shapes(100)])
    assert coefficients(live.model) == pytest.approx(coefficients(TRUE_COST), rel=1e-6)
    now = 0.0
    for n in range(4 * REFIT_STEPS):  # decodes only, 1.5x slower than calibrated: a neighbour took a core
        rows = 4 + n % 29
        shape = (rows, rows * (300 + n), rows)
        live.step_started(now)
        took = 1.5 * TRUE_COST.engine_time(*shape) * (3 if n % 10 == 0 else 1)  # and a stall now and then
        live.step_ended(*shape, now, now + took, busy=True)
        now += took + 0.003 + 1e-4 * rows  # the worker's publish round trip: 3 ms and 0.1 ms a row
    assert coefficients(live.model) == pytest.approx([1.5 * c for c in coefficients(TRUE_COST)[:3]] + [
        1.5 * TRUE_COST.per_row_s + 1e-4], rel=1e-6)  # a prefill's cost keeps its own terms, scaled
    assert live.model.publish_s == pytest.approx(0.003, rel=1e-3)
    live.step_started(now)
    live.step_ended(5, 10, 1, now, now + 1, busy=False)  # idle after: the next gap is no turn of the loop
    assert live.last_end is None
    live.step_started(now)
    live.step_ended(5, 10, 1, now, now + 1, busy=False)  # idle after: the next gap is no turn of the loop
    assert live.last_end is None


def decoding(pool: BlockPool, scheduler: Scheduler, count: int, context: int) -> None:
    for i in range(count):
        seq = Sequence(f"d{i}", list(range(3, 3 + context)), SamplingParams(max_tokens=100, ignore_eos=True))
        scheduler.add(seq)
    while any(not seq.output_token_ids for seq in scheduler.running) or scheduler.num_waiting:
        plan = scheduler.schedule()
        scheduler.update(plan, {seq: 7 for seq in plan.scheduled if plan.samples(seq)})


@pytest.mark.parametrize("slo_ms", [None, 60.0])
def test_under_the_itl_slo_a_step_with_decodes_takes_only_the_prefill_that_fits(slo_ms):
    cost = CostModel(fixed_s=0.010, per_token_s=1e-4, per_kv_read_s=0.0, per_row_s=1e-3, publish_s=0.002)
    pool = BlockPool(1024, 16)
    scheduler = Scheduler(SchedulerConfig(token_budget=2048, itl_slo_ms=slo_ms), pool, cost=cost)
    decoding(pool, scheduler, 8, 20)
    fast = Sequence("fast", list(range(1000, 1057)), SamplingParams(max_tokens=8, ignore_eos=True))
    normal = Sequence("normal", list(range(2000, 5000)), SamplingParams(max_tokens=200, ignore_eos=True))
    scheduler.add(normal)
    scheduler.add(fast)
    plan = scheduler.schedule()
    assert plan.scheduled[fast] == 57  # the fast lane's prefill first, whole
    if slo_ms is None:  # as much as the budget allows: a step far over any ITL ceiling
        assert plan.num_tokens == 2048
    else:  # 8 decodes: 10 + 2 + 8 x 1.1 ms = 20.8 ms; 60 ms leaves (60 - 20.8 - 1) / 0.1 = 382 prefill tokens
        assert 381 <= plan.num_tokens - 8 <= 382 and cost.step_time(plan) <= slo_ms / 1000
        assert plan.scheduled[normal] == plan.num_tokens - 8 - 57
    scheduler.update(plan, {seq: 7 for seq in plan.scheduled if plan.samples(seq)})
    for seq in list(scheduler.running):  # no decodes left: the next step takes the whole budget
        if seq is not normal:
            scheduler.finish_request(seq.request_id)
    assert scheduler.schedule().num_tokens == min(2048, len(normal.token_ids) - normal.num_computed_tokens)


def test_an_itl_slo_needs_a_cost_model():
    with pytest.raises(ValueError, match="cost model"):
        Scheduler(SchedulerConfig(itl_slo_ms=50.0), BlockPool(16, 16))
    with pytest.raises(ValueError, match="itl_slo_ms"):
        SchedulerConfig(itl_slo_ms=0)

