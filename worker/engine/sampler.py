"""Sample one token for every row of a batch, each row by its own SamplingParams.

Pipeline, all rows at once: raw logprobs -> penalties -> greedy argmax | temperature ->
top-k -> top-p -> min-p -> exponential race. Parameters become per-row tensors, so a
batch never borrows row 0's settings. Logprobs are those of the RAW model distribution
(log-softmax before penalties, temperature and filters), as vLLM returns by default.

On a GPU nothing here waits for the device until the results are read back, once: per-row
parameters and row indices go over from pinned memory without blocking (host_copy.py), never as a
tensor built from a list on the device or a list used as a device tensor's index (each of those a
blocking copy: 6-10 per step with temperature, penalties or logprobs).

Reproducibility: a seeded row's randomness is a pure function of (seed, position): a
fresh generator per row, seeded from a mix of both, draws exponential noise over the
whole vocabulary in token-id order. Batch neighbours, row order, preemption or a resume
elsewhere (same device type and torch version) cannot change it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from producer.protocol import SamplingParams
from worker.engine import kernels
from worker.engine.host_copy import to_device, to_host, values_to_device

_MASK64 = (1 << 64) - 1


@dataclass(frozen=True, slots=True)
class SampleRequest:
    """What the sampler needs to know about one row."""

    params: SamplingParams
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    position: int | None = None  # index of the token being sampled; default len(prompt)+len(output)
    seed: int | None = None  # overrides params.seed (e.g. one the engine assigned at admission)

    @property
    def effective_position(self) -> int:
        return self.position if self.position is not None else len(self.prompt_ids) + len(self.output_ids)

    @property
    def effective_seed(self) -> int | None:
        return self.seed if self.seed is not None else self.params.seed


@dataclass(slots=True)
class SampleOutput:
    token_ids: list[int]
    logprobs: list[float | None]  # raw logprob of the sampled token; None if the row did not ask
    top_logprobs: list[list[tuple[int, float]] | None]  # raw top-n (token, logprob), best first


def mix_seed(seed: int, position: int) -> int:
    """splitmix64 of (seed, position): nearby seeds/positions give unrelated streams."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    return values_to_device(values, like.dtype, like.device).unsqueeze(1)


def _index(rows: list[int], like: torch.Tensor) -> torch.Tensor:
    """Row numbers as an index tensor on `like`'s device."""
    return values_to_device(rows, torch.long, like.device)


def apply_penalties(logits: torch.Tensor, requests: list[SampleRequest]) -> None:
    """In place, on a contiguous [rows, vocab] tensor. Touches only the (row, token) pairs
    that were seen, never whole [rows, vocab] masks: cheap next to a full vocabulary pass."""
    rows = [i for i, r in enumerate(requests) if r.params.has_penalties]
    if not rows:
        return
    vocab, device, dtype = logits.shape[1], logits.device, logits.dtype
    keys, in_output = [], []  # flat index row * vocab + token, for every prompt/output token
    for i in rows:
        for ids, weight in ((requests[i].prompt_ids, 0.0), (requests[i].output_ids, 1.0)):
            keys.append(torch.as_tensor(ids, dtype=torch.long) + i * vocab)
            in_output.append(torch.full((len(ids),), weight, dtype=dtype))
    # On the host, where the ids are: unique's output size is data-dependent, a sync on a device.
    keys, inverse = torch.unique(torch.cat(keys), return_inverse=True)
    count = torch.zeros(len(keys), dtype=dtype).scatter_add_(0, inverse, torch.cat(in_output))  # output occurrences
    keys, count = to_device(device, keys, count)
    row = keys // vocab

    def per_row(name: str) -> torch.Tensor:
        return values_to_device([getattr(r.params, name) for r in requests], dtype, device)[row]

    flat = logits.view(-1)
    value = flat[keys]
    # HF repetition penalty over prompt + output: shrink positive logits, push negative ones down.
    rep = per_row("repetition_penalty")
    value = torch.where(value > 0, value / rep, value * rep)
    # OpenAI presence / frequency penalties over output tokens only (count is 0 for the prompt's).
    value -= per_row("frequency_penalty") * count + per_row("presence_penalty") * (count > 0).to(dtype)
    flat[keys] = value


