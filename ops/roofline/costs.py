"""What a step computes and moves, from the model's geometry, and how it compares with the peaks.

FLOPs: 2 x the layers' linear weights per computed token, 2 x lm_head's per sampled row, and attention's
q.k and p.v (2 x head_dim FLOPs each per query head and key it sees; causal: position p sees p + 1
keys, at most the sliding window). Norms, rotary and activations are left out: a few FLOPs per element.
Bytes: every linear weight read once (lm_head only in a step that samples), each sequence's K/V read over
its whole context (as the cost model counts it: cost_model.kv_reads) and the new tokens' K/V written.
Activations are left out, so the bytes are a floor.

Against the peaks: a step's compute time at the GEMM peak and its memory time at the peak bandwidth; the
slower of the two is the roofline's time for it, and its share of the roofline is that over the time
it took. That bound lets one part's memory traffic hide under another's compute; the parts run one after
the other, so the roofline by part adds up each part's own bound: the linear layers' (the slower of their
FLOPs at the peak and their weights at the bandwidth) and attention's (of its FLOPs and its K/V bytes).
The time a step took is the plain run's (Step.plain_s): the engine's own, without the timers' overhead;
where the time went is the timed run's shares of its own steps. A class's figures are its steps' sums:
FLOPs over seconds, not a mean of per-step rates.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ops.bench_offline import linear_weights
from ops.roofline.steps import PARTS, Step
from worker.engine.engine import Engine

PREFILL_HEAVY_SHARE = 0.9  # of a step's computed tokens in prefill chunks: prefill-heavy from this share on
CLASSES = ("prefill-heavy", "mixed", "decode")
FULL_DECODE_SEQS = 64  # the decode target is for steps of this many sequences or more
FULL_DECODE = f"decode, {FULL_DECODE_SEQS}+ seqs"


@dataclass(frozen=True)
class Geometry:
    layer_weights: int  # linear weights of all layers (lm_head apart)
    head_weights: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    itemsize: int
    sliding_window: int | None = None

    @classmethod
    def of(cls, engine: Engine) -> Geometry:
        weights, info = linear_weights(engine.model), engine.info
        return cls(weights["layers"], weights["head"], info.num_layers, info.num_heads, info.num_kv_heads,
                   info.head_dim, info.dtype.itemsize, info.sliding_window)

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.itemsize

    def keys_seen(self, cached: int, new: int) -> int:
        """Keys the new tokens of one sequence attend to, summed over them."""
        def up_to(length: int) -> int:  # positions 0 .. length-1, each seeing p + 1 keys (at most the window)
            window = self.sliding_window
            if window is None or length <= window:
                return length * (length + 1) // 2
            return window * (window + 1) // 2 + (length - window) * window
        return up_to(cached + new) - up_to(cached)


@dataclass(frozen=True)
class StepCosts:
    linear_flops: int
    attention_flops: int
    weight_bytes: int
    kv_bytes: int

    @property
    def flops(self) -> int:
        return self.linear_flops + self.attention_flops

    @property
    def bytes(self) -> int:
        return self.weight_bytes + self.kv_bytes

    def roofline_s(self, flops_per_s: float, bytes_per_s: float) -> float:
        """The step's time at the slower of compute and memory."""
        return max(self.flops / flops_per_s, self.bytes / bytes_per_s)

    def roofline_by_part_s(self, flops_per_s: float, bytes_per_s: float) -> float:
        """The linear layers' and attention's times at their own bounds, one after the other."""
        return (max(self.linear_flops / flops_per_s, self.weight_bytes / bytes_per_s)
                + max(self.attention_flops / flops_per_s, self.kv_bytes / bytes_per_s))


