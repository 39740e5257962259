"""The intake's shares between tenants (worker/fair_intake.py): weighted deficit round robin over the
tenants' streams of a lane, on a real redis-server and on fakeredis."""

import collections

from producer.protocol import Keys, Request
from worker.fair_intake import IntakeShares
from worker.tenants import LaneStreams

from .conftest import make_intake, submit

KEYS = Keys("sb")


def test_weighted_shares_carry_fractions_and_drop_what_an_emptied_queue_could_not_use():
    shares = IntakeShares()
    shares.weights = {"a": 2.0}
    got = collections.Counter()
    for _ in range(30):  # both always have more than they are asked: 2:1 over the reads, fractions carried
        counts = shares.counts(["a", "b"], 4)
        shares.took(counts, counts)
        got.update(counts)
    assert abs(got["a"] / got["b"] - 2.0) < 0.1 and sum(got.values()) <= 30 * 4 + 2
    counts = shares.counts(["a", "b"], 4)
    shares.took(counts, {"a": 1, "b": counts["b"]})  # a ran dry: no credit kept for what it could not take
    assert shares.deficits["a"] == 0.0
    shares.took(shares.counts(["a", "b"], 4), {"b": 4})  # a gave nothing: probed with one entry from now on
    assert shares.counts(["a", "b"], 4)["a"] == 1


def test_a_flooding_tenant_takes_no_more_of_a_read_than_its_weight_while_another_has_requests(any_client):
    streams = LaneStreams(KEYS)
    streams.serve({"flood": 1, "quiet": 1, "idle": 1})
    intake = make_intake(any_client, streams, KEYS)
    intake.ensure_groups()
    intake.set_weights({"quiet": 3.0})
    for i in range(200):
        submit(any_client, Request(id=f"f{i}", prompt_ids=[5]), keys=KEYS.of("flood"))
    for i in range(40):
        submit(any_client, Request(id=f"q{i}", prompt_ids=[5]), keys=KEYS.of("quiet"))
    taken = collections.Counter()
    for _ in range(5):  # 30 of the quiet tenant's 40 at 3:1: it still has requests
        for entry in intake.read(8):
            taken[streams[entry.stream].tenant] += 1
    assert taken["idle"] == 0
    assert 2.5 <= taken["quiet"] / taken["flood"] <= 3.5, taken  # 3:1 while both have requests
    while any(streams[entry.stream].tenant == "quiet" for entry in intake.read(8)):
        pass
    alone = collections.Counter(streams[entry.stream].tenant for entry in intake.read(8))
    assert alone["flood"] >= 7, "the quiet tenant emptied: the flood gets the whole read (work-conserving)"


def test_with_no_room_left_only_a_tenant_with_nothing_waiting_in_the_engine_is_read_one_entry(any_client):
    streams = LaneStreams(KEYS)
    streams.serve({"flood": 1, "quiet": 1})
    intake = make_intake(any_client, streams, KEYS)
    intake.ensure_groups()
    for i in range(20):
        submit(any_client, Request(id=f"f{i}", prompt_ids=[5]), keys=KEYS.of("flood"))
        submit(any_client, Request(id=f"q{i}", prompt_ids=[5]), keys=KEYS.of("quiet"))
    assert intake.read(0) == []  # nobody said what waits in the engine: no read at all
    flood_waits = {"fast": set(), "normal": {"flood"}}
    taken = [streams[entry.stream].tenant for entry in intake.read(0, waiting=flood_waits)]
    assert taken == ["quiet"]  # the flood's requests wait in the engine already: it gets nothing more
    both_wait = {"fast": set(), "normal": {"flood", "quiet"}}
    assert intake.read(0, waiting=both_wait) == []
