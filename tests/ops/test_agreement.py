"""ops/agreement.py: two dtypes of our engine side by side, their greedy tokens compared."""

import json

import pytest

from ops.agreement import agreement, main


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
    assert "bfloat16 against float32" in capsys.readouterr().out


def test_the_same_dtype_twice_agrees_on_every_token(tmp_path):
    figures = tmp_path / "agreement.json"
    assert main(["--model", "random:llama", "--dtype", "float32", "--workloads", "mixed", "--count", "3",
                 "--json", str(figures)]) == 0
    row = json.loads(figures.read_text())["mixed"]
    assert row["mean"] == row["min"] == 1.0 and row["all_same"] == 3