def step_costs(step: Step, geometry: Geometry) -> StepCosts:
    g = geometry
    keys = sum(g.keys_seen(cached, new) for cached, new in step.seqs)
    window = g.sliding_window or float("inf")
    kv_tokens = sum(min(cached + new, window) + new for cached, new in step.seqs)  # read, then written
    return StepCosts(
        linear_flops=2 * (g.layer_weights * step.tokens + g.head_weights * step.sampled),
        attention_flops=4 * g.num_layers * g.num_heads * g.head_dim * keys,
        weight_bytes=(g.layer_weights + (g.head_weights if step.sampled else 0)) * g.itemsize,
        kv_bytes=kv_tokens * g.kv_bytes_per_token)


def step_class(step: Step) -> str:
    if step.prefill_tokens == 0:
        return "decode"
    return "prefill-heavy" if step.prefill_tokens >= PREFILL_HEAVY_SHARE * step.tokens else "mixed"


def summarize(steps: list[Step], geometry: Geometry, gemm_gflops: float, bandwidth_gbps: float) -> dict[str, dict]:
    """Per class (CLASSES, those with steps), for the decode steps of FULL_DECODE_SEQS sequences or more
    (FULL_DECODE, if any) and for "all": its steps' figures against the peaks."""
    groups = {kind: [step for step in steps if step_class(step) == kind] for kind in CLASSES}
    groups[FULL_DECODE] = [step for step in groups["decode"] if len(step.seqs) >= FULL_DECODE_SEQS]
    groups = {kind: members for kind, members in groups.items() if members} | {"all": steps}
    return {kind: _figures(members, geometry, gemm_gflops * 1e9, bandwidth_gbps * 1e9)
            for kind, members in groups.items()}


def _figures(steps: list[Step], geometry: Geometry, flops_per_s: float, bytes_per_s: float) -> dict:
    each = [step_costs(step, geometry) for step in steps]
    seconds, timed_s = sum(step.plain_s for step in steps), sum(step.seconds for step in steps)
    flops, moved = sum(c.flops for c in each), sum(c.bytes for c in each)
    compute_s, memory_s = flops / flops_per_s, moved / bytes_per_s
    linear_s = sum(step.linear_s for step in steps)
    attention_s = sum(step.attention_s for step in steps)
    linear_flops = sum(c.linear_flops for c in each)
    attention_flops = sum(c.attention_flops for c in each)
    parts = {part: sum(step.parts()[part] for step in steps) for part in PARTS}
    return {
        "steps": len(steps), "prefill_tokens": sum(step.prefill_tokens for step in steps),
        "decode_rows": sum(step.decode_rows for step in steps), "sampled_rows": sum(step.sampled for step in steps),
        "seconds": seconds, "ms_per_step": 1e3 * seconds / len(steps), "timed_ms_per_step": 1e3 * timed_s / len(steps),
        "gflop": flops / 1e9, "gb": moved / 1e9,
        "gflops": flops / seconds / 1e9, "share_of_gemm_peak": flops / seconds / flops_per_s,
        "gbps": moved / seconds / 1e9, "share_of_bandwidth": moved / seconds / bytes_per_s,
        "bound": "compute" if compute_s >= memory_s else "memory",
        "share_of_roofline": sum(c.roofline_s(flops_per_s, bytes_per_s) for c in each) / seconds,
        "share_of_roofline_by_part": sum(c.roofline_by_part_s(flops_per_s, bytes_per_s) for c in each) / seconds,
        "linear_gflops": linear_flops / linear_s / 1e9 if linear_s else 0.0,
        "linear_share_of_gemm_peak": linear_flops / linear_s / flops_per_s if linear_s else 0.0,
        "attention_gflops": attention_flops / attention_s / 1e9 if attention_s else 0.0,
        "time_split": {part: parts[part] / timed_s for part in PARTS},
    }


def step_json(step: Step, geometry: Geometry) -> dict:
    return asdict(step) | asdict(step_costs(step, geometry)) | {
        "class": step_class(step), "prefill_tokens": step.prefill_tokens, "decode_rows": step.decode_rows,
        "parts": step.parts()}
