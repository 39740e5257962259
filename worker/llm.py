"""The offline API, in the shape vLLM users know:

    from worker import LLM
    from producer import SamplingParams
    llm = LLM("smollm2-135m", token_budget=512)
    for completion in llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0)):
        print(completion.text)
"""

from __future__ import annotations

from collections.abc import Sequence as Many
from dataclasses import dataclass, field
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from producer.protocol import FinishReason, SamplingParams, Timings, TokenLogprob, Usage
from worker.engine.config import EngineConfig
from worker.engine.engine import Engine

Prompt = str | list[dict] | list[int]  # text, chat messages, or token ids


@dataclass
class Completion:
    request_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token id, when asked for
    finish_reason: FinishReason | None = None
    error: str | None = None
    usage: Usage | None = None
    timings: Timings | None = None


class LLM:
    def __init__(self, model: str = "smollm2-135m", **options: Any) -> None:
        """Options use the worker's flag names: block_size, num_blocks, kv_cache_memory,
        token_budget, fast_lane_share, watermark, policy, enable_prefix_caching, dtype (default auto:
        bfloat16 on CUDA, float32 on CPU), device..."""
        self.engine = Engine(EngineConfig.from_options(model, **options))

    def generate(self, prompts: Prompt | Many[Prompt], params: SamplingParams | Many[SamplingParams] | None = None,
                 progress: bool = True) -> list[Completion]:
        """Completions in the order of `prompts`; one params for all, or one per prompt."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and
                                        isinstance(prompts[0], (int, dict))):
            prompts = [prompts]
        params_list = list(params) if isinstance(params, Many) else [params or SamplingParams()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(params_list)} params for {len(prompts)} prompts")
        completions = {}
        for i, (prompt, request_params) in enumerate(zip(prompts, params_list)):
            request_id = f"offline-{i}"
            completions[request_id] = Completion(request_id)
            self.engine.add_request(request_id, params=request_params, **_prompt_kwargs(prompt))
        with Progress(TextColumn("generating"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[rate]}"),
                      TimeElapsedColumn(), disable=not progress, transient=True) as bar:
            task = bar.add_task("generate", total=len(prompts), rate="")
            generated = 0
            while self.engine.has_unfinished:
                for output in self.engine.step():
                    completion = completions[output.request_id]
                    completion.text += output.text
                    completion.token_ids += output.token_ids
                    completion.logprobs += output.logprobs
                    generated += len(output.token_ids)
                    if output.finished:
                        completion.finish_reason, completion.error = output.finish_reason, output.error
                        completion.usage, completion.timings = output.usage, output.timings
                        bar.advance(task)
                elapsed = bar.tasks[0].elapsed or 0.0
                bar.update(task, rate=f"{generated / elapsed:.1f} tok/s" if elapsed else "")
        return list(completions.values())


def _prompt_kwargs(prompt: Prompt) -> dict[str, Any]:
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if prompt and all(isinstance(item, dict) for item in prompt):
        return {"messages": prompt}
    return {"prompt_ids": list(prompt)}
