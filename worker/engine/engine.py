"""Engine.step(): schedule -> run -> sample -> update -> outputs.

One engine owns one model on one device: the scheduler and block pool decide, the
runner computes, the sampler picks tokens, and each request's detokenizer turns them
into text deltas. Pure: knows nothing of Redis.

A step that raises (a bug, or an input that breaks the model) does not end the engine: the
scheduler and pool start afresh, the model and the requests stay, and each request is
recomputed from the tokens it has reported. The failure counts against the requests of that
step, which become suspects: they go back into the scheduler one at a time, each on probation
until it reports a token past the point where it failed (then its count is cleared). A failed
step during a probation counts against the suspect alone. So a poison request is soon the only
one blamed, and once in `max_step_failures` failed steps it is ended with an error
(`RequestOutput.poisoned`) while everyone else is served, their tokens as if nothing happened.

Pinned prefixes (`pin` / `unpin`, by name) keep a prefix's whole KV blocks resident once a
request has computed them; the fresh pool of a recovery pins them again.

With an ITL SLO (`scheduler.itl_slo_ms`) the engine fits its step cost model at start-up
(calibration.py: CALIBRATION_STEPS steps of varied shapes, seconds on a GPU, about 15 s
of SmolLM2 on 2 CPU cores), then keeps it current while it serves (cost_model.LiveCosts: the
machine's speed from its latest steps, the worker's publish round trip from the gaps between
them), and its scheduler sizes every step's prefill share with it.

With `tensor_parallel` N > 1 this process is rank 0 of N (parallel.py): all of the above happens
here alone, once per step, and the runner sends each step's inputs to the other ranks, which
compute their share of the model (sharding.py). A forward that fails there is the one failure not
recovered from: the ranks may be out of step, so it ends the process, as a lost rank does.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import msgspec
import torch

from producer.protocol import Lane, SamplingParams
from worker.engine import calibration, kernels
from worker.engine.blocks import BlockPool
from worker.engine.config import EngineConfig
from worker.engine.cost_model import LiveCosts, kv_reads, sampled_rows
from worker.engine.detok import IncrementalDetokenizer
from worker.engine.disk_cache import Phase, quiet
from worker.engine.fairness import TenantShare
from worker.engine.inputs import PromptError, PromptTooLong, check_token_ids, encode_prompt
from worker.engine.models import ModelInfo, kv_cache_memory, load_model, num_blocks_for_memory
from worker.engine.outputs import RequestOutput, timings_of, token_logprob, usage_of
from worker.engine.parallel import Ranks, load_shard, rank_device
from worker.engine.plan import StepPlan
from worker.engine.runner import runner_for
from worker.engine.sampler import SampleRequest, sample
from worker.engine.scheduler import Scheduler
from worker.engine.sequence import FinishReason, Sequence


log = logging.getLogger(__name__)
CALIBRATION_STEPS = 96  # steps an engine with an ITL SLO times at start-up for its cost model


@dataclass
class _Request:
    seq: Sequence
    detokenizer: IncrementalDetokenizer | None
    lane: Lane | None  # as asked for
    reported: int  # output tokens handed out in outputs (a resumed request's emitted ones included)
    failed_steps: int = 0  # since it last got past a failure
    failed_at: int = 0  # `reported` when its step last failed


class Engine:
    def __init__(self, config: EngineConfig, model: torch.nn.Module | None = None, tokenizer: Any = None,
                 on_phase: Phase = quiet):
        """Loads `config.model` unless an already loaded model (and tokenizer) is given. Everything
        slow happens here, never in a step: building the native kernels when the machine has none,
        converting the model, compiling; `on_phase` hears what is being done."""
        if torch.device(config.device).type == "cpu":
            on_phase("loading the native kernels")
            kernels.native(on_phase)
        ranks, device = config.tensor_parallel, config.device
        if ranks > 1:
            if model is not None:
                raise ValueError("a tensor-parallel engine loads the model on every rank: give it by name")
            device = rank_device(config.device, 0)
        if model is None:
            on_phase(f"loading the model {config.model}")
            model, tokenizer = (load_shard(config, 0, on_phase) if ranks > 1
                                else load_model(config.model, config.dtype, device, on_phase))
        self.config, self.model, self.tokenizer = config, model, tokenizer
        self.info = ModelInfo.from_model(model, tokenizer).per_rank(ranks)  # the KV cache holds this rank's heads
        self._init_bookkeeping(
            min(config.max_model_len or self.info.max_model_len, self.info.max_model_len),
            config.num_blocks or num_blocks_for_memory(config.kv_cache_memory or kv_cache_memory(device), self.info,
                                                       config.block_size))
        self.ranks: Ranks | None = None
        if ranks > 1:
            on_phase(f"starting {ranks - 1} more tensor-parallel rank process{'es' if ranks > 2 else ''} "
                     "(each loads and splits the model)")
            self.ranks = Ranks(config, self.num_blocks, self.max_model_len)
        self.runner = runner_for(config, model, self.info, self.num_blocks, self.max_model_len, device, on_phase,
                                 self.ranks)
        if self.ranks is not None:
            on_phase(f"waiting for the other tensor-parallel ranks (pids {', '.join(map(str, self.ranks.pids))})")
            self.ranks.wait_ready()
        if config.scheduler.itl_slo_ms is not None:
            on_phase(f"fitting the step cost model for the ITL SLO ({CALIBRATION_STEPS} steps of varied shapes)")
            self.costs = LiveCosts(calibration.measure(self, CALIBRATION_STEPS))
            self._new_scheduler()  # a fresh pool, and the SLO held from now on

    def _init_bookkeeping(self, max_model_len: int, num_blocks: int) -> None:
        """What the engine keeps apart from the model and its runner: the scheduler and its pool,
        pins, tenants, requests, failed steps."""
        self.max_model_len, self.num_blocks = max_model_len, num_blocks
        self.pins: dict[str, list[int]] = {}  # name -> the pinned prefix's token ids, whole blocks
        self.tenant_shares: dict[str, TenantShare] = {}  # weights and running caps (set_tenants)
        self.costs: LiveCosts | None = None  # with an ITL SLO, once calibrated
        self._new_scheduler()
        self.requests: dict[str, _Request] = {}
        self.last_step_tokens = 0  # tokens computed by the latest step (metrics, benchmarks)
        self.num_failed_steps = 0
        self.suspects: deque[str] = deque()  # requests of failed steps, waiting to go back one by one
        self.on_probation: str | None = None  # the suspect back in the scheduler
        self.ended_outside: list[Sequence] = []  # suspects cancelled before going back

    def _new_scheduler(self) -> None:
        """A fresh scheduler and pool; under an ITL SLO, held to it once the cost model is fitted."""
        self.pool = BlockPool(self.num_blocks, self.config.block_size, self.config.enable_prefix_caching)
        cost = self.costs.model if self.costs is not None else None
        scheduler_config = msgspec.structs.replace(
            self.config.scheduler, max_model_len=self.max_model_len,
            itl_slo_ms=self.config.scheduler.itl_slo_ms if cost is not None else None)
        self.scheduler = Scheduler(scheduler_config, self.pool, cost=cost)
        self.scheduler.set_tenants(self.tenant_shares)
        for token_ids in self.pins.values():
            self.pool.pin_prefix(token_ids)

    # --- requests ----------------------------------------------------------------------
    def add_request(self, request_id: str, *, prompt: str | None = None, messages: list[dict] | None = None,
                    prompt_ids: list[int] | None = None, params: SamplingParams | None = None,
                    lane: Lane | None = None, emitted_token_ids: list[int] = (), tenant: str = "") -> Sequence:
        """Tokenize and queue a request. Raises PromptError (a ValueError) for a prompt that
        cannot be served; a request that can never fit comes back finished with an error.
        `emitted_token_ids` resumes a request that already produced those tokens elsewhere:
        they are recomputed with the prompt and count as output (max_tokens, penalties), and the
        text the earlier attempt held back of them comes out with the next tokens. `tenant`: whose
        request it is, for fair shares between tenants (set_tenants), and its prefix-cache namespace:
        it shares prefix-cache blocks only with the same tenant's requests, and with the pinned
        prefixes, which are everyone's."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        if (prompt is not None or messages is not None) and self.tokenizer is None:
            raise PromptError("this model has no tokenizer: give prompt_ids")
        room = self.max_model_len - params.max_tokens
        if room < 1:
            raise PromptTooLong(f"max_tokens ({params.max_tokens}) leaves no room for a prompt in the "
                              f"model length ({self.max_model_len})")
        token_ids = encode_prompt(self.tokenizer, prompt=prompt, messages=messages, prompt_ids=prompt_ids,
                                  max_prompt_tokens=room, truncate=self.config.truncate,
                                  vocab_size=self.info.vocab_size)
        # Emitted ids come from a replay stream: one damaged there must not reach the tokenizer or model.
        emitted_token_ids = check_token_ids(emitted_token_ids, self.info.vocab_size, "resumed token ids")
        if len(emitted_token_ids) > params.max_tokens:
            raise PromptError(f"{len(emitted_token_ids)} resumed token ids, more than max_tokens ({params.max_tokens})")
        seq = Sequence(request_id, token_ids, params, eos_token_ids=self.info.eos_token_ids,
                       cache_salt=tenant.encode(), tenant=tenant)
        seq.token_ids.extend(emitted_token_ids)
        detokenizer = None
        if self.tokenizer is not None:
            detokenizer = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, params.stop,
                                                 emitted_ids=emitted_token_ids)
        self.requests[request_id] = _Request(seq, detokenizer, lane, reported=len(emitted_token_ids))
        return self.scheduler.add(seq, lane)

    def set_tenants(self, shares: dict[str, TenantShare]) -> None:
        """The tenants' weights and running caps (the registry's), for the scheduler's fair shares."""
        self.tenant_shares = dict(shares)
        self.scheduler.set_tenants(self.tenant_shares)

    def abort(self, request_id: str, reason: FinishReason = FinishReason.CANCELLED) -> bool:
        """End a request now (cancel, deadline); its final output comes with the next step."""
        if request_id in self.suspects:
            self.suspects.remove(request_id)
            seq = self.requests[request_id].seq
            seq.finish(reason, time.monotonic())
            self.ended_outside.append(seq)
            return True
        return self.scheduler.finish_request(request_id, reason)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def close(self) -> None:
        """Stop the other tensor-parallel ranks, if any (done at exit otherwise)."""
        if self.ranks is not None:
            self.ranks.close()

    # --- pinned prefixes ---------------------------------------------------------------
    def pin(self, name: str, *, prompt: str | None = None, messages: list[dict] | None = None,
            prompt_ids: list[int] | None = None) -> int:
        """Keep a prefix resident: its whole blocks, once computed (by the next request that
        starts with it, or at once if cached now), are never evicted until `unpin(name)`. The
        prefix is tokenized as a request's prompt is, except that `messages` are rendered without
        the generation prompt: the head of every conversation that goes on from them. Returns the
        blocks it covers. Raises ValueError (PromptError for a prompt that cannot be encoded) when
        it shares no whole block, or when the pins would leave less than the longest request
        needs: pinned blocks are never free, and a request that cannot fit would wait for ever."""
        if name in self.pins:
            raise ValueError(f"a prefix named {name!r} is already pinned")
        if (prompt is not None or messages is not None) and self.tokenizer is None:
            raise PromptError("this model has no tokenizer: give prompt_ids")
        token_ids = encode_prompt(self.tokenizer, prompt=prompt, messages=messages, prompt_ids=prompt_ids,
                                  max_prompt_tokens=self.max_model_len, vocab_size=self.info.vocab_size,
                                  add_generation_prompt=False)
        size = self.pool.block_size
        token_ids = token_ids[:len(token_ids) // size * size]  # only whole blocks are ever shared
        if not token_ids:
            raise ValueError(f"prefix {name!r} is shorter than one KV block ({size} tokens): nothing to pin")
        pinned = self.pool.blocks_pinned_with(token_ids)
        room = self.pool.num_blocks - self.pool.blocks_for(self.max_model_len)
        if pinned > room:
            raise ValueError(
                f"prefix {name!r} ({len(token_ids) // size} blocks) does not fit: the pins would hold {pinned} "
                f"of the {self.pool.num_blocks} KV blocks, and a request of the model length "
                f"({self.max_model_len} tokens) needs {self.pool.blocks_for(self.max_model_len)} of the rest; "
                f"at most {max(room, 0)} blocks can be pinned (a larger pool or a lower max_model_len makes room)")
        self.pool.pin_prefix(token_ids)
        self.pins[name] = token_ids
        return len(token_ids) // size

    def unpin(self, name: str) -> bool:
        """Let a pinned prefix's blocks be evicted again; False if nothing is pinned by that name."""
        token_ids = self.pins.pop(name, None)
        if token_ids is None:
            return False
        self.pool.unpin_prefix(token_ids)
        return True

    # --- one step ----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        started = time.perf_counter()
        if self.costs is not None:
            self.costs.step_started(started)
        outputs = [self._final(seq, RequestOutput(seq.request_id)) for seq in self.ended_outside]
        self.ended_outside = []
        involved = set(self.requests)
        try:
            self._readmit_suspect()
            involved = set(self.scheduler.requests)  # until the plan says who is in the step
            plan = self.scheduler.schedule()
            involved = {seq.request_id for seq in plan.scheduled}
            shape = (plan.num_tokens, kv_reads(plan), sampled_rows(plan)) if self.costs is not None else None
            self._run(plan, outputs)
            self._end_probation()
            if self.costs is not None:  # before update() the plan's shape; now its time
                self.costs.step_ended(*shape, started, time.perf_counter(), busy=self.has_unfinished)
                self.scheduler.cost = self.costs.model
        except Exception as error:  # whatever broke, the engine and everyone else go on
            log.exception("engine step failed (%d requests in it); recomputing every request on a fresh "
                          "scheduler", len(involved))
            outputs += self._recover(involved, error)
        return outputs

    def _run(self, plan: StepPlan, outputs: list[RequestOutput]) -> None:
        """One scheduled step; its outputs appended as they are made, so a failure midway keeps them."""
        self.last_step_tokens = plan.num_tokens
        # rejected or ended since the last step (one ended by a stop string is already closed)
        outputs += [self._final(seq, RequestOutput(seq.request_id)) for seq in plan.finished
                    if seq.request_id in self.requests and self.requests[seq.request_id].seq is seq]
        if not plan.scheduled:
            return
        seqs, logits = self.runner.execute(plan)
        sampled = sample(logits, [SampleRequest(seq.params, seq.prompt_token_ids, seq.output_token_ids,
                                                position=len(seq.token_ids)) for seq in seqs]) if seqs else None
        self.scheduler.update(plan, dict(zip(seqs, sampled.token_ids)) if seqs else {})
        for i, seq in enumerate(seqs):
            outputs.append(self._token_output(seq, sampled.token_ids[i], sampled.logprobs[i],
                                              sampled.top_logprobs[i]))

    def _recover(self, involved: set[str], error: Exception) -> list[RequestOutput]:
        """After a failed step: a fresh scheduler and pool; every request rewound to the tokens it
        reported and queued again, those of the failed step as suspects (or ended, past the bound)."""
        self.num_failed_steps += 1
        if self.on_probation in involved:
            involved = {self.on_probation}  # the suspect is the one to blame, not who ran beside it
        self._new_scheduler()
        self.on_probation = None
        outputs = []
        for request_id, request in list(self.requests.items()):
            seq = request.seq
            if seq.is_finished:  # ended (cancel, deadline, stop) with its final output not yet made
                outputs.append(self._final(seq, RequestOutput(request_id)))
                continue
            if request_id in involved:
                request.failed_steps += 1
                request.failed_at = request.reported
            if request.failed_steps >= self.config.max_step_failures:
                seq.finish(FinishReason.ERROR, time.monotonic(), error=f"ended after {request.failed_steps} "
                           f"failed engine steps: {type(error).__name__}: {error}")
                output = self._final(seq, RequestOutput(request_id))
                output.poisoned = True
                outputs.append(output)
                continue
            seq.rewind(seq.num_prompt_tokens + request.reported)
            if request.failed_steps and request_id not in self.suspects:
                self.suspects.append(request_id)
            elif not request.failed_steps:
                self.scheduler.add(seq, request.lane)
        self.suspects = deque(request_id for request_id in self.suspects if request_id in self.requests)
        return outputs

    def _end_probation(self) -> None:
        request = self.requests.get(self.on_probation)
        if request is None or request.reported > request.failed_at:  # finished, or got past its failure
            if request is not None:
                request.failed_steps = 0
            self.on_probation = None

    def _readmit_suspect(self) -> None:
        """One suspect at a time goes back into the scheduler."""
        if self.on_probation is not None:
            return
        if self.suspects:
            request_id = self.suspects.popleft()
            request = self.requests[request_id]
            self.scheduler.add(request.seq, request.lane)
            self.on_probation = request_id

    def _token_output(self, seq: Sequence, token: int, logprob: float | None,
                      top: list[tuple[int, float]] | None) -> RequestOutput:
        request = self.requests[seq.request_id]
        request.reported += 1
        output = RequestOutput(seq.request_id, [token])
        if logprob is not None:
            output.logprobs = [token_logprob(self.tokenizer, token, logprob, top)]
        if request.detokenizer is not None:
            output.text = request.detokenizer.add([token])
            if request.detokenizer.stop_reached and not seq.is_finished:
                self.scheduler.finish_request(seq.request_id, FinishReason.STOP)
        return self._final(seq, output) if seq.is_finished else output

    def _final(self, seq: Sequence, output: RequestOutput) -> RequestOutput:
        """Close a finished request: flush held-back text, attach reason, usage, timings."""
        detokenizer = self.requests.pop(seq.request_id).detokenizer
        if detokenizer is not None and not detokenizer.stop_reached:
            output.text += detokenizer.finish()
        output.finish_reason = seq.finish_reason.value
        output.error, output.usage, output.timings = seq.error, usage_of(seq), timings_of(seq)
        return output
