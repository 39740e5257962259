"""Layers point down only: these tests fail when an import crosses a boundary."""

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def imported_modules(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("module", ["worker.engine.scheduler", "worker.engine.blocks",
                                    "worker.engine.simulator", "producer.protocol"])
def test_pure_modules_load_without_torch_or_redis(module):
    code = f"import sys, {module}; print(sorted(m for m in ('torch', 'redis', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_engine_imports_nothing_above_it_and_producer_nothing_of_the_worker():
    for path in (ROOT / "worker" / "engine").rglob("*.py"):
        for name in imported_modules(path):
            assert not name.startswith("worker.") or name.startswith("worker.engine"), (path, name)
            assert name.split(".")[0] != "redis", (path, name)
    for path in (ROOT / "producer").rglob("*.py"):
        assert not any(n.split(".")[0] == "worker" for n in imported_modules(path)), path
