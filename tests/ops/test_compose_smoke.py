"""The deployment for real (ops/compose_smoke.py): compose.yaml's CPU stack built and run with
podman, a request served, a worker killed and its request finished by the other, the hardening
checked on the running containers. Minutes, root and podman: marked `compose`, run alone by
`make compose-smoke`, never by `make test`."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.compose
@pytest.mark.timeout(1800)
def test_the_cpu_stack_serves_survives_a_kill_and_is_hardened(tmp_path):
    figures = tmp_path / "smoke.json"
    smoke = subprocess.run([sys.executable, "-m", "ops.compose_smoke", "--json", str(figures)], cwd=ROOT,
                           capture_output=True, text=True, timeout=1700)
    assert smoke.returncode == 0, smoke.stdout[-4000:] + smoke.stderr[-4000:]
    result = json.loads(figures.read_text())
    assert result["request_text"] and result["tenant"]["registered"] and result["gateway_text"]
    assert len(result["tenant_refused"]) == 7
    assert result["kill"]["attempts"] == [1, 2] and result["kill"]["same_tokens_as_undisturbed"]
    assert len(result["prometheus_targets_up"]) == 2
    hardening = result["hardening"].values()
    assert sorted(entry["service"] for entry in hardening) == ["gateway", "prometheus", "redis", "worker-cpu",
                                                               "worker-cpu"]
    assert all(entry["uid"] != "0" for entry in hardening)
    assert [entry["uid"] for entry in hardening if entry["service"] == "worker-cpu"] == ["10001", "10001"]
    assert result["events_kept_across_down_up"] > 0 and "gpu_branch_build_s" in result
