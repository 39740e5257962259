import pytest

from producer.protocol import SamplingParams
from worker.engine.blocks import BlockPool
from worker.engine.scheduler import Scheduler
from worker.engine.scheduler_config import SchedulerConfig
from worker.engine.sequence import FinishReason, Sequence
from worker.engine.simulator import FakeModel, SimRequest, simulate


def make_scheduler(num_blocks=64, block_size=16, **config):
    config.setdefault("max_model_len", 4096)
    return Scheduler(SchedulerConfig(**config), BlockPool(num_blocks, block_size), clock=lambda: 0.0)


def add(scheduler, request_id, prompt_len, max_tokens=8, lane=None, first_token=0, eos=None, **params):
    seq = Sequence(request_id, list(range(first_token, first_token + prompt_len)),
                   SamplingParams(max_tokens=max_tokens, **params), eos_token_ids=(eos,) if eos is not None else ())
    return scheduler.add(seq, lane)


def step(scheduler, model=FakeModel(vocab_size=1000)):
    plan = scheduler.schedule()
    finished = scheduler.update(plan, model.execute(plan))
    return plan, finished


def drain(scheduler, model=FakeModel(vocab_size=1000), limit=100_000):
    for _ in range(limit):
        if not scheduler.has_work:
            return
        step(scheduler, model)
    raise AssertionError("did not drain")


def request(prompt_len, max_tokens, arrival=0.0, lane=None, first_token=0, request_id=""):
    return SimRequest(arrival, list(range(first_token, first_token + prompt_len)),
                      SamplingParams(max_tokens=max_tokens, ignore_eos=True), lane, request_id)


# --- lanes -----------------------------------------------------------------------------
@pytest.mark.parametrize("prompt_len, max_tokens, asked, lane", [
    (256, 128, None, "fast"), (257, 128, None, "normal"), (10, 129, None, "normal"),
    (10, 10, "normal", "normal"), (10, 10, "fast", "fast"), (300, 10, "fast", "normal"),
])
def test_lane_rule_and_demotion(prompt_len, max_tokens, asked, lane):
    scheduler = make_scheduler(num_blocks=256)
    assert add(scheduler, "r", prompt_len, max_tokens, lane=asked).lane == lane


@pytest.mark.parametrize("share", [0.2, 0.3, 0.5])
def test_backlogged_lanes_split_prefill_tokens_by_share(share):
    config = SchedulerConfig(token_budget=512, fast_lane_share=share, max_model_len=4096)
    requests = [request(200, 2, 0.0, first_token=i * 1000) for i in range(60)]
    requests += [request(1000, 2, 0.0, first_token=100_000 + i * 1000) for i in range(20)]
    tokens = {"fast": 0, "normal": 0}

    def count(scheduler, plan):
        if scheduler.waiting["fast"] and scheduler.waiting["normal"]:  # both still backlogged
            for seq, n in plan.scheduled.items():
                if not seq.is_decoding:
                    tokens[seq.lane] += n
    simulate(config, num_blocks=10_000, block_size=16, requests=requests, on_step=count)
    assert sum(tokens.values()) > 5_000
    assert abs(tokens["fast"] / sum(tokens.values()) - share) <= 0.05


@pytest.mark.parametrize("lane, prompt_len", [("fast", 100), ("normal", 1000)])
def test_an_idle_lane_leaves_the_whole_budget_to_the_other(lane, prompt_len):
    config = SchedulerConfig(token_budget=256, fast_lane_share=0.5, max_model_len=4096)
    requests = [request(prompt_len, 1, 0.0, first_token=i * 2000) for i in range(60)]
    full_steps = []
    result = simulate(config, 10_000, 16, requests, on_step=lambda s, plan: full_steps.append(
        plan.num_tokens == 256 or not s.num_waiting))
    assert all(full_steps) and len(full_steps) > 20
    assert {seq.lane for seq in result.sequences} == {lane}


def test_fast_lane_is_served_while_normal_prompts_flood():
    config = SchedulerConfig(token_budget=512, max_model_len=8192)
    requests = [request(4000, 4, 0.0, first_token=i * 5000) for i in range(10)]
    requests.append(request(50, 4, 0.001, request_id="quick", first_token=999_000))
    result = simulate(config, 10_000, 16, requests)
    quick = next(s for s in result.sequences if s.request_id == "quick")
    first_normal_done = min(s.finish_time for s in result.sequences if s.lane == "normal")
    assert quick.lane == "fast" and quick.finish_time < first_normal_done