def _filter(logits: torch.Tensor, requests: list[SampleRequest]) -> torch.Tensor:
    """Probabilities after top-k, then top-p (over the top-k renormalised), then min-p.
    Returned unnormalised: the exponential race does not need them to sum to one. Which rows
    filter is read from their params on the host, never from a device tensor (no sync)."""
    probs = logits.softmax(dim=1)
    vocab = probs.shape[1]
    rows = [i for i, r in enumerate(requests) if 0 < (r.params.top_k or vocab) < vocab or r.params.top_p < 1.0]
    if rows:
        index = _index(rows, probs)
        probs[index] = _top_k_top_p(probs[index], [min(requests[i].params.top_k or vocab, vocab) for i in rows],
                                    [requests[i].params.top_p for i in rows])
    min_p = [r.params.min_p for r in requests]
    if any(p > 0 for p in min_p):
        probs = probs.masked_fill(probs < _column(min_p, probs) * probs.max(dim=1, keepdim=True).values, 0.0)
    return probs


def _top_k_top_p(probs: torch.Tensor, top_k: list[int], top_p: list[float], size: int = 64) -> torch.Tensor:
    """Zero all but each row's kept head. A full sort of the vocabulary costs ~4 ms a row on
    CPU, so there only a head is sorted (topk): big enough for every top_k; a top-p-only row
    whose nucleus does not end inside it is redone with a 4x bigger head. On an accelerator the
    whole vocabulary is sorted at once: cheap there, and asking whether a head sufficed would
    be a host sync. Exact either way."""
    vocab = probs.shape[1]
    if probs.device.type != "cpu":
        size = vocab
    size = min(vocab, max([size] + [k for k in top_k if k < vocab]))
    k = values_to_device(top_k, torch.long, probs.device)
    p = values_to_device(top_p, torch.float32, probs.device)
    head, ids = probs.topk(size, dim=1)
    rank = torch.arange(size, device=probs.device).unsqueeze(0)
    in_top_k = rank < k.unsqueeze(1)
    # top-p counts mass within the top-k set (as vLLM and HF do): scale p by that mass.
    mass = torch.where(k < vocab, (head * in_top_k).sum(dim=1), 1.0).unsqueeze(1)
    # Keep a token while the mass strictly before it is below p: the best one always stays.
    # p == 1 masks nothing, even where a float cumsum rounds up to the total.
    limit = torch.where(p < 1.0, p, float("inf")).unsqueeze(1) * mass
    keep = in_top_k & (head.cumsum(dim=1) - head < limit)
    kept = torch.zeros_like(probs).scatter_(1, ids, head * keep)
    if size < vocab:
        unsettled = ((k > size) & (head.sum(dim=1) < p)).nonzero().squeeze(1).tolist()
        if unsettled:
            kept[unsettled] = _top_k_top_p(probs[unsettled], [top_k[i] for i in unsettled],
                                           [top_p[i] for i in unsettled], size * 4)
    return kept


def _exponential_noise(probs: torch.Tensor, requests: list[SampleRequest]) -> torch.Tensor:
    """Exp(1) noise as -log(U). (torch's exponential_ is ~7x slower than rand on CPU.)"""
    uniform = torch.empty_like(probs)
    unseeded = [i for i, r in enumerate(requests) if r.effective_seed is None]
    if unseeded:  # no reproducibility promised: one draw from the global generator
        uniform[_index(unseeded, probs)] = torch.rand(len(unseeded), probs.shape[1], device=probs.device)
    for i, r in enumerate(requests):  # a per-row loop only for the seeded draw itself
        if r.effective_seed is not None:
            generator = torch.Generator(device=probs.device)
            generator.manual_seed(mix_seed(r.effective_seed, r.effective_position))
            uniform[i] = torch.rand(probs.shape[1], generator=generator, device=probs.device)
    # U = 0 would give infinite noise (a token that can never win): harmless.
    return uniform.log_().neg_().clamp_min_(torch.finfo(probs.dtype).tiny)


