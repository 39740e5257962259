"""The simulated executor's clock: step times from the cost model, token times from the steps."""

from producer.protocol import SamplingParams
from worker.engine.cost_model import CostModel, kv_reads
from worker.engine.plan import StepPlan
from worker.engine.scheduler_config import SchedulerConfig
from worker.engine.sequence import Sequence
from worker.engine.simulator import SimRequest, simulate


def request(arrival_s: float, prompt_len: int, max_tokens: int, request_id: str) -> SimRequest:
    return SimRequest(arrival_s, list(range(2, 2 + prompt_len)),
                      SamplingParams(max_tokens=max_tokens, ignore_eos=True), request_id=request_id)


def test_step_time_counts_computed_tokens_and_the_context_each_sequence_reads():
    decoding = Sequence("d", list(range(100)), SamplingParams())
    decoding.num_computed_tokens = 99
    prefilling = Sequence("p", list(range(40)), SamplingParams())
    plan = StepPlan()
    plan.add(decoding, 1)
    plan.add(prefilling, 40)
    assert kv_reads(plan) == 100 + 40
    cost = CostModel(fixed_s=1.0, per_token_s=0.1, per_kv_read_s=0.01)
    assert cost.step_time(plan) == 1.0 + 0.1 * 41 + 0.01 * 140
    # both sample (the decode, and the prompt computed whole): a row each, and the publish after the step
    cost = CostModel(fixed_s=1.0, per_token_s=0.1, per_kv_read_s=0.01, per_row_s=0.5, publish_s=2.0)
    assert cost.step_time(plan) == 1.0 + 0.1 * 41 + 0.01 * 140 + 0.5 * 2 + 2.0


def test_token_times_are_the_ends_of_the_steps_that_sampled_them():
    # every step costs 1 s; the second request arrives while the first decodes
    result = simulate(SchedulerConfig(token_budget=64), num_blocks=64, block_size=16,
                      requests=[request(0.0, 10, 4, "a"), request(1.5, 10, 2, "b")],
                      cost=CostModel(fixed_s=1.0, per_token_s=0.0, per_kv_read_s=0.0))
    times = {seq.request_id: result.token_times[seq] for seq in result.sequences}
    assert times == {"a": [1.0, 2.0, 3.0, 4.0], "b": [3.0, 4.0]}
    for seq in result.sequences:
        assert result.token_times[seq][0] == seq.first_token_time
        assert result.token_times[seq][-1] == seq.finish_time


def test_a_preempted_sequence_keeps_its_earlier_token_times_and_shows_the_stall_as_a_gap():
    # both fit in one block of 8 at first; a pool of 3 cannot hold both growing into a second one
    result = simulate(SchedulerConfig(token_budget=64, watermark=0.0, cooldown_watermark=0.0), num_blocks=3,
                      block_size=8, requests=[request(0.0, 7, 9, "a"), request(0.0, 7, 9, "b")],
                      cost=CostModel(fixed_s=1.0, per_token_s=0.0, per_kv_read_s=0.0))
    preempted = [seq for seq in result.sequences if seq.num_preemptions]
    assert preempted
    for seq in result.sequences:
        times = result.token_times[seq]
        assert len(times) == seq.num_output_tokens == 9
        assert times == sorted(times)
    gaps = [later - earlier for seq in preempted for earlier, later in zip(result.token_times[seq],
                                                                            result.token_times[seq][1:])]
    assert max(gaps) > 1.0
