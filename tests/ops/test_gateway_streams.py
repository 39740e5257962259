"""ops/gateway_streams.py on a few streams: its own Redis, worker and gateway; every stream
completes and the table has the memory and added-latency figures."""

import json

import pytest

from ops.gateway_streams import main


@pytest.mark.long
def test_the_tool_opens_the_streams_and_reports_memory_and_added_latency(tmp_path, capsys):
    figures = tmp_path / "streams.json"
    assert main(["--streams", "30", "--max-tokens", "12", "--json", str(figures)]) == 0
    result = json.loads(figures.read_text())
    assert (result["completed"], result["failed"]) == (30, 0)
    assert result["gateway_peak_rss_mb"] > 0 and result["added_latency_events"] > 0
    assert "SSE streams on one gateway process" in capsys.readouterr().out
