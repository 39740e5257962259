"""ops/gpu_check.sh's last phase: the CUDA tests' outcome merged into the benchmark's JSON, and the
figures the first GPU session reports, one line each.

    python -m ops.gpu_check OUT_DIR     (reads OUT_DIR/cuda-tests.xml and OUT_DIR/gpu.json)
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path


def test_outcome(junit: Path) -> dict:
    """pytest's JUnit XML -> {"passed": n, "failed": [names], "skipped": n}."""
    outcome = {"passed": 0, "failed": [], "skipped": 0}
    if not junit.exists():
        outcome["failed"].append("the tests did not run to the end (see gpu-check.log)")
        return outcome
    for case in ElementTree.parse(junit).iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            outcome["failed"].append(f"{case.get('classname')}::{case.get('name')}")
        elif case.find("skipped") is not None:
            outcome["skipped"] += 1
        else:
            outcome["passed"] += 1
    return outcome


def summary(results: dict) -> list[str]:
    tests = results["cuda_tests"]
    lines = [f"CUDA tests: {tests['passed']} passed, {len(tests['failed'])} failed, {tests['skipped']} skipped"]
    lines += [f"  failed: {name}" for name in tests["failed"]]
    for row in results.get("decode", []):
        bound = f"{row['share_of_bound']:.0%} of its {row['bound_by']} bound" if "share_of_bound" in row else "no bound"
        syncs = row.get("syncs_per_step")
        lines.append(f"decode {row['sequences']:>3} x {row['context']:>5}: {row['tokens_per_s']:>9,.0f} tokens/s, "
                     f"{bound}, host {row['host_s'] * 1e3:.3f} ms a step ({row['host_share']:.1%}), "
                     f"{'-' if syncs is None else f'{syncs:g}'} syncs a step")
    prefill = results.get("prefill", {})
    if "share_of_bound" in prefill:
        lines.append(f"prefill {prefill['prompt_tokens']:,} tokens: {prefill['share_of_bound']:.0%} of the matmul bound")
    lines += [f"target {'met' if v['met'] else 'NOT met'}: {v['target']} ({v['value']:.1%})"
              for v in results.get("targets", [])]
    return lines


def main(argv: list[str] | None = None) -> int:
    out = Path((argv or sys.argv[1:])[0])
    path = out / "gpu.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    results["cuda_tests"] = test_outcome(out / "cuda-tests.xml")
    path.write_text(json.dumps(results, indent=2))
    print("\n".join(summary(results)))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
