"""vLLM's side of ops/bench_vs_vllm.py: run by path with the python of vLLM's own venv (so vllm and the
standard library only), given a JSON job file:

    {"model": HF directory, "dtype": "float32", "eager": true,
     "workloads": {kind: [[prompt ids, max_tokens], ...]}}

It loads the model once and runs each workload in turn: a warm-up request, then every request at once in
one `generate` call, greedy and EOS ignored, timed. It prints one line, `RESULT {json}`: by workload, the
output token ids by request ("r0", "r1", ... in the job's order), the tokens and the seconds.
"""

import json
import sys
import time
from pathlib import Path

from vllm import LLM, SamplingParams


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def run_workload(llm: LLM, requests: list) -> dict:
    prompts = [{"prompt_token_ids": ids} for ids, _ in requests]
    llm.generate(prompts[:1], greedy(2), use_tqdm=False)  # warm-up: first-use costs outside the timing
    started = time.perf_counter()
    finished = llm.generate(prompts, [greedy(max_tokens) for _, max_tokens in requests], use_tqdm=False)
    seconds = time.perf_counter() - started
    outputs = {f"r{i}": list(request.outputs[0].token_ids) for i, request in enumerate(finished)}
    return {"outputs": outputs, "tokens": sum(map(len, outputs.values())), "seconds": seconds}


def main(job_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    llm = LLM(model=job["model"], dtype=job["dtype"], enforce_eager=job["eager"])
    results = {kind: run_workload(llm, requests) for kind, requests in job["workloads"].items()}
    sys.stdout.flush()  # vLLM's own log lines go to stdout too: none mid-way through ours
    print("RESULT " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
