"""The preemption avalanche: the triage advice on synthetic figures, the over-long share, and one small
run of `python -m ops.avalanche` on the tiny random model (two private workers, one after the other)."""

import json

import pytest

from ops.avalanche import OFF, advice, long_request_share, main
from ops.load.trace import TraceRequest


def request(prompt_tokens: int, max_tokens: int) -> TraceRequest:
    return TraceRequest(arrival_s=0.0, prompt_ids=[3] * prompt_tokens, max_tokens=max_tokens)


def test_long_requests_are_those_needing_more_than_a_quarter_of_the_pool():
    # a pool of 256 tokens: over 64 is over-long
    trace = [request(10, 54), request(10, 55), request(60, 60), request(1, 1)]
    assert long_request_share(trace, pool_tokens=256) == 0.5


def test_advice_follows_the_triage_order():
    steps = advice(preemption_rate=0.4, watermark=0.2, long_share=0.5, waiting_share=0.9)
    assert len(steps) == 3
    assert "raise the watermark" in steps[0] and "--watermark 0.2 -> 0.3" in steps[0]
    assert "over-long requests" in steps[1] and "50%" in steps[1]
    assert "rate-limit at the entrance" in steps[2] and "max_backlog" in steps[2]


@pytest.mark.parametrize("figures, expected", [
    (dict(preemption_rate=0.06, watermark=0.0, long_share=0.0, waiting_share=0.1), ["raise the watermark"]),
    (dict(preemption_rate=0.05, watermark=0.2, long_share=0.0, waiting_share=0.1), []),  # 5% is still fine
    (dict(preemption_rate=0.01, watermark=0.2, long_share=0.2, waiting_share=None), ["over-long requests"]),
    (dict(preemption_rate=None, watermark=0.2, long_share=0.05, waiting_share=0.5), ["rate-limit at the entrance"]),
    (dict(preemption_rate=0.3, watermark=0.2, long_share=0.0, waiting_share=0.8),
     ["raise the watermark", "rate-limit at the entrance"]),
])
def test_advice_names_only_what_the_figures_show(figures, expected):
    steps = advice(**figures)
    assert len(steps) == len(expected)
    for step, words in zip(steps, expected):
        assert words in step


def test_the_watermark_advice_stays_within_what_the_worker_accepts():
    assert "--watermark 0.45 -> 0.5" in advice(0.5, 0.45, 0.0, None)[0]


def test_avalanche_command_on_the_tiny_model(tmp_path):
    out = tmp_path / "avalanche"
    code = main(["--model", "random:llama", "--count", "12", "--rate", "40", "--num-blocks", "16",
                 "--worker-args", "--threads 1", "--out", str(out)])
    assert code == 0
    runs = json.loads((out / "avalanche.json").read_text())
    assert [(run["name"], run["worker_args"], run["watermark"]) for run in runs] == [("on", [], 0.2), ("off", OFF, 0.0)]
    for run in runs:
        report = run["report"]
        assert report["lanes"]["all"]["finished"] == 12
        assert report["preemptions"] is not None and report["preemption_rate"] is not None
    assert (out / "avalanche.png").stat().st_size > 0
