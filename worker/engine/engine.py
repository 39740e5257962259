"""Engine.step(): schedule -> run -> sample -> update -> outputs.

One engine owns one model on one device: the scheduler and block pool decide, the
runner computes, the sampler picks tokens, and each request's detokenizer turns them
into text deltas. Pure: knows nothing of Redis.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec
import torch

from producer.protocol import Lane, SamplingParams
from worker.engine import kernels
from worker.engine.blocks import BlockPool
from worker.engine.config import EngineConfig
from worker.engine.detok import IncrementalDetokenizer
from worker.engine.disk_cache import Phase, quiet
from worker.engine.inputs import PromptError, encode_prompt
from worker.engine.models import ModelInfo, load_model, num_blocks_for_memory
from worker.engine.outputs import RequestOutput, timings_of, usage_of
from worker.engine.runner import ModelRunner
from worker.engine.sampler import SampleRequest, sample
from worker.engine.scheduler import Scheduler
from worker.engine.sequence import FinishReason, Sequence


@dataclass
class _Request:
    seq: Sequence
    detokenizer: IncrementalDetokenizer | None


class Engine:
    def __init__(self, config: EngineConfig, model: torch.nn.Module | None = None, tokenizer: Any = None,
                 on_phase: Phase = quiet):
        """Loads `config.model` unless an already loaded model (and tokenizer) is given. Everything
        slow happens here, never in a step: building the native kernels when the machine has none,
        converting the model, compiling; `on_phase` hears what is being done."""
        if torch.device(config.device).type == "cpu":
            on_phase("loading the native kernels")
            kernels.native(on_phase)
        if model is None:
            on_phase(f"loading the model {config.model}")
            model, tokenizer = load_model(config.model, config.dtype, config.device, on_phase)
        self.config, self.model, self.tokenizer = config, model, tokenizer
        self.info = ModelInfo.from_model(model, tokenizer)
        self.max_model_len = min(config.max_model_len or self.info.max_model_len, self.info.max_model_len)
        num_blocks = config.num_blocks or num_blocks_for_memory(config.kv_cache_memory, self.info, config.block_size)
        self.pool = BlockPool(num_blocks, config.block_size, config.enable_prefix_caching)
        scheduler_config = msgspec.structs.replace(config.scheduler, max_model_len=self.max_model_len)
        self.scheduler = Scheduler(scheduler_config, self.pool)
        self.runner = ModelRunner(model, self.info, num_blocks, config.block_size, config.device,
                                  config.compile, on_phase)
        self.requests: dict[str, _Request] = {}
        self.last_step_tokens = 0  # tokens computed by the latest step (metrics, benchmarks)

    # --- requests ----------------------------------------------------------------------
    def add_request(self, request_id: str, *, prompt: str | None = None, messages: list[dict] | None = None,
                    prompt_ids: list[int] | None = None, params: SamplingParams | None = None,
                    lane: Lane | None = None, emitted_token_ids: list[int] = ()) -> Sequence:
        """Tokenize and queue a request. Raises PromptError (a ValueError) for a prompt that
        cannot be served; a request that can never fit comes back finished with an error.
        `emitted_token_ids` resumes a request that already produced those tokens elsewhere:
        they are recomputed with the prompt and count as output (max_tokens, penalties)."""
        params = params or SamplingParams()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in the engine")
        if (prompt is not None or messages is not None) and self.tokenizer is None:
            raise PromptError("this model has no tokenizer: give prompt_ids")
        room = self.max_model_len - params.max_tokens
        if room < 1:
            raise PromptError(f"max_tokens ({params.max_tokens}) leaves no room for a prompt in the "
                              f"model length ({self.max_model_len})")
        token_ids = encode_prompt(self.tokenizer, prompt=prompt, messages=messages, prompt_ids=prompt_ids,
                                  max_prompt_tokens=room, truncate=self.config.truncate,
                                  vocab_size=self.info.vocab_size)
        seq = Sequence(request_id, token_ids, params, eos_token_ids=self.info.eos_token_ids)
        seq.token_ids.extend(emitted_token_ids)
        detokenizer = None
        if self.tokenizer is not None:
            detokenizer = IncrementalDetokenizer(self.tokenizer, seq.token_ids, params.stop)
        self.requests[request_id] = _Request(seq, detokenizer)
        return self.scheduler.add(seq, lane)

    def abort(self, request_id: str, reason: FinishReason = FinishReason.CANCELLED) -> bool:
        """End a request now (cancel, deadline); its final output comes with the next step."""
        return self.scheduler.finish_request(request_id, reason)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # --- one step ----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        self.last_step_tokens = plan.num_tokens
        # rejected or ended since the last step (one ended by a stop string is already closed)
        outputs = [self._final(seq, RequestOutput(seq.request_id)) for seq in plan.finished
                   if seq.request_id in self.requests and self.requests[seq.request_id].seq is seq]
        if not plan.scheduled:
            return outputs
        seqs, logits = self.runner.execute(plan)
        sampled = sample(logits, [SampleRequest(seq.params, seq.prompt_token_ids, seq.output_token_ids,
                                                position=len(seq.token_ids)) for seq in seqs]) if seqs else None
        self.scheduler.update(plan, dict(zip(seqs, sampled.token_ids)) if seqs else {})
        for i, seq in enumerate(seqs):
            outputs.append(self._token_output(seq, sampled.token_ids[i], sampled.logprobs[i],
                                              sampled.top_logprobs[i]))
        return outputs

    def _token_output(self, seq: Sequence, token: int, logprob: float | None,
                      top: list[tuple[int, float]] | None) -> RequestOutput:
        request = self.requests[seq.request_id]
        output = RequestOutput(seq.request_id, [token])
        if logprob is not None:
            output.logprobs, output.top_logprobs = [logprob], [top or []]
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
