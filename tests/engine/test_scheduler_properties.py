"""Property-based tests: random arrivals, lengths, pool sizes and budgets, driven through
the simulated executor, with the scheduler's invariants checked after every step."""

from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from producer.protocol import SamplingParams
from worker.engine.scheduler_config import SchedulerConfig
from worker.engine.sequence import FinishReason, Status
from worker.engine.simulator import FakeModel, SimRequest, simulate

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def check_invariants(scheduler, plan):
    pool, config = scheduler.pool, scheduler.config
    stats = pool.stats()
    assert stats.free + stats.used + stats.cached == stats.total
    # every reference is accounted for by a running sequence's table or a pin
    expected = Counter(b for seq in scheduler.running for b in seq.block_table)
    for block in pool.blocks:
        assert block.ref_count == expected[block.block_id] + block.pinned
    # KV fill, counted slot by slot: shared slots once; blocks held only by a pin are full
    filled = {(seq.block_table[p // pool.block_size], p % pool.block_size)
              for seq in scheduler.running for p in range(seq.num_computed_tokens)}
    pin_only = sum(1 for block in pool.blocks if block.pinned and not expected[block.block_id])
    assert pool.stats(scheduler.running).tokens_stored == len(filled) + pin_only * pool.block_size
    assert plan.num_tokens == sum(plan.scheduled.values()) <= config.token_budget
    assert all(n > 0 for n in plan.scheduled.values())
    if scheduler.running or scheduler.num_waiting:
        assert plan.scheduled, "empty step while work is runnable"
    for seq, n in plan.scheduled.items():
        assert seq.status is Status.RUNNING
        assert seq.num_computed_tokens + n <= len(seq.token_ids)
        assert len(seq.block_table) * pool.block_size >= seq.num_computed_tokens + n
    for lane, queue in scheduler.waiting.items():
        head = [seq for seq in plan.preempted if seq.lane == lane]
        assert list(queue)[:len(head)] == head[::-1], "a victim must go to the head of its queue"


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([8, 16, 32]))
    num_blocks = draw(st.integers(8, 120))
    config = SchedulerConfig(
        token_budget=draw(st.integers(8, 600)),
        max_model_len=4096,
        watermark=draw(st.sampled_from([0.0, 0.1, 0.2])),
        fast_lane_share=draw(st.sampled_from([0.0, 0.3, 0.5])),
        fast_lane_protection=draw(st.sampled_from(["reserve", "preempt", "none"])),
        fast_lane_max_wait_steps=draw(st.integers(0, 4)),
        victim_policy=draw(st.sampled_from(["cheapest", "newest", "most_blocks"])),
        policy=draw(st.sampled_from(["continuous", "static"])),
        max_num_seqs=draw(st.one_of(st.none(), st.integers(1, 16))),
        head_of_line_patience=draw(st.integers(1, 40)),
    )
    systems = draw(st.lists(st.lists(st.integers(0, 50), min_size=1, max_size=40), min_size=1, max_size=3))
    requests = []
    for i in range(draw(st.integers(1, 25))):
        suffix = draw(st.lists(st.integers(0, 999), min_size=1, max_size=300))
        shared = draw(st.sampled_from([[], *systems]))  # several requests on one system prompt
        requests.append(SimRequest(
            arrival_s=draw(st.floats(0, 0.5)),
            prompt_token_ids=shared + suffix,
            params=SamplingParams(max_tokens=draw(st.integers(1, 200)),
                                  ignore_eos=draw(st.booleans())),
            lane=draw(st.sampled_from([None, "fast", "normal"])),
            request_id=f"r{i}"))
    return config, num_blocks, block_size, requests


@SETTINGS
@given(workloads())
def test_invariants_hold_and_every_request_finishes(workload):
    config, num_blocks, block_size, requests = workload
    model = FakeModel(vocab_size=1000, eos_token_id=0, eos_probability=0.02)
    result = simulate(config, num_blocks, block_size, requests, model=model,
                      on_step=check_invariants, max_steps=200_000)
    assert len(result.sequences) == len(requests)
    for seq in result.sequences:
        assert seq.is_finished
        if seq.finish_reason is FinishReason.ERROR:
            # only a request that can never fit is rejected, and it says why
            assert seq.num_prompt_tokens + seq.params.max_tokens > config.max_model_len or \
                -(-(seq.num_prompt_tokens + seq.params.max_tokens) // block_size) > num_blocks
            assert "exceeds" in seq.error or "pool has" in seq.error
        else:
            assert seq.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
            assert 1 <= seq.num_output_tokens <= seq.params.max_tokens
    stats = result.final_stats
    assert stats.used == stats.pinned == 0


@SETTINGS
@given(workloads())
def test_output_is_independent_of_scheduling(workload):
    """Preemption, chunking and batching never change a request's tokens: the same
    requests on a huge pool and budget (no preemption, no chunking) give the same output."""
    config, num_blocks, block_size, requests = workload
    model = FakeModel(vocab_size=1000, eos_token_id=0, eos_probability=0.02)
    squeezed = simulate(config, num_blocks, block_size, requests, model=model)
    roomy = simulate(SchedulerConfig(token_budget=100_000, max_model_len=4096), 10_000, block_size,
                     requests, model=FakeModel(vocab_size=1000, eos_token_id=0, eos_probability=0.02))
    by_id = {seq.request_id: seq for seq in roomy.sequences}
    for seq in squeezed.sequences:
        if seq.finish_reason is not FinishReason.ERROR:
            assert seq.output_token_ids == by_id[seq.request_id].output_token_ids
