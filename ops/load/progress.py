"""The live view of a run while it goes: how far it got, what the client sees, what the workers say."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from rich.table import Table

from ops.percentile import percentile

if TYPE_CHECKING:
    from ops.load.runner import RunResult


def progress_view(result: RunResult) -> Table:
    records = list(result.requests)
    elapsed = max(1e-9, time.perf_counter() - result.started)
    ended = [record for record in records if record.end is not None or record.error is not None]
    failed = sum(1 for record in ended if record.error is not None or record.end.finish_reason == "error")
    tokens = sum(record.tokens for record in records)
    table = Table(show_header=False, box=None, title="load", title_justify="left")
    table.add_row("requests", f"{len(records)}/{result.total} submitted, {len(records) - len(ended)} in flight, "
                              f"{len(ended)} ended ({failed} failed)")
    table.add_row("output", f"{tokens} tokens in {elapsed:.1f} s: {tokens / elapsed:.1f} tokens/s")
    for lane in sorted({record.lane for record in records}):
        ttfts = [record.ttft for record in records if record.lane == lane and record.ttft is not None]
        if ttfts:
            table.add_row(f"TTFT {lane}", f"p50 {percentile(ttfts, 0.5):.3f} s, p99 {percentile(ttfts, 0.99):.3f} s")
    if result.samples:
        latest = result.samples[-1]
        usage = "-" if latest.kv_usage is None else f"{latest.kv_usage:.0%}"
        table.add_row("workers", f"{latest.running} running, {latest.waiting} waiting, KV {usage}")
    return table