# --- budget, chunking, head-of-line ------------------------------------------------------
def test_long_prompt_is_prefilled_in_chunks_under_the_budget():
    scheduler = make_scheduler(num_blocks=256, token_budget=300)
    seq = add(scheduler, "long", 1000, 4)
    chunks = []
    while not seq.output_token_ids:
        plan, _ = step(scheduler)
        chunks.append(plan.scheduled[seq])
    assert chunks == [300, 300, 300, 100]


def test_decodes_are_served_before_prefill():
    scheduler = make_scheduler(num_blocks=256, token_budget=64)
    decoding = [add(scheduler, f"d{i}", 4, 50, first_token=i * 100) for i in range(10)]
    step(scheduler)
    add(scheduler, "long", 2000, 4, first_token=50_000)
    plan, _ = step(scheduler)
    assert all(plan.scheduled[seq] == 1 for seq in decoding)
    assert plan.num_tokens == 64


def test_head_of_line_request_is_skipped_then_admitted_when_memory_frees():
    scheduler = make_scheduler(num_blocks=40, watermark=0.2, head_of_line_patience=5)
    add(scheduler, "hog", 400, 100)  # 25 blocks at admission, up to 32
    step(scheduler)
    big = add(scheduler, "big", 200, 10, first_token=10_000)  # does not fit beside the hog
    small = add(scheduler, "small", 20, 4, first_token=20_000)
    plan, _ = step(scheduler)
    assert small in plan.scheduled and big not in plan.scheduled
    drain(scheduler)
    assert big.finish_reason is FinishReason.LENGTH and not scheduler.refused_since


def test_aged_request_is_not_jumped():
    scheduler = make_scheduler(num_blocks=40, watermark=0.2, head_of_line_patience=2)
    add(scheduler, "hog", 400, 100)
    step(scheduler)
    big = add(scheduler, "big", 300, 10, first_token=10_000)  # cannot fit even past the watermark
    step(scheduler)
    step(scheduler)
    assert big in scheduler.aged
    same_lane = add(scheduler, "same", 20, 200, first_token=20_000)
    other_lane = add(scheduler, "other", 20, 4, first_token=30_000)
    assert (big.lane, same_lane.lane, other_lane.lane) == ("normal", "normal", "fast")
    plan, _ = step(scheduler)
    assert same_lane not in plan.scheduled  # would fit, but big waited too long in its lane
    assert other_lane not in plan.scheduled  # the other lane must leave big's room free
    drain(scheduler)
    assert big.first_scheduled_time is not None and big.finish_reason is FinishReason.LENGTH


@pytest.mark.parametrize("patience", [1, 2, 3, 6])
def test_head_of_line_patience_runs_out_in_exactly_that_many_steps(patience):
    """Counted in engine steps, not admission passes: the normal lane gets two passes per step
    here (its own, then the work-conserving one), and the request is refused in both."""
    scheduler = make_scheduler(num_blocks=40, watermark=0.2, head_of_line_patience=patience)
    add(scheduler, "hog", 400, 100, lane="normal")  # leaves 14-15 blocks free while it decodes
    step(scheduler)
    big = add(scheduler, "big", 300, 10, lane="normal", first_token=10_000)  # 19 blocks: never fits
    observed = []
    for i in range(patience + 1):
        small = add(scheduler, f"small{i}", 4, 1, lane="normal", first_token=20_000 + i * 10)
        plan, _ = step(scheduler)
        assert big not in plan.scheduled
        observed.append((big in scheduler.aged, small in plan.scheduled))
        if small not in plan.scheduled:
            scheduler.finish_request(small.request_id)
    # jumped while patient; from the patience-th refused step on, nobody behind it is admitted
    assert observed == [(False, True)] * (patience - 1) + [(True, False)] * 2


@pytest.mark.parametrize("prompt_len, max_tokens, why", [
    (4000, 200, "exceeds the model length"), (1500, 100, "the pool has 64"), (0, 5, "empty prompt")])
