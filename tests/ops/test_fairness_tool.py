"""ops/fairness.py on a short trace: its own Redis, tenants and workers (the tiny model), three runs
(the quiet tenant alone, fair, FIFO); the figures, the per-request records and the plot."""

import json

import pytest

from ops.fairness import main


@pytest.mark.long
def test_the_tool_runs_the_quiet_tenant_alone_fair_and_fifo_and_reports_each(tmp_path, capsys):
    out, plot = tmp_path / "fairness.json", tmp_path / "fairness.png"
    assert main(["--model", "random:llama", "--duration", "2", "--quiet-rate", "1.5", "--flood-factor", "10",
                 "--itl-slo-ms", "0", "--json", str(out),
                 "--plot", str(plot)]) == 0
    result = json.loads(out.read_text())
    figures, requests = result["figures"], result["requests"]
    assert set(requests) == {"quiet alone", "fair (vtc)", "fifo"}
    for name in ("fair (vtc)", "fifo"):
        assert set(figures[name]) == {"quiet", "flood"}
        assert abs(sum(row["token_share"] for row in figures[name].values()) - 1) < 0.01
        assert all(record["finish"] and len(record["tokens"]) == 64 for record in requests[name])
    assert set(figures["quiet_p99_ttft_vs_alone"]) == {"fair (vtc)", "fifo"}
    assert plot.stat().st_size > 0 and "fair (vtc) vs FIFO" in capsys.readouterr().out
