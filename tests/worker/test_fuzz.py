"""The fuzz campaign (ops/fuzz.py) against a live worker and a real redis-server: 1,000 seeded
hypothesis-drawn entries, XADDed raw to three tenants' lane streams, good requests among hostile
ones. Every bad entry is dead-lettered with its reason (and its id's error event, when the id is
usable, in its own tenant only), every good one served with the offline engine's tokens, and the
worker serves on. `pytest -m fuzz` runs it alone; `python -m ops.fuzz` runs the full 10,000."""

import re

import pytest

from ops.fuzz import TENANTS, Limits, campaign, generate, main

pytestmark = pytest.mark.fuzz


def test_a_thousand_fuzzed_entries_are_each_refused_or_served_and_the_worker_serves_on(make_worker, client):
    worker = make_worker()
    fuzzed = generate(1000, 0, Limits.of(worker.engine))
    report = campaign(worker, client, fuzzed)

    assert report.problems == []
    bad = [entry for entry in fuzzed if not entry.served]
    assert sum(report.dead_letters.values()) + report.repeats_acked == len(bad)
    assert report.error_events == sum(entry.request_id is not None and not entry.duplicate for entry in bad) > 0
    assert report.good_right == report.good == sum(entry.served == "good" for entry in fuzzed) > 0
    assert report.extreme_completed == report.extreme > 0
    assert report.canaries_right == len(TENANTS)
    assert (report.crashes, report.wedges, report.failed_turns) == (0, 0, 0)


def test_the_same_seed_draws_the_same_entries():
    limits = Limits(vocab_size=512, max_model_len=1024)
    first, second = (generate(100, 7, limits) for _ in range(2))
    assert [entry.fields() for entry in first] == [entry.fields() for entry in second]


def test_the_tool_runs_its_own_redis_and_worker_and_prints_the_counts(capsys, one_thread):
    assert main(["--entries", "50", "--seed", "1"]) == 0
    out = capsys.readouterr().out
    assert "dead-lettered" in out
    for count in ("crashes", "wedges", "problems"):
        assert re.search(rf"│ {count} +│ +0 │", out), count