def test_requests_that_can_never_fit_are_rejected_at_once(prompt_len, max_tokens, why):
    scheduler = make_scheduler(num_blocks=64, max_model_len=4096)
    seq = add(scheduler, "x", prompt_len, max_tokens)
    assert seq.finish_reason is FinishReason.ERROR and why in seq.error
    plan, _ = step(scheduler)
    assert plan.finished == [seq] and not plan.scheduled


def test_max_num_seqs_caps_running():
    scheduler = make_scheduler(num_blocks=256, max_num_seqs=3)
    for i in range(6):
        add(scheduler, f"r{i}", 10, 20, first_token=i * 100)
    step(scheduler)
    assert len(scheduler.running) == 3


# --- finishing -------------------------------------------------------------------------
class ScriptedModel(FakeModel):
    def __init__(self, tokens):
        super().__init__()
        self.tokens = tokens

    def next_token(self, seq):
        return self.tokens[seq.num_output_tokens]


@pytest.mark.parametrize("params, reason, length", [
    ({"eos": 7}, FinishReason.STOP, 3),
    ({"eos": 7, "ignore_eos": True}, FinishReason.LENGTH, 6),
    ({"stop_token_ids": [5]}, FinishReason.STOP, 2),
])
def test_finish_reasons(params, reason, length):
    scheduler = make_scheduler()
    seq = add(scheduler, "r", 4, 6, **params)
    drain(scheduler, ScriptedModel([3, 5, 7, 9, 9, 9, 9]))
    assert seq.finish_reason is reason and seq.num_output_tokens == length


def test_model_length_ends_a_request():
    scheduler = make_scheduler(max_model_len=20)
    seq = add(scheduler, "r", 10, 10)
    drain(scheduler)
    assert seq.finish_reason is FinishReason.LENGTH and len(seq.token_ids) == 20


def test_abort_frees_blocks_at_once():
    scheduler = make_scheduler(num_blocks=64)
    seq = add(scheduler, "r", 100, 50)
    waiting = add(scheduler, "w", 10, 5, first_token=500)
    step(scheduler)
    assert scheduler.finish_request("r") and scheduler.finish_request("w")
    assert seq.block_table == [] and scheduler.pool.stats().used == 0
    assert seq.finish_reason is FinishReason.CANCELLED and waiting.is_finished
    assert not scheduler.finish_request("r")
    plan, _ = step(scheduler)
    assert plan.finished == [seq, waiting]


def test_duplicate_request_id_is_refused():
    scheduler = make_scheduler()
    add(scheduler, "r", 5)
    with pytest.raises(ValueError, match="already"):
        add(scheduler, "r", 5)


# --- prefix caching --------------------------------------------------------------------
def test_shared_system_prompt_is_prefilled_once():
    system = list(range(5000, 5064))  # four full blocks
    requests = [SimRequest(i * 1.0, system + [i * 10 + k for k in range(1, 8)],
                           SamplingParams(max_tokens=3, ignore_eos=True), request_id=f"r{i}")
                for i in range(10)]
    computed = []
    simulate(SchedulerConfig(max_model_len=4096), 256, 16, requests,
             on_step=lambda s, plan: computed.extend(plan.scheduled.values()))
    result = simulate(SchedulerConfig(max_model_len=4096), 256, 16, requests)
    assert [s.num_cached_tokens for s in result.sequences] == [0] + [64] * 9
    assert sum(computed) == 71 + 9 * 7 + 10 * 2  # 2 decodes each after the prefill


def test_pinned_system_prompt_stays_resident_under_pressure():
    system = list(range(5000, 5064))
    scheduler = make_scheduler(num_blocks=24)
    scheduler.pool.pin_prefix(system)
    add(scheduler, "first", 0, 1)  # rejected: empty
    seq = Sequence("a", system + [1], SamplingParams(max_tokens=2, ignore_eos=True))
    scheduler.add(seq)
    drain(scheduler)
    for i in range(5):  # fill the pool with unrelated work, repeatedly
        add(scheduler, f"filler{i}", 300, 4, first_token=100_000 * (i + 1))
        drain(scheduler)
    again = scheduler.add(Sequence("b", system + [2], SamplingParams(max_tokens=2)))
    step(scheduler)
    assert again.num_cached_tokens == 64


