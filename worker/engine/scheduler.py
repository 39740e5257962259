"""Iteration-level scheduling: every step is a fresh decision of who computes what.

The three decisions of a step, in the brief's order:
  1. running sequences grow first: each decode gets its token, preempting by recompute
     when the pool cannot hold the growth;
  2. the rest of the token budget goes to prefills (continued chunks, then admissions),
     split between the fast and normal lanes, unused share flowing to the other lane;
  3. the batch is whatever 1 and 2 produced: no fixed size, only budget and memory.
Under an ITL SLO (config.itl_slo_ms) a step with decodes has a budget of its own: the decodes plus
the prefill tokens that the cost model says keep the step's turn under the SLO, the fast lane's
first (a step without decodes keeps the whole token budget).
Pure Python: no torch, no redis. The runner executes the StepPlan; `update` applies
the sampled tokens.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Mapping

from producer.protocol import LANES, Lane, pick_lane
from worker.engine.blocks import Block, BlockPool
from worker.engine.cost_model import CostModel, kv_reads
from worker.engine.fairness import TenantQueues, TenantShare, VirtualCounters
from worker.engine.plan import StepPlan
from worker.engine.scheduler_config import SchedulerConfig
from worker.engine.sequence import FinishReason, Sequence, Status
from worker.engine.victims import pick_victim


class Scheduler:
    def __init__(self, config: SchedulerConfig, pool: BlockPool,
                 clock: Callable[[], float] = time.monotonic, cost: CostModel | None = None) -> None:
        """`cost`: what a step costs, for the ITL SLO (the engine's fitted model; needed with one)."""
        if config.itl_slo_ms is not None and cost is None:
            raise ValueError("an ITL SLO needs a cost model to size the steps with")
        self.config = config
        self.pool = pool
        self.clock = clock
        self.cost = cost
        self.waiting: dict[Lane, TenantQueues] = {lane: TenantQueues() for lane in LANES}
        self.fair = VirtualCounters()
        self.running_by_tenant = Counter()
        # running = decoding + prefilling; dicts used as ordered sets, oldest first
        self.running: dict[Sequence, None] = {}
        self.decoding: dict[Sequence, None] = {}
        self.prefilling: dict[Lane, dict[Sequence, None]] = {lane: {} for lane in LANES}
        self.aged: dict[Sequence, None] = {}  # waited past patience: admitted before anyone else
        # waiting request -> the step of its first refused admission. Waits are measured in steps
        # from it because a lane may get several admission passes in one step.
        self.refused_since: dict[Sequence, int] = {}
        self.requests: dict[str, Sequence] = {}
        self.pending_finished: list[Sequence] = []
        self.num_steps = 0
        self.num_preemptions = 0
        self.last_victim: Sequence | None = None
        self.preempting_streak = 0  # consecutive steps that preempted
        self.cooldown_until = 0  # step number; admissions use a higher watermark before it
        self.static_batch_open = True
        self.admission_refused = False  # this step, some waiting request did not fit

    # --- requests in and out -----------------------------------------------------------
    def add(self, seq: Sequence, requested_lane: Lane | None = None) -> Sequence:
        if seq.request_id in self.requests:
            raise ValueError(f"request id {seq.request_id!r} is already in the engine")
        cfg = self.config
        seq.lane = pick_lane(seq.num_prompt_tokens, seq.params.max_tokens, requested_lane,
                             cfg.fast_prompt_tokens, cfg.fast_max_tokens)
        problem = self._never_fits(seq)
        if problem:
            seq.finish(FinishReason.ERROR, self.clock(), error=problem)
            self.pending_finished.append(seq)
            return seq
        seq.length_limit = min(seq.num_prompt_tokens + seq.params.max_tokens, cfg.max_model_len)
        self.requests[seq.request_id] = seq
        self.fair.arrive(seq.tenant)
        self.waiting[seq.lane].append(seq)
        return seq

    def set_tenants(self, shares: Mapping[str, TenantShare]) -> None:
        """The tenants' weights and running caps (from the registry); a tenant not named has weight 1."""
        self.fair.shares = dict(shares)

    def _never_fits(self, seq: Sequence) -> str | None:
        length = seq.num_prompt_tokens + seq.params.max_tokens
        if seq.num_prompt_tokens == 0:
            return "empty prompt"
        if length > self.config.max_model_len:
            return (f"prompt ({seq.num_prompt_tokens} tokens) + max_tokens ({seq.params.max_tokens})"
                    f" exceeds the model length ({self.config.max_model_len})")
        if self.pool.blocks_for(length) > self.pool.num_blocks:
            return (f"prompt + max_tokens ({length} tokens) needs {self.pool.blocks_for(length)} KV"
                    f" blocks; the pool has {self.pool.num_blocks}")
        return None

    def finish_request(self, request_id: str, reason: FinishReason = FinishReason.CANCELLED) -> bool:
        """End a request now (cancel, deadline, stop string): its blocks are freed at once."""
        seq = self.requests.get(request_id)
        if seq is None:
            return False
        if seq.status is Status.RUNNING:
            self._leave_running(seq)
        else:
            self.waiting[seq.lane].remove(seq)
            self.aged.pop(seq, None)
            self.refused_since.pop(seq, None)
        self._finish(seq, reason)
        self.pending_finished.append(seq)
        return True

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        seq.finish(reason, self.clock())
        del self.requests[seq.request_id]
        self.fair.leave(seq.tenant)

    def _leave_running(self, seq: Sequence) -> None:
        self.pool.free_sequence(seq)
        del self.running[seq]
        self.running_by_tenant[seq.tenant] -= 1
        self.decoding.pop(seq, None)
        self.prefilling[seq.lane].pop(seq, None)

    @property
    def has_work(self) -> bool:
        return bool(self.requests or self.pending_finished)

    @property
    def num_waiting(self) -> int:
        return sum(len(queue) for queue in self.waiting.values())

    # --- one step ----------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        plan = StepPlan(finished=self.pending_finished)
        self.pending_finished = []
        self.num_steps += 1
        self._schedule_decodes(plan)
        may_admit = self._may_admit()
        self.admission_refused = False
        budget = self._step_budget(plan)
        if self.config.fairness == "vtc" and may_admit:
            budget = self._serve_under_share(plan, budget)
        if budget < self.config.token_budget:  # held to the ITL SLO: the fast lane's prefills first
            fast_quota = budget - plan.num_tokens
        else:
            fast_has_work = bool(self.prefilling["fast"] or self.waiting["fast"])
            fast_quota = int((budget - plan.num_tokens) * self.config.fast_lane_share) if fast_has_work else 0
        self._fill_lane("fast", fast_quota, plan, may_admit)
        self._fill_lane("normal", budget - plan.num_tokens, plan, may_admit)
        for lane in LANES:  # work-conserving: what one lane left, the other may take
            self._fill_lane(lane, budget - plan.num_tokens, plan, may_admit)
        if not plan.scheduled and self.running:
            self._unstick(plan)
        if self.config.policy == "static":
            # the batch closes once it is full: a refusal, no seat, or nobody left to admit
            self.static_batch_open = may_admit and not (
                self.admission_refused or not self._has_seat() or not self.num_waiting)
        self._track_preemption(plan)
        return plan

    def _step_budget(self, plan: StepPlan) -> int:
        """The token budget, or under an ITL SLO while sequences decode, the step's decodes and the
        prefill tokens that keep its turn within the SLO (none where the decodes alone fill it: new
        requests then wait for running ones to end; the SLO holds, their TTFT pays)."""
        slo_ms, budget = self.config.itl_slo_ms, self.config.token_budget
        if slo_ms is None or not self.decoding:  # decodes sitting a step out wait on it too
            return budget
        decodes = plan.num_tokens  # each samples a row
        allowance = self.cost.prefill_allowance(decodes, kv_reads(plan), decodes, slo_ms / 1000)
        return min(budget, decodes + allowance)

    def _schedule_decodes(self, plan: StepPlan) -> None:
        # The hot loop at large batch sizes, so it is written out flat: each decode is one
        # token, and needs a block only when its last block is full.
        budget, slots_per_block, scheduled = self.config.token_budget, self.pool.block_size, plan.scheduled
        for seq in list(self.decoding):
            if len(scheduled) >= budget:
                break
            if seq.status is not Status.RUNNING:
                continue  # preempted earlier in this loop
            if len(seq.block_table) * slots_per_block > seq.num_computed_tokens or self._make_room(seq, 1, plan):
                scheduled[seq] = 1
        plan.num_tokens = len(scheduled)

    def _make_room(self, seq: Sequence, num_tokens: int, plan: StepPlan) -> bool:
        """Allocate for a running sequence's growth, preempting others while the pool is
        short; preempts the sequence itself when nobody else is left."""
        while not self.pool.allocate(seq, plan.scheduled.get(seq, 0) + num_tokens):
            victim = self._pick_victim(exclude=seq)
            self._preempt(victim or seq, plan)
            if victim is None:
                return False
        return True

    def _pick_victim(self, exclude: Sequence, lane: Lane | None = None) -> Sequence | None:
        candidates = [s for s in self.running if s is not exclude and lane in (None, s.lane)]
        tenants = {s.tenant for s in candidates}
        if len(tenants) > 1 and self.config.fairness == "vtc":  # the most-served tenant gives way first
            most = max(tenants, key=self.fair.counter)
            candidates = [s for s in candidates if s.tenant == most]
        # a fast-lane eviction always takes the newest normal-lane sequence
        policy = "newest" if lane is not None else self.config.victim_policy
        return pick_victim(candidates, policy, self.last_victim)

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        """Recompute later: drop the KV (full blocks stay in the prefix cache for re-entry)
        and go back to the HEAD of the lane's queue; it already paid for one prefill."""
        plan.remove(seq)
        self._leave_running(seq)
        seq.num_computed_tokens = 0
        seq.status = Status.PREEMPTED
        seq.num_preemptions += 1
        self.waiting[seq.lane].appendleft(seq)
        plan.preempted.append(seq)
        self.num_preemptions += 1
        self.last_victim = seq

    def _may_admit(self) -> bool:
        if self.config.policy == "static":
            if not self.running:
                self.static_batch_open = True
            return self.static_batch_open
        return True

    def _fill_lane(self, lane: Lane, allowance: int, plan: StepPlan, may_admit: bool) -> None:
        stop_at = plan.num_tokens + allowance
        for seq in list(self.prefilling[lane]):
            room = stop_at - plan.num_tokens
            want = seq.num_uncomputed_tokens - plan.scheduled.get(seq, 0)
            num_tokens = min(want, room, self._tokens_that_fit(seq, plan))
            if num_tokens > 0:
                self.pool.allocate(seq, plan.scheduled.get(seq, 0) + num_tokens)
                plan.add(seq, num_tokens)
        # memory is short in a step that preempted: an admission would only be evicted again, unless
        # its tenant is under-served, whose admissions evict the most-served tenant's sequences
        if may_admit:
            self._admit(lane, stop_at, plan, under_served_only=bool(plan.preempted))

    def _tokens_that_fit(self, seq: Sequence, plan: StepPlan) -> int:
        slots = (len(seq.block_table) + self.pool.num_free_blocks) * self.pool.block_size
        return slots - seq.num_computed_tokens - plan.scheduled.get(seq, 0)

    def _admit(self, lane: Lane, stop_at: int, plan: StepPlan, under_served_only: bool = False) -> None:
        queues, skipped = self.waiting[lane], []
        admitted = Counter()  # tokens admitted this step, by tenant: not charged to their counters yet
        while queues and plan.num_tokens < stop_at and self._has_seat():
            tenant = self._next_tenant(queues, admitted, under_served_only)
            if tenant is None:
                break  # every tenant with a request waiting is at its running cap
            seq = queues.pop(tenant)
            if self._try_admit(seq, stop_at - plan.num_tokens, plan):
                admitted[tenant] += plan.scheduled[seq]
                continue
            skipped.append(seq)  # head-of-line: it does not fit now, smaller ones may
            self._note_refusal(seq)
            if seq in self.aged or len(skipped) > self.config.max_admission_skips:
                break  # nobody in its lane jumps a request that has waited too long
        for seq in reversed(skipped):
            queues.appendleft(seq)
        self.admission_refused = self.admission_refused or bool(skipped)

    def _next_tenant(self, queues: TenantQueues, admitted: Counter, under_served_only: bool = False) -> str | None:
        """Whose waiting request is admitted next (fairness.py): the least-served tenant's, or with
        "fifo" the earliest-arrived head's; never a tenant's at its running cap; with
        `under_served_only`, only a tenant that may evict another's sequences to fit."""
        tenants = [tenant for tenant in queues.tenants() if self._tenant_has_seat(tenant)
                   and not (under_served_only and self._fairness_victim(tenant) is None)]
        if len(tenants) <= 1:
            return tenants[0] if tenants else None
        if self.config.fairness == "fifo":
            return min(tenants, key=lambda tenant: queues.head(tenant).arrival_time)
        return min(tenants, key=lambda tenant: (self.fair.counter(tenant, admitted[tenant]),
                                                queues.head(tenant).arrival_time))

    def _serve_under_share(self, plan: StepPlan, budget: int) -> int:
        """vtc: a tenant below its weighted share of the running sequences (_under_share_next) has
        its oldest prefill's next chunk, or else its next waiting request, computed before anyone
        else's prefill, the most-served other tenant's newest decodes sitting this step out (KV kept)
        until the chunk fits the step's budget. Otherwise, where a full step is compute-bound (a CPU's,
        or any under an ITL SLO) a quiet tenant's request waits for a flood's sequences to end before
        it starts, and again before each chunk of its prompt: seconds on a CPU. One sequence a step;
        two backlogged tenants at their shares never trade decodes. -> the step's budget."""
        picked = self._under_share_next()
        if picked is None:
            return budget
        seq, most = picked
        waiting = seq.status is not Status.RUNNING
        if waiting:
            self.waiting[seq.lane].remove(seq)
        # a chunk as large as a step with no decodes could take within the SLO (at least a token)
        need = min(seq.num_uncomputed_tokens if not waiting else len(seq.token_ids),
                   max(1, self._step_budget(StepPlan())))
        newest_first = (other for other in reversed(self.running)
                        if other.tenant == most and other in self.decoding and plan.scheduled.get(other) == 1)
        deferred: list[Sequence] = []
        while budget - plan.num_tokens < need and (victim := next(newest_first, None)) is not None:
            plan.remove(victim)
            deferred.append(victim)
            budget = self._step_budget(plan)
        room = budget - plan.num_tokens
        if waiting and room > 0 and self._try_admit(seq, room, plan):
            return budget
        if not waiting and (num_tokens := min(need, room, self._tokens_that_fit(seq, plan))) > 0:
            self.pool.allocate(seq, num_tokens)
            plan.add(seq, num_tokens)
            return budget
        if waiting:
            self.waiting[seq.lane].appendleft(seq)
        for victim in deferred:
            if victim.status is Status.RUNNING:  # not preempted meanwhile
                plan.add(victim, 1)
        return self._step_budget(plan)

    def _under_share_next(self) -> tuple[Sequence, str] | None:
        """Of the least-served tenant (fast lane first) that would still be within its weighted share
        of the running sequences with one more, while another tenant runs that it is not ahead of by
        more than a step's budget: its oldest prefill, or else the head of its waiting requests; and
        that other tenant, the most served (_most_served_other)."""
        if not self.running or len(self.fair.active) < 2:  # a lone tenant: nobody to give way
            return None
        total_weight = sum(self.fair.share(tenant).weight for tenant in self.fair.active)

        def under_share(tenant: str) -> bool:  # with one sequence more, still within its share
            seats = len(self.running) + 1
            return self.running_by_tenant[tenant] + 1 <= self.fair.share(tenant).weight / total_weight * seats

        for lane in LANES:
            candidates: dict[str, Sequence] = {}
            for seq in self.prefilling[lane]:
                if seq.tenant not in candidates and under_share(seq.tenant):
                    candidates[seq.tenant] = seq
            if self._has_seat():
                queue = self.waiting[lane]
                for tenant in queue.tenants():
                    if tenant not in candidates and self._tenant_has_seat(tenant) and under_share(tenant):
                        candidates[tenant] = queue.head(tenant)
            eligible = {tenant: most for tenant in candidates if (most := self._most_served_other(tenant))}
            if eligible:
                tenant = min(eligible, key=self.fair.counter)
                return candidates[tenant], eligible[tenant]
        return None

    def _most_served_other(self, tenant: str) -> str | None:
        """The running tenant other than `tenant` served the most, unless `tenant` is ahead of it by
        more than a step's budget (the margin lets a prompt's chunks follow each other: each one
        puts its tenant a chunk ahead of a tenant whose decodes gave way)."""
        others = {seq.tenant for seq in self.running if seq.tenant != tenant}
        most = max(others, key=self.fair.counter, default=None)
        if most is None or self.fair.counter(tenant) > self.fair.counter(most) + self.config.token_budget:
            return None
        return most

    def _has_seat(self) -> bool:
        cap = self.config.max_num_seqs
        return cap is None or len(self.running) < cap

    def _tenant_has_seat(self, tenant: str) -> bool:
        cap = self.fair.share(tenant).max_running
        return cap is None or self.running_by_tenant[tenant] < cap

    def _try_admit(self, seq: Sequence, room: int, plan: StepPlan) -> bool:
        pool = self.pool
        hits = pool.match_prefix(seq)
        num_cached = len(hits) * pool.block_size
        num_tokens = min(len(seq.token_ids) - num_cached, room)
        if pool.num_free_blocks - pool.admission_cost(seq, hits, num_tokens) < self._admission_floor(seq):
            if not (self._evict_for_fast_lane(seq, hits, num_tokens, plan)
                    or self._evict_for_fairness(seq, hits, num_tokens, plan)):
                return False
        pool.take_prefix(seq, hits)
        seq.num_computed_tokens = num_cached
        if seq.status is Status.WAITING:
            seq.num_cached_tokens = num_cached
            seq.first_scheduled_time = self.clock()
        if not pool.allocate(seq, num_tokens):  # admission_cost said it fits: a bug, not a full pool
            raise RuntimeError(f"admitting {seq.request_id!r}: {num_tokens} tokens did not fit after the "
                               f"admission check ({pool.num_free_blocks} free blocks)")
        seq.status = Status.RUNNING
        self.running[seq] = None
        self.running_by_tenant[seq.tenant] += 1
        self.prefilling[seq.lane][seq] = None
        self.aged.pop(seq, None)
        self.refused_since.pop(seq, None)
        plan.add(seq, num_tokens)
        return True

    def _admission_floor(self, seq: Sequence) -> float:
        """Free blocks an admission must leave behind."""
        cfg = self.config
        if self._starving(seq) or not self.running:
            return 0  # an idle pool, or a request that waited too long, takes what there is
        share = cfg.watermark + (cfg.cooldown_watermark if self.num_steps < self.cooldown_until else 0)
        if seq.lane == "normal" and cfg.fast_lane_protection == "reserve":
            share += cfg.fast_lane_reserve
        # the other lane's oldest aged request keeps the room for its first chunk, so memory
        # freed by finishing sequences piles up for it instead of going to newcomers
        aged = next((s for s in self.aged if s.lane != seq.lane and self._starving(s)), None)
        held = self.pool.blocks_for(min(len(aged.token_ids), cfg.token_budget)) if aged else 0
        return share * self.pool.num_blocks + held

    def _starving(self, seq: Sequence) -> bool:
        """It waited past its patience (aged) and it is its tenant's turn: the least-served tenant of
        those waiting in its lane (fairness.py). A request waiting for its tenant's turn is not
        starving: were it let past the watermark, a flooding tenant's many aged requests would take
        the memory that frees up before a quieter tenant's turn came."""
        if seq not in self.aged:
            return False
        if self.config.fairness == "fifo":
            return True
        waiting = self.waiting[seq.lane].tenants()
        return self.fair.counter(seq.tenant) <= min(map(self.fair.counter, waiting), default=0.0)

    def _evict_for_fast_lane(self, seq: Sequence, hits: list[Block], num_tokens: int, plan: StepPlan) -> bool:
        """A fast request that has waited fast_lane_max_wait_steps steps since its first refusal
        evicts the newest normal-lane sequences until it fits. Its cost is counted anew after each
        eviction: a victim may have been the last holder of the request's cached prefix blocks,
        which then cost a free block each."""
        cfg = self.config
        if (seq.lane != "fast" or cfg.fast_lane_protection != "preempt"
                or self._steps_waited(seq) < cfg.fast_lane_max_wait_steps):
            return False
        while self.pool.num_free_blocks < self.pool.admission_cost(seq, hits, num_tokens):
            victim = self._pick_victim(exclude=seq, lane="normal")
            if victim is None:
                return False
            self._preempt(victim, plan)
        return True

    def _evict_for_fairness(self, seq: Sequence, hits: list[Block], num_tokens: int, plan: StepPlan) -> bool:
        """A request of an under-served tenant (its counter behind a running tenant's by more than a
        step's budget) evicts that most-served tenant's newest sequences until it fits: a tenant
        that floods the pool cannot keep a quieter one waiting for memory (fairness.py). The margin
        keeps two even tenants from evicting each other back and forth."""
        if self._fairness_victim(seq.tenant) is None:
            return False
        while self.pool.num_free_blocks < self.pool.admission_cost(seq, hits, num_tokens):
            victim = self._fairness_victim(seq.tenant)
            if victim is None:
                return False
            self._preempt(victim, plan)
        return True

    def _fairness_victim(self, tenant: str) -> Sequence | None:
        """The newest running sequence of the most-served running tenant, if that tenant is ahead of
        `tenant` by more than a step's budget (vtc only)."""
        if self.config.fairness != "vtc":
            return None
        ahead = self.fair.counter(tenant) + self.config.token_budget
        tenants = {seq.tenant for seq in self.running}
        most = max(tenants, key=self.fair.counter, default=None)
        if most is None or self.fair.counter(most) <= ahead:
            return None
        return pick_victim([seq for seq in self.running if seq.tenant == most], "newest", self.last_victim)

    def _steps_waited(self, seq: Sequence) -> int:
        """Whole steps since the step of the request's first refused admission (0: none yet)."""
        return self.num_steps - self.refused_since.get(seq, self.num_steps)

    def _note_refusal(self, seq: Sequence) -> None:
        """Head-of-line aging: patience runs out in the head_of_line_patience-th step, counting
        the step of the first refusal as the first."""
        self.refused_since.setdefault(seq, self.num_steps)
        if self._steps_waited(seq) + 1 >= self.config.head_of_line_patience:
            self.aged[seq] = None

    def _unstick(self, plan: StepPlan) -> None:
        """Every running sequence is mid-prefill and the pool is full: let the oldest
        finish its prefill, at the others' expense, so the step is never empty."""
        seq = next(iter(self.running))
        room = len(seq.block_table) * self.pool.block_size - seq.num_computed_tokens
        num_tokens = min(seq.num_uncomputed_tokens, self.config.token_budget,
                         room + self.pool.block_size)
        if self._make_room(seq, num_tokens, plan):
            plan.add(seq, num_tokens)

    def _track_preemption(self, plan: StepPlan) -> None:
        self.preempting_streak = self.preempting_streak + 1 if plan.preempted else 0
        if self.preempting_streak >= self.config.cooldown_after_steps:
            self.cooldown_until = self.num_steps + self.config.calm_steps

    # --- results of a step -------------------------------------------------------------
    def update(self, plan: StepPlan, sampled: Mapping[Sequence, int]) -> list[Sequence]:
        """Apply a step's results; returns the sequences that finished."""
        # Runs for every sequence of every step: names are bound locally on purpose.
        now, running, commit, decoding, token_of, charge = self.clock(), Status.RUNNING, self.pool.commit, \
            self.decoding, sampled.get, self.fair.charge
        finished = []
        for seq, num_tokens in plan.scheduled.items():
            if seq.status is not running:
                continue  # ended while the step ran
            seq.num_computed_tokens += num_tokens
            commit(seq, num_tokens)
            charge(seq.tenant, num_tokens)
            token = token_of(seq)
            if token is None:
                continue  # a prefill chunk that does not reach the end yet
            seq.token_ids.append(token)
            if seq.first_token_time is None:
                seq.first_token_time = now
            if seq not in decoding:
                del self.prefilling[seq.lane][seq]
                decoding[seq] = None
            if token in seq.stop_token_ids:
                reason = FinishReason.STOP
            elif len(seq.token_ids) >= seq.length_limit:
                reason = FinishReason.LENGTH
            else:
                continue
            self._leave_running(seq)
            self._finish(seq, reason)
            finished.append(seq)
        return finished
