"""Load traces: when each request arrives, what it asks for, which lane it claims.

A trace is a list of `TraceRequest`s, generated here from named distributions (seeded, so the
same arguments give the same trace) or read from a JSONL file, one request per line. Prompts are
always token ids: a trace runs on the tiny random model and on SmolLM2 alike.

Arrival patterns (open loop; a closed loop is the runner's `concurrency`, which ignores arrival_s):
  poisson   exponential gaps at `rate` requests/s;
  bursty    on/off: the first `burst_on_share` of every `burst_period_s` at a peak rate, the rest
            at peak / `peak_to_trough`, averaging `rate`.
Lengths (prompt and output tokens) by name:
  fixed:N                   always N;
  uniform:LOW,HIGH          LOW..HIGH inclusive;
  lognormal:MEDIAN,SIGMA[,MAX]  heavy-tailed from SIGMA ~1.5 on (at SIGMA 2 the P99 is about 14x
                            the mean), clipped to 1..MAX (default 4096).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from pathlib import Path
from typing import Literal, TypeVar

import msgspec

from producer.protocol import Lane

T = TypeVar("T")

ArrivalPattern = Literal["poisson", "bursty"]
# Ids every model we ship knows (the tiny random ones have 512) and none treats as special.
TOKEN_IDS = range(3, 500)
DEFAULT_LENGTH_CAP = 4096


class TraceRequest(msgspec.Struct, frozen=True, omit_defaults=True):
    arrival_s: float  # offset from the start of the run
    prompt_ids: list[int]
    max_tokens: int
    lane: Lane | None = None  # None: the lane rule decides
    temperature: float = 0.0
    seed: int | None = None
    prefix_id: int | None = None  # which shared system prompt it starts with (for reports)
    ignore_eos: bool = True  # so that output lengths follow the trace


Lengths = Callable[[random.Random], int]


def parse_lengths(spec: str) -> Lengths:
    """'fixed:N' | 'uniform:LOW,HIGH' | 'lognormal:MEDIAN,SIGMA[,MAX]' -> a sampler of lengths."""
    name, _, arguments = spec.partition(":")
    try:
        values = [float(value) for value in arguments.split(",")] if arguments else []
    except ValueError:
        raise ValueError(f"lengths {spec!r}: the parameters must be numbers") from None
    if name == "fixed" and len(values) == 1 and values[0] >= 1:
        return lambda rng: int(values[0])
    if name == "uniform" and len(values) == 2 and 1 <= values[0] <= values[1]:
        low, high = int(values[0]), int(values[1])
        return lambda rng: rng.randint(low, high)
    if name == "lognormal" and len(values) in (2, 3) and values[0] >= 1 and values[1] > 0:
        mu, sigma = math.log(values[0]), values[1]
        cap = int(values[2]) if len(values) == 3 else DEFAULT_LENGTH_CAP
        return lambda rng: max(1, min(cap, round(rng.lognormvariate(mu, sigma))))
    raise ValueError(f"lengths {spec!r}: expected fixed:N, uniform:LOW,HIGH or lognormal:MEDIAN,SIGMA[,MAX] "
                     "with lengths >= 1")


def arrival_times(count: int, rate: float, rng: random.Random, pattern: ArrivalPattern = "poisson",
                  peak_to_trough: float = 10.0, burst_period_s: float = 10.0,
                  burst_on_share: float = 0.25) -> list[float]:
    """`count` arrival offsets, ascending, averaging `rate` per second."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    if pattern == "poisson":
        peak, rate_at = rate, lambda t: rate
    elif pattern == "bursty":
        if peak_to_trough < 1 or not 0 < burst_on_share < 1 or burst_period_s <= 0:
            raise ValueError("bursty arrivals need peak_to_trough >= 1, 0 < burst_on_share < 1, burst_period_s > 0")
        peak = rate / (burst_on_share + (1 - burst_on_share) / peak_to_trough)
        trough = peak / peak_to_trough
        rate_at = lambda t: peak if (t % burst_period_s) < burst_on_share * burst_period_s else trough  # noqa: E731
    else:
        raise ValueError(f"unknown arrival pattern {pattern!r}; expected poisson or bursty")
    # Thinning: candidates at the peak rate, each kept with probability rate(t) / peak.
    times, t = [], 0.0
    while len(times) < count:
        t += rng.expovariate(peak)
        if rng.random() * peak < rate_at(t):
            times.append(t)
    return times


