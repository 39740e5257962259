"""ops/agreement.py: two dtypes of our engine side by side, their greedy tokens compared."""

import json
from types import SimpleNamespace

import pytest
import torch

from ops.agreement import agreement, differences, main, round_weights_to_bf16
from worker.engine.models import load_model


def test_agreement_counts_the_first_tokens_matched_before_the_first_difference():
    assert agreement([1, 2, 3, 4], [1, 2, 3, 4, 5], 4) == 1.0
    assert agreement([1, 2, 3, 4], [1, 9, 3, 4], 4) == 0.25  # the same again after a difference: not counted
    assert agreement([1, 2, 3, 4, 5, 6], [1, 2, 7], 2) == 1.0  # only the first two compared
    assert agreement([1, 2, 3, 4], [1, 2], 4) == 0.5  # the other ended early
    with pytest.raises(ValueError):
        agreement([], [1], 4)


def test_a_run_in_two_dtypes_prints_both_throughputs_and_the_agreement(tmp_path, capsys):
    figures = tmp_path / "agreement.json"
    assert main(["--model", "random:llama", "--dtype", "bfloat16", "--workloads", "chat", "--count", "4",
                 "--first", "8", "--json", str(figures)]) == 0
    row = json.loads(figures.read_text())["chat"]
    assert row["requests"] == 4 and 0.0 <= row["min"] <= row["mean"] <= 1.0
    assert row["tokens_per_s"] > 0 and row["reference_tokens_per_s"] > 0
    # teacher-forced: each difference counted once, so never below the free-running share
    assert row["mean"] <= row["forced_mean"] <= 1.0 and row["min"] <= row["forced_min"]
    assert row["forced_mean"] == pytest.approx(1 - row["differences"] / (4 * 8))
    assert row["differences"] == 0 or 0.0 <= row["margin_median"] <= row["margin_max"]
    assert "bfloat16 against float32" in capsys.readouterr().out


def test_the_same_dtype_twice_agrees_on_every_token(tmp_path):
    figures = tmp_path / "agreement.json"
    assert main(["--model", "random:llama", "--dtype", "float32", "--workloads", "mixed", "--count", "3",
                 "--json", str(figures)]) == 0
    row = json.loads(figures.read_text())["mixed"]
    assert row["mean"] == row["min"] == 1.0 and row["all_same"] == 3
    assert row["forced_mean"] == 1.0 and row["differences"] == 0


def test_bf16_weights_runs_the_float32_engine_on_every_weight_rounded_to_bf16(monkeypatch):
    import ops.agreement

    model, _ = load_model("random:llama", "float32")
    before = [parameter.detach().clone() for parameter in model.parameters()]
    round_weights_to_bf16(model)
    for old, parameter in zip(before, model.parameters()):
        assert parameter.dtype == torch.float32
        assert torch.equal(parameter, old.to(torch.bfloat16).float())
    assert any(not torch.equal(old, parameter) for old, parameter in zip(before, model.parameters()))

    rounded = []
    monkeypatch.setattr(ops.agreement, "round_weights_to_bf16",
                        lambda model: rounded.append(model) or round_weights_to_bf16(model))
    result = ops.agreement.run_engine("random:llama", "bf16-weights", "mixed", 2, 0, 8)
    [model] = rounded
    assert {parameter.dtype for parameter in model.parameters()} == {torch.float32}
    assert result["dtype"] == "bf16-weights" and len(result["outputs"]) == 2


class ScriptedEngine:
    """An engine whose greedy choice after a context is its position, except at the positions in `wrong`."""

    def __init__(self, wrong: set[int]) -> None:
        self.wrong, self.pending, self.rounds = wrong, {}, 0

    def add_request(self, request_id, *, prompt_ids, params):
        self.pending[request_id] = (list(prompt_ids), params.max_tokens)

    @property
    def has_unfinished(self):
        return bool(self.pending)

    def step(self):
        self.rounds += 1
        outputs = []
        for request_id, (context, max_tokens) in self.pending.items():
            tokens = []
            for _ in range(max_tokens):  # context[0] is the prompt: position = len(context) - 1
                position = len(context) - 1
                tokens.append(99 if position in self.wrong else position)
                context.append(tokens[-1])
            outputs.append(SimpleNamespace(request_id=request_id, token_ids=tokens, logprobs=[]))
        self.pending = {}
        return outputs


def test_teacher_forcing_finds_every_difference_resuming_after_each_with_the_reference_token():
    reference = {"r0": list(range(10)), "r1": list(range(10))}
    prompts = [[100], [100]]
    assert differences(ScriptedEngine({3, 7}), prompts, reference, first=10) == {"r0": [3, 7], "r1": [3, 7]}
    assert differences(ScriptedEngine({3, 7}), prompts, reference, first=5) == {"r0": [3], "r1": [3]}
    assert differences(ScriptedEngine({9}), prompts, reference, first=10) == {"r0": [9], "r1": [9]}
    assert differences(ScriptedEngine(set()), prompts, reference, first=10) == {"r0": [], "r1": []}
