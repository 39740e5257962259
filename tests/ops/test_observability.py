"""The Prometheus and Grafana files under ops/ hold together: promtool accepts the config and the
alert rules and passes the rules' unit tests, every dashboard query is valid PromQL on the
provisioned datasource, and every streambatch: series the alerts and the dashboard read is one a
live worker exports, with the labels they group it by."""

import json
import re
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from producer.protocol import Request

from ..worker.conftest import client, greedy, is_finished, make_worker, model, run_until, submit  # noqa: F401

OPS = Path(__file__).resolve().parents[2] / "ops"
PROMETHEUS = OPS / "prometheus"
GRAFANA = OPS / "grafana"
SERIES = re.compile(r"streambatch:[A-Za-z0-9_:]+")
GROUPING = re.compile(r"\bby\s*\(([^)]*)\)")
TARGET_LABELS = {"instance", "job"}  # added by Prometheus when it scrapes, not exported by the worker
GRAFANA_DURATIONS = ("$__rate_interval", "$__range")


@pytest.fixture(scope="module")
def promtool() -> str:
    binary = shutil.which("promtool")
    if binary is None:
        pytest.fail("promtool is not installed: run `make setup` (Debian/Ubuntu package prometheus)")
    return binary


def run_promtool(promtool: str, *arguments: str) -> None:
    result = subprocess.run([promtool, *arguments], cwd=PROMETHEUS, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"promtool {' '.join(arguments)}:\n{result.stdout}{result.stderr}"


def alert_expressions() -> list[str]:
    groups = yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())["groups"]
    return [rule["expr"] for group in groups for rule in group["rules"]]


def dashboard() -> dict:
    return json.loads((GRAFANA / "dashboards" / "streambatch.json").read_text())


def dashboard_expressions() -> list[str]:
    return [target["expr"] for panel in dashboard()["panels"] for target in panel["targets"]]


def queried_series(expressions: list[str]) -> dict[str, set[str]]:
    """Each streambatch: series the expressions read -> the labels an expression reading it groups by."""
    queried: dict[str, set[str]] = {}
    for expression in expressions:
        grouped = {label.strip() for labels in GROUPING.findall(expression) for label in labels.split(",")}
        for name in SERIES.findall(expression):
            queried.setdefault(name, set()).update(grouped - {""} - TARGET_LABELS)
    return queried


def exported_series(port: int) -> dict[str, list[set[str]]]:
    """Each series name on /metrics (with its _bucket/_total/... suffix) -> the label names of its samples."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    exported: dict[str, list[set[str]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            exported.setdefault(sample.name, []).append(set(sample.labels))
    return exported


@pytest.mark.parametrize("arguments", [("check", "config", "prometheus.yml"), ("check", "rules", "alerts.yml"),
                                       ("test", "rules", "alerts_test.yml")], ids=" ".join)
def test_promtool_accepts_the_prometheus_files(promtool, arguments):
    run_promtool(promtool, *arguments)


def test_dashboard_queries_are_valid_promql(promtool, tmp_path):
    """promtool parses them as recording rules, Grafana's range variables replaced by a duration."""
    rules = []
    for number, expression in enumerate(dashboard_expressions()):
        for variable in GRAFANA_DURATIONS:
            expression = expression.replace(variable, "5m")
        rules.append({"record": f"dashboard:query_{number}", "expr": expression})
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    run_promtool(promtool, "check", "rules", str(path))


def test_every_panel_queries_the_provisioned_datasource():
    provisioned = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text())
    datasource = {"type": "prometheus", "uid": provisioned["datasources"][0]["uid"]}
    panels = dashboard()["panels"]
    assert len({panel["id"] for panel in panels}) == len(panels)
    for panel in panels:
        assert panel.get("datasource") == datasource, panel["title"]
        assert panel["targets"] and all(target["expr"].strip() for target in panel["targets"]), panel["title"]
        assert len({target["refId"] for target in panel["targets"]}) == len(panel["targets"]), panel["title"]


def test_alerts_and_dashboard_read_series_a_worker_exports(make_worker, client):
    worker = make_worker(metrics_port=0)
    for lane in ("fast", "normal"):  # every lane-labelled series, and request_success{finished_reason}, exists
        submit(client, Request(id=lane, prompt_ids=[5, 6, 7], params=greedy(4)), lane)
    run_until([worker], lambda: is_finished(client, "fast") and is_finished(client, "normal"))
    worker.housekeeping()  # samples the lane streams' gauges
    exported = exported_series(worker.metrics_server.server_port)

    queried = queried_series(alert_expressions() + dashboard_expressions())
    assert len(queried) > 15  # the expressions were read at all
    missing = sorted(name for name in queried if name not in exported)
    assert missing == [], f"queried but not exported: {missing}"
    ungrouped = {name: sorted(labels) for name, labels in queried.items()
                 if not all(labels <= sample_labels for sample_labels in exported[name])}
    assert ungrouped == {}, f"grouped by labels the series lack: {ungrouped}"
