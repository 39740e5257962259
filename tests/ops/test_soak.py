"""ops/soak.py end to end, briefly: a private Redis and two workers on the tiny model under ten
seconds of steady load, the trace's shared system prompts pinned; every request completes, after
the drain each worker holds exactly its pinned blocks (none leaked), the report shows it all."""

import io
import sys

import pytest
from rich.console import Console

from ops.load.trace import generate
from ops.soak import SHARE, SHARED_PREFIX_TOKENS, run, shared_prefixes, tables

DURATION_S, RATE = 10, 3.0


@pytest.mark.long
def test_a_ten_second_soak_completes_everything_and_leaks_no_kv_block():
    screen = Console(file=io.StringIO(), width=160)
    trace = generate(round(DURATION_S * RATE), RATE, seed=1, prompt_lengths="uniform:8,64",
                     output_lengths="uniform:64,256", fast_share=0.25, shared_prefix_share=0.5, num_prefixes=2,
                     shared_prefix_tokens=SHARED_PREFIX_TOKENS)
    soak = run(screen, trace, redis_url=None, workers=2, duration=DURATION_S, drain_timeout=60,
               worker_command=[sys.executable, "-m", "worker", "--model", "random:llama", "--threads", "1",
                               "--num-blocks", "256"], pins=shared_prefixes(trace))
    screen.print(tables(soak))
    out = screen.file.getvalue()
    print(out)

    assert soak.ok and soak.completed == len(trace)
    assert {blocks.leaked for blocks in soak.kv.values()} == {0} and len(soak.kv) == 2
    pinned = 2 * SHARED_PREFIX_TOKENS // 16  # two prefixes of whole blocks, in every worker that computed them
    assert {blocks.referenced for blocks in soak.kv.values()} <= {0, pinned // 2, pinned}, soak.kv
    assert any(blocks.pinned == pinned for blocks in soak.kv.values()), soak.kv
    assert all(len(worker.rss_kib) >= DURATION_S // 2 for worker in soak.workers), "RSS sampled all along"
    assert any(max(worker.kv_used) > 0 for worker in soak.workers), "the KV reading sees blocks in use under load"
    assert len(soak.redis_memory) >= DURATION_S // 2
    first = sorted(soak.records, key=lambda record: record.submitted)[:round(SHARE * len(trace))]
    assert all(record.ttft is not None for record in first)
    for row in ("leaked", "TTFT P50", "TTFT P99", "ITL P50", "ITL P99", "Redis used_memory after the drain",
                "completed", "errors"):
        assert row in out, row
