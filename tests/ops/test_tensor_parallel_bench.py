"""The GPU benchmark's dry run split across two ranks (two processes over gloo on the CPU): the path
a multi-GPU machine runs with `--tensor-parallel N`, end to end, its greedy tokens HF's."""

import json

import pytest

from ops.bench_gpu import SECTIONS, main

pytestmark = pytest.mark.usefixtures("one_thread")


def test_dry_run_on_two_ranks_reports_every_section_and_one_rank_s_share(tmp_path):
    out, whole = tmp_path / "two.json", tmp_path / "one.json"
    assert main(["--dry-run", "--tensor-parallel", "2", "--skip", "device", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert set(SECTIONS) - {"device"} | {"config"} == set(results)
    assert results["config"]["tensor_parallel"] == 2
    assert [(row["sequences"], row["context"]) for row in results["decode"]] == [(1, 32), (4, 32), (1, 64), (4, 64)]
    assert results["offline"]["output_tokens"] == 4 * 16 + 2 * 64 + 2 * 256  # every request to its end
    greedy = results["greedy"]
    assert greedy["passed"] and [(c["exact"], c["prompts"]) for c in greedy["checks"]] == [(4, 4)]
    # the figures of one rank: half the heads, so half the KV bytes a block of one rank's cache
    assert main(["--dry-run", "--skip", "device,decode,prefill,offline,greedy", "--json", str(whole)]) == 0
    one_rank, two_ranks = json.loads(whole.read_text())["config"], results["config"]
    assert one_rank["parameters"] == two_ranks["parameters"]
    per_block = lambda config: config["kv_cache_bytes"] / config["num_blocks"]  # noqa: E731
    assert per_block(one_rank) == 2 * per_block(two_ranks)