def generate(count: int, rate: float, *, seed: int = 0, arrivals: ArrivalPattern = "poisson",
             peak_to_trough: float = 10.0, burst_period_s: float = 10.0, burst_on_share: float = 0.25,
             prompt_lengths: str = "uniform:32,256", output_lengths: str = "uniform:16,128",
             fast_share: float = 0.0, fast_prompt_lengths: str = "uniform:8,32",
             fast_output_lengths: str = "uniform:8,16", shared_prefix_share: float = 0.0,
             shared_prefix_tokens: int = 64, num_prefixes: int = 1) -> list[TraceRequest]:
    """A seeded trace. A `fast_share` of the requests claim the fast lane with the fast lengths, the
    rest go to the normal lane; a `shared_prefix_share` of them (of either lane) start with one of
    `num_prefixes` system prompts of `shared_prefix_tokens` tokens, before their own prompt."""
    if not (0 <= fast_share <= 1 and 0 <= shared_prefix_share <= 1):
        raise ValueError("fast_share and shared_prefix_share must be in [0, 1]")
    if count < 1 or num_prefixes < 1 or shared_prefix_tokens < 1:
        raise ValueError("count, num_prefixes and shared_prefix_tokens must be >= 1")
    rng = random.Random(seed)
    samplers = {"normal": (parse_lengths(prompt_lengths), parse_lengths(output_lengths)),
                "fast": (parse_lengths(fast_prompt_lengths), parse_lengths(fast_output_lengths))}
    prefixes = [random_ids(rng, shared_prefix_tokens) for _ in range(num_prefixes)]
    trace = []
    for arrival in arrival_times(count, rate, rng, arrivals, peak_to_trough, burst_period_s, burst_on_share):
        lane: Lane = "fast" if rng.random() < fast_share else "normal"
        prompt_length, output_length = samplers[lane]
        prefix_id = rng.randrange(num_prefixes) if rng.random() < shared_prefix_share else None
        prompt = (prefixes[prefix_id] if prefix_id is not None else []) + random_ids(rng, prompt_length(rng))
        trace.append(TraceRequest(arrival_s=round(arrival, 6), prompt_ids=prompt, max_tokens=output_length(rng),
                                  lane=lane, prefix_id=prefix_id))
    return trace


def random_ids(rng: random.Random, length: int) -> list[int]:
    return [rng.choice(TOKEN_IDS) for _ in range(length)]


def at_rate(trace: list[TraceRequest], factor: float) -> list[TraceRequest]:
    """The same requests arriving `factor` times as fast (a sweep's point at another offered load)."""
    return [msgspec.structs.replace(request, arrival_s=request.arrival_s / factor) for request in trace]


def offered_rate(trace: list[TraceRequest]) -> float:
    """Requests per second the trace offers (over the span of its arrivals)."""
    span = max(request.arrival_s for request in trace) if trace else 0.0
    return len(trace) / span if span > 0 else math.inf


_encoder = msgspec.json.Encoder()


def read_trace(path: str | Path) -> list[TraceRequest]:
    return read_jsonl(path, TraceRequest)


def read_jsonl(path: str | Path, type_: type[T]) -> list[T]:
    """One JSON object of `type_` per line (blank lines skipped); a bad line is named in the error."""
    decoder = msgspec.json.Decoder(type_)
    items = []
    for number, line in enumerate(Path(path).read_bytes().splitlines(), 1):
        if line.strip():
            try:
                items.append(decoder.decode(line))
            except msgspec.DecodeError as error:
                raise ValueError(f"{path}:{number}: {error}") from None
    return items


def write_trace(path: str | Path, trace: list[TraceRequest]) -> None:
    Path(path).write_bytes(b"".join(_encoder.encode(request) + b"\n" for request in trace))