# --- preemption ------------------------------------------------------------------------
def test_preemption_recomputes_and_reuses_cached_prefix():
    scheduler = make_scheduler(num_blocks=12, watermark=0.0)
    old = add(scheduler, "old", 64, 64)
    young = add(scheduler, "young", 60, 64, first_token=1000)
    preempted = []
    while scheduler.has_work:
        plan, _ = step(scheduler)
        preempted += plan.preempted
    assert preempted and scheduler.num_preemptions == len(preempted)
    assert young in preempted  # the cheaper one to recompute
    assert old.finish_reason is young.finish_reason is FinishReason.LENGTH
    assert young.num_preemptions >= 1 and scheduler.pool.prefix_hits > 0


def test_victim_goes_to_head_and_is_not_chosen_twice_in_a_row():
    scheduler = make_scheduler(num_blocks=8, watermark=0.0)
    seqs = [add(scheduler, f"r{i}", 15, 40, first_token=i * 100) for i in range(4)]
    add(scheduler, "later", 15, 40, first_token=900)
    victims = []
    while scheduler.has_work:
        plan, _ = step(scheduler)
        if plan.preempted:
            victim = plan.preempted[-1]
            assert scheduler.waiting[victim.lane].head(victim.tenant) is victim
        victims += plan.preempted
    assert len(victims) >= 3 and all(a is not b for a, b in zip(victims, victims[1:]))
    assert all(seq.finish_reason is FinishReason.LENGTH for seq in seqs)


def test_no_admission_in_a_step_that_preempted_and_cooldown_raises_watermark():
    scheduler = make_scheduler(num_blocks=10, watermark=0.0, cooldown_after_steps=2,
                               cooldown_watermark=0.5, calm_steps=5)
    for i in range(8):  # staggered lengths: they run out of room in consecutive steps
        add(scheduler, f"r{i}", 9 + i, 60, first_token=i * 100)
    saw_cooldown = saw_preemption = False
    while scheduler.has_work:
        before = set(scheduler.running)
        plan, _ = step(scheduler)
        if plan.preempted:
            saw_preemption = True
            assert not [seq for seq in plan.scheduled if seq not in before]
        saw_cooldown |= scheduler.num_steps < scheduler.cooldown_until
    assert saw_preemption and saw_cooldown


@pytest.mark.parametrize("protection", ["preempt", "reserve"])
def test_fast_lane_is_not_stuck_behind_a_full_pool(protection):
    config = SchedulerConfig(token_budget=2048, watermark=0.1, max_model_len=8192,
                             fast_lane_protection=protection, fast_lane_max_wait_steps=2)
    requests = [request(200, 1500, 0.0, first_token=i * 10_000) for i in range(12)]
    requests.append(request(30, 8, 1.0, request_id="quick", first_token=999_000))
    result = simulate(config, num_blocks=400, block_size=16, requests=requests)
    quick = next(s for s in result.sequences if s.request_id == "quick")
    assert quick.first_token_time - quick.arrival_time < 0.2  # a handful of steps, not minutes


@pytest.mark.parametrize("max_wait", [0, 1, 2, 4])
def test_fast_request_evicts_after_waiting_exactly_max_wait_steps(max_wait):
    """Counted in engine steps, not admission passes: the fast lane gets two passes per step
    here (its share, then what the normal lane left), and the request is refused in both."""
    scheduler = make_scheduler(num_blocks=16, watermark=0.0, fast_lane_protection="preempt",
                               fast_lane_max_wait_steps=max_wait)
    older, newer = (add(scheduler, f"n{i}", 100, 20, lane="normal", first_token=i * 1000) for i in range(2))
    step(scheduler)  # 7 blocks each: 2 free, and room to decode 12 tokens without growing
    fast = add(scheduler, "fast", 40, 4, lane="fast", first_token=50_000)  # needs 3 blocks
    for waited in range(max_wait):
        plan, _ = step(scheduler)
        assert fast not in plan.scheduled and not plan.preempted, f"evicted after {waited} steps"
    plan, _ = step(scheduler)
    assert fast in plan.scheduled and plan.preempted == [newer] and older in plan.scheduled


