"""ops/bench_decode_attention: every case measured against the read bandwidth on the tiny random model, and
a kernel whose output is wrong is refused before it is timed."""

from ops import bench_decode_attention
from worker.engine import kernels


def test_every_case_is_measured_against_the_read_bandwidth(capsys):
    assert bench_decode_attention.main(["--model", "random:llama", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "read bandwidth" in out
    rows = [line for line in out.splitlines() if "in order" in line or "scattered" in line]
    assert len(rows) == 2 * 2 * len(bench_decode_attention.CASES)  # dtypes x layouts x cases
    assert all("%" in row for row in rows)


def test_a_wrong_kernel_is_refused(capsys, monkeypatch):
    right = kernels.paged_decode
    monkeypatch.setattr(kernels, "paged_decode", lambda q, *args: right(q, *args) + 0.01)
    assert bench_decode_attention.main(["--model", "random:llama", "--repeats", "1"]) == 1
    assert "differs from SDPA" in capsys.readouterr().out
