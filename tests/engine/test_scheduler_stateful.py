"""A rule-based (stateful) hypothesis test of scheduler + block pool: requests arrive in both
lanes, many on shared prefixes, into tight pools where the fast lane evicts; requests are
aborted, resumed with tokens emitted elsewhere, prefixes pinned and unpinned, and steps run in
any order. Every invariant is checked after every rule; at the end everything drains, every
request finished with a reason, and its output is what the fake model gives for its position
(so preemption, eviction and resumption never changed a token)."""

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from producer.protocol import SamplingParams
from worker.engine.blocks import BlockPool
from worker.engine.scheduler import Scheduler
from worker.engine.scheduler_config import SchedulerConfig
from worker.engine.sequence import FinishReason, Sequence, Status
from worker.engine.simulator import FakeModel

from .test_scheduler_properties import check_invariants

PREFIXES = [list(range(100, 116)), list(range(200, 232)), list(range(300, 308))]


class SchedulerMachine(RuleBasedStateMachine):
    # Tight pools, and the fast lane's eviction more often than not: where the review's crash lived.
    @initialize(block_size=st.sampled_from([8, 16]), num_blocks=st.integers(6, 24),
                token_budget=st.integers(4, 128), watermark=st.sampled_from([0.0, 0.2]),
                protection=st.sampled_from(["preempt", "preempt", "reserve", "none"]),
                max_wait=st.integers(0, 2), victim_policy=st.sampled_from(["cheapest", "newest", "most_blocks"]),
                fast_prompt_tokens=st.sampled_from([16, 48, 256]))
    def setup(self, block_size, num_blocks, token_budget, watermark, protection, max_wait, victim_policy,
              fast_prompt_tokens):
        config = SchedulerConfig(token_budget=token_budget, max_model_len=512, watermark=watermark,
                                 fast_lane_protection=protection, fast_lane_max_wait_steps=max_wait,
                                 victim_policy=victim_policy, fast_prompt_tokens=fast_prompt_tokens,
                                 head_of_line_patience=8)
        self.time = 0.0
        self.scheduler = Scheduler(config, BlockPool(num_blocks, block_size), clock=lambda: self.time)
        self.model = FakeModel(vocab_size=1000, eos_token_id=0, eos_probability=0.05)
        self.sequences: list[Sequence] = []
        self.pins: list[list[int]] = []
        self.plan = None

    @rule(prefix=st.sampled_from([None, 0, 1, 2]), suffix=st.lists(st.integers(1, 999), min_size=1, max_size=24),
          max_tokens=st.integers(1, 40), lane=st.sampled_from([None, "fast", "normal"]),
          emitted=st.integers(0, 5))
    def add(self, prefix, suffix, max_tokens, lane, emitted):
        prompt = (PREFIXES[prefix] if prefix is not None else []) + suffix
        seq = Sequence(f"r{len(self.sequences)}", prompt, SamplingParams(max_tokens=max_tokens),
                       eos_token_ids=self.model.eos_token_ids, arrival_time=self.time)
        # a resumed request: tokens emitted by an earlier attempt come back as context and output
        for _ in range(min(emitted, max_tokens - 1)):
            token = self.model.next_token(seq)
            if token == self.model.eos_token_id:
                break
            seq.token_ids.append(token)
        self.sequences.append(self.scheduler.add(seq, lane))

    @precondition(lambda self: self.scheduler.has_work)
    @rule()
    def step(self):
        plan = self.scheduler.schedule()
        if plan.scheduled or not self._pinned_blocks():
            check_invariants(self.scheduler, plan)
        # else pinned prefixes hold the blocks every waiting request needs: nothing can run until
        # they are unpinned (teardown unpins, then everything must drain)
        self.scheduler.update(plan, self.model.execute(plan))
        self.time += 0.01

    @precondition(lambda self: self.scheduler.requests)
    @rule(data=st.data())
    def abort(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.scheduler.requests)))
        assert self.scheduler.finish_request(request_id, FinishReason.CANCELLED)

    @rule(prefix=st.sampled_from([0, 1, 2]))
    def pin(self, prefix):
        self.scheduler.pool.pin_prefix(PREFIXES[prefix])
        self.pins.append(PREFIXES[prefix])

    @precondition(lambda self: self.pins)
    @rule()
    def unpin(self):
        self.scheduler.pool.unpin_prefix(self.pins.pop())

    def _pinned_blocks(self) -> int:
        return sum(1 for block in self.scheduler.pool.blocks if block.pinned)

    @invariant()
    def pool_and_queues_agree(self):
        scheduler, pool = self.scheduler, self.scheduler.pool
        stats = pool.stats()
        assert stats.free + stats.used + stats.cached == stats.total == pool.num_blocks
        held = {b for seq in scheduler.running for b in seq.block_table}
        assert all(pool.blocks[b].ref_count > 0 for b in held)
        waiting = [seq for queue in scheduler.waiting.values() for seq in queue]
        assert len(waiting) == len(set(waiting)) and not set(waiting) & set(scheduler.running)
        assert all(seq.status in (Status.WAITING, Status.PREEMPTED) and not seq.block_table for seq in waiting)
        assert all(seq.status is Status.RUNNING for seq in scheduler.running)
        assert set(scheduler.requests.values()) == set(waiting) | set(scheduler.running)
        assert set(scheduler.decoding) | set().union(*scheduler.prefilling.values()) == set(scheduler.running)

    def teardown(self):
        if not hasattr(self, "scheduler"):
            return
        while self.pins:
            self.unpin()
        for _ in range(100_000):
            if not self.scheduler.has_work:
                break
            self.step()
        assert not self.scheduler.has_work, "did not drain"
        assert self.scheduler.pool.stats().used == 0  # nothing leaked
        for seq in self.sequences:
            assert seq.is_finished and seq.finish_reason is not None
            if seq.finish_reason in (FinishReason.STOP, FinishReason.LENGTH):
                expected = Sequence(seq.request_id, seq.prompt_token_ids, seq.params)
                for _ in range(seq.num_output_tokens):
                    expected.token_ids.append(self.model.next_token(expected))
                assert seq.token_ids == expected.token_ids


SchedulerMachine.TestCase.settings = settings(max_examples=400, stateful_step_count=60, deadline=None,
                                              suppress_health_check=[HealthCheck.too_slow])
test_scheduler_and_pool_under_any_sequence_of_events = SchedulerMachine.TestCase
