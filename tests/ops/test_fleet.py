"""ops/fleet briefly (--quick), on one node and on the cluster: synthetic workers on the real worker
loop, producers and live consumers, every master capped; the JSON has every figure for each step and
node, events flowed to the consumers through every master, and the summary sizes the fleet, as
measured and at the fleet's own events per round trip."""

import json
import os

import pytest

from ops.fleet.__main__ import main
from ops.fleet.cpu_caps import CPU_CONTROLLER

pytestmark = pytest.mark.skipif(not os.access(CPU_CONTROLLER, os.W_OK),
                                reason="the tool caps each Redis master's CPU with a cgroup: root only")


@pytest.mark.long
def test_a_quick_fleet_run_measures_one_node_and_the_cluster(tmp_path, capsys):
    out = tmp_path / "fleet"
    assert main(["--quick", "--topologies", "node,cluster", "--out", str(out)]) == 0
    figures = json.loads((out / "fleet.json").read_text())
    assert set(figures["steps"]) == {"node", "cluster"}
    for kind, steps in figures["steps"].items():
        assert steps and steps[0]["workers"] == 1
        assert [step["kind"] for step in steps[:4]] == ["ramp", "probe", "half capacity", "no consumers"]
        assert {step["node_cpu"] for step in steps if step["kind"] == "ramp"} == {figures["node_cpu"]}
        assert steps[2]["node_cpu"] == steps[3]["node_cpu"] > figures["node_cpu"]
        for step in steps:
            followed = step["kind"] != "no consumers"
            assert step["events_written_per_s"] > 0 and (step["events_per_s"] > 0) == followed
            assert step["intake"]["count"] == step["started"]["count"] > 0
            assert 0 <= step["intake"]["p50_ms"] <= step["started"]["p50_ms"]
            assert step["steps_per_s"] > 0 and step["batch"] > 0 and not step["failures"]
            masters = [node for node in step["nodes"] if node["master"]]
            assert len(masters) == (1 if kind == "node" else 3) and len(step["nodes"]) == (1 if kind == "node" else 6)
            for node in masters:
                assert node["cpu_cores"] > 0 and node["commands_per_s"] > 0 and node["events_per_s"] > 0, (kind, node)
    summary = figures["summary"]
    assert set(summary["topologies"]) == {"node", "cluster"} and summary["scaling"]["cluster / node"]["ratio"] > 0
    fleet = summary["fleet"]
    assert fleet["events_per_s"] == 1000 * 64 * 50 and fleet["masters_at_capacity"] >= 1
    round_trips = fleet["round_trips"]
    assert set(round_trips["redis_cpu_us_per_event"]) == {"64", "21", "8", "4", "2", "1"}
    assert all(us > 0 for us in round_trips["redis_cpu_us_per_event"].values())
    assert round_trips["events_per_round_trip_measured"] == 21.33  # 64 sequences over the three masters
    assert round_trips["events_per_round_trip_fleet"] < 21.33 and round_trips["masters_at_capacity"] >= 3
    assert (out / "fleet.png").stat().st_size > 0
    printed = capsys.readouterr().out
    assert "fleet on one node" in printed and "fleet on a cluster of three masters" in printed and "capacity" in printed