# --- static policy and slot utilisation ----------------------------------------------------
def test_static_policy_reproduces_the_briefs_example():
    requests = [request(1, n, 0.0, "normal", first_token=i) for i, n in enumerate([20, 50, 200, 800])]
    static = simulate(SchedulerConfig(policy="static", max_num_seqs=4), 1024, 16, requests)
    assert static.steps == 800 and static.decode_tokens == 1070
    utilisation = static.decode_tokens / (4 * static.steps)
    assert utilisation < 0.34
    assert (static.decode_tokens * 10, 4 * static.steps * 10) == (10_700, 32_000)  # ms at 10 ms/step


def test_static_batch_admits_nothing_until_it_finishes_and_continuous_fills_slots():
    lengths = [20, 50, 200, 800] * 25
    requests = [request(1, n, 0.0, "normal", first_token=i) for i, n in enumerate(lengths)]
    busy = {"static": [], "continuous": []}  # occupied slots in steps where requests wait

    def recorder(policy):
        return lambda scheduler, plan: scheduler.num_waiting and busy[policy].append(len(plan.scheduled))
    static = simulate(SchedulerConfig(policy="static", max_num_seqs=4), 4096, 16, requests,
                      on_step=recorder("static"))
    continuous = simulate(SchedulerConfig(max_num_seqs=4), 4096, 16, requests,
                          on_step=recorder("continuous"))
    assert static.steps == 25 * 800 and static.decode_tokens == continuous.decode_tokens == 26_750
    assert static.decode_tokens / (4 * static.steps) < 0.34
    assert sum(busy["continuous"]) == 4 * len(busy["continuous"])  # every slot refilled at once
    assert continuous.decode_tokens / (4 * continuous.steps) > 0.9  # all but the tail


def test_decodes_never_exceed_the_budget():
    scheduler = make_scheduler(num_blocks=256, token_budget=8)
    for i in range(20):
        add(scheduler, f"r{i}", 4, 50, first_token=i * 100)
    for _ in range(12):
        plan, _ = step(scheduler)
        assert plan.num_tokens <= 8
    assert sum(seq.num_output_tokens for seq in scheduler.running) > 8


def test_a_step_that_preempts_admits_nobody():
    scheduler = make_scheduler(num_blocks=8, watermark=0.0)
    first = add(scheduler, "a", 64, 60)
    add(scheduler, "b", 48, 60, first_token=1000)
    step(scheduler)  # both prefilled: 7 of 8 blocks
    small = add(scheduler, "small", 5, 4, first_token=5000)
    plan, _ = step(scheduler)  # a takes the last block; b must preempt a
    assert plan.preempted == [first] and small not in plan.scheduled
    plan, _ = step(scheduler)
    assert small in plan.scheduled  # room is there, and this step preempted nobody


def test_victim_is_not_the_same_twice_in_a_row_when_there_is_a_choice():
    scheduler = make_scheduler(num_blocks=64)
    a, b, c = (add(scheduler, name, n, 100, first_token=i * 1000)
               for i, (name, n) in enumerate([("a", 100), ("b", 10), ("c", 60)]))
    step(scheduler)
    assert scheduler._pick_victim(exclude=a) is b  # fewest computed tokens
    scheduler.last_victim = b
    assert scheduler._pick_victim(exclude=a) is c
    assert scheduler._pick_victim(exclude=c) is a


def test_fast_lane_eviction_of_the_only_holder_of_its_cached_prefix_still_admits_it():
    """The review's crash: the fast request's prefix blocks cost nothing while the victim holds
    them and one free block each once it is evicted; the admission must count them after the
    eviction (it used to fail an `assert pool.allocate(...)` and take the worker down)."""
    scheduler = make_scheduler(num_blocks=10, block_size=8)
    system = list(range(500, 516))  # 16 tokens: two full blocks
    scheduler.add(Sequence("A", list(range(1000, 1040)), SamplingParams(max_tokens=8)), "normal")
    scheduler.add(Sequence("V", system + [7], SamplingParams(max_tokens=8)), "normal")
    step(scheduler)
    fast = scheduler.add(Sequence("F", system + list(range(600, 620)), SamplingParams(max_tokens=8)), "fast")
    for _ in range(8):
        plan, _ = step(scheduler)
        if fast in plan.scheduled:
            break
    assert fast in plan.scheduled and "V" in [seq.request_id for seq in plan.preempted]
    assert fast.num_cached_tokens == 16  # admitted onto the prefix it evicted V from
    drain(scheduler)
    assert scheduler.pool.num_free_blocks == scheduler.pool.num_blocks