@dataclass(slots=True)
class DeviceSample:
    """What one step sampled, still on the logits' device."""

    tokens: torch.Tensor  # [rows]
    wants_logprobs: list[int]  # rows that asked for logprobs
    chosen_logprobs: torch.Tensor | None  # [len(wants_logprobs)] raw logprob of the sampled token
    top_logprobs: tuple[torch.Tensor, torch.Tensor] | None  # (values, ids) [len(wants_logprobs), n_max]


def sample(logits: torch.Tensor, requests: list[SampleRequest]) -> SampleOutput:
    """Sample one token per row of `logits` [rows, vocab]; `logits` is not modified."""
    return read_back(sample_on_device(logits, requests), requests)


def sample_on_device(logits: torch.Tensor, requests: list[SampleRequest]) -> DeviceSample:
    """Everything but the copy to the host: no operation here waits on the device (none reads a
    device value back, none copies from pageable memory), so a step's one sync is read_back's."""
    if logits.dim() != 2 or logits.shape[0] != len(requests):
        raise ValueError(f"logits {tuple(logits.shape)} do not match {len(requests)} requests")
    # a copy only for the penalties, which write into it: `logits` is not modified
    logits = logits.to(torch.float32, copy=any(r.params.has_penalties for r in requests),
                       memory_format=torch.contiguous_format)
    wants_logprobs = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
    logprob_rows = _index(wants_logprobs, logits) if wants_logprobs else None
    raw_logprobs = logits[logprob_rows].log_softmax(dim=1) if wants_logprobs else None

    apply_penalties(logits, requests)
    tokens = argmax(logits)  # what greedy rows keep (after penalties, like vLLM)
    rows = [i for i, r in enumerate(requests) if not r.params.greedy]
    if rows:
        subset, index = [requests[i] for i in rows], _index(rows, logits)
        temperature = _column([r.params.temperature for r in subset], logits)
        probs = _filter(logits[index] / temperature, subset)
        # Exponential race: argmax(p / E), E ~ Exp(1), picks token t with probability p_t.
        tokens[index] = argmax(probs / _exponential_noise(probs, subset))
    chosen = top = None
    if raw_logprobs is not None:
        chosen = raw_logprobs.gather(1, tokens[logprob_rows].unsqueeze(1)).squeeze(1)
        n_max = max(requests[i].params.logprobs or 0 for i in wants_logprobs)
        top = raw_logprobs.topk(n_max, dim=1) if n_max else None
    return DeviceSample(tokens, wants_logprobs, chosen, top)


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Each row's first index of its largest value (of its first NaN, if any). On the CPU the native kernel's:
    torch's reduction with indices is not vectorized there (1.4-2.5 ms for 64 rows of a 49k vocabulary, 9.5x
    the kernel's); max's indices elsewhere, 2.5x faster than argmax on a CPU and the same on a GPU."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and kernels.native() is not None:
        return kernels.argmax_rows(x)
    return x.max(dim=1).indices


def read_back(sampled: DeviceSample, requests: list[SampleRequest]) -> SampleOutput:
    """The step's one wait for the device: every result copied back together."""
    results = [sampled.tokens]
    if sampled.chosen_logprobs is not None:
        results.append(sampled.chosen_logprobs)
        if sampled.top_logprobs is not None:
            results += sampled.top_logprobs
    host = to_host(*results)
    token_list = host[0].tolist()
    logprob_list: list[float | None] = [None] * len(requests)
    top_list: list[list[tuple[int, float]] | None] = [None] * len(requests)
    if sampled.chosen_logprobs is not None:
        chosen = host[1].tolist()
        top_values, top_ids = (t.tolist() for t in host[2:]) if sampled.top_logprobs else ([], [])
        for j, i in enumerate(sampled.wants_logprobs):
            n = requests[i].params.logprobs or 0
            logprob_list[i] = chosen[j]
            top_list[i] = list(zip(top_ids[j][:n], top_values[j][:n])) if n else []
    return SampleOutput(token_list, logprob_list, top_list)
