"""Decoding, the backpressure rule, and reads/acks/dead letters on a real redis-server and on
fakeredis alike."""

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from producer.protocol import FIELD, GROUP, Request
from worker.engine.config import EngineConfig
from worker.engine.engine import Engine
from worker.entries import Entry, Rejected, decode_entry
from worker.intake import intake_room
from worker.tenants import LaneStreams

from .conftest import KEYS, MODEL, greedy, make_intake, submit

pack = msgspec.msgpack.encode


def entry(fields: dict) -> Entry:
    return Entry(KEYS.requests("normal"), "1-0", fields)


def test_a_valid_request_decodes():
    request = Request(id="ok", prompt_ids=[5, 6], params=greedy(3), lane="fast")
    assert decode_entry(entry({FIELD: msgspec.msgpack.encode(request)})) == request


@pytest.mark.parametrize("fields, request_id, reason", [
    ({FIELD: b"\xc1"}, None, "invalid request"),
    ({FIELD: pack("a string")}, None, "Expected `object`"),
    ({b"x": b"1"}, None, "entry has no 'm' field"),
    ({FIELD: pack({"id": "a/b", "prompt_ids": [5]})}, None, "request id must match"),
    ({FIELD: pack({"id": "x" * 65, "prompt_ids": [5]})}, None, "request id must match"),
    ({FIELD: pack({"id": 7, "prompt_ids": [5]})}, None, "Expected `str`"),
    ({FIELD: pack({"id": "t", "prompt_ids": [5], "params": {"max_tokens": "3"}})}, "t", "Expected `int`"),
    ({FIELD: pack({"id": "l", "prompt_ids": [5], "lane": "turbo"})}, "l", "Invalid enum value 'turbo'"),
    ({FIELD: pack({"id": "p", "prompt_ids": [5], "params": {"top_p": 0.0}})}, "p", "top_p must be in (0, 1]"),
    ({FIELD: pack({"id": "two", "prompt": "a", "prompt_ids": [5]})}, "two", "exactly one of"),
    ({FIELD: pack({"id": "u", "prompt_ids": [5], "sneaky": 1})}, "u", "unknown field `sneaky`"),
    ({FIELD: pack({"id": "v", "prompt_ids": [5], "v": 2})}, "v", "unsupported protocol version"),
    # NaN compares false with every time: such a deadline never expired, and the request ran anyway
    ({FIELD: pack({"id": "d", "prompt_ids": [5], "deadline": float("nan")})}, "d", "deadline must be a finite"),
    ({FIELD: pack({"id": "s", "prompt_ids": [5], "submitted_at": float("-inf")})}, "s", "submitted_at must be"),
    # a surrogate in CESU-8 (what some other languages' encoders write): not UTF-8
    ({FIELD: b"\x82\xa2id\xa4utf8\xa6prompt\xa3\xed\xa0\x80"}, "utf8", "invalid request"),
])
def test_a_bad_entry_is_rejected_with_its_reason_and_the_id_when_usable(fields, request_id, reason):
    rejected = decode_entry(entry(fields))
    assert isinstance(rejected, Rejected) and rejected.request_id == request_id
    assert reason in rejected.reason


def test_intake_room_keeps_a_few_waiting_and_nothing_while_the_pool_is_short(model):
    engine = Engine(EngineConfig.from_options(MODEL, num_blocks=8, watermark=0.2), model=model)
    assert intake_room(engine, ahead=4) == 4
    engine.add_request("big", prompt_ids=list(range(2, 102)), params=greedy(10))
    engine.add_request("small", prompt_ids=[5, 6], params=greedy(10))
    assert intake_room(engine, ahead=4) == 2
    engine.step()  # "big" now holds 7 of the 8 blocks: under the watermark nobody is read
    assert engine.pool.num_free_blocks == 1 and intake_room(engine, ahead=4) == 0


@pytest.fixture
def intake(any_client):
    streams = LaneStreams(KEYS)
    streams.serve({KEYS.tenant: 1})
    intake = make_intake(any_client, streams)
    intake.ensure_groups()
    intake.ensure_groups()  # BUSYGROUP is fine
    return intake


def test_reads_take_each_lane_up_to_the_room_fast_lane_first_in_one_round_trip(intake, any_client):
    normal = [submit(any_client, Request(id=f"n{i}", prompt_ids=[5])) for i in range(3)]
    fast = [submit(any_client, Request(id=f"f{i}", prompt_ids=[5]), "fast") for i in range(2)]
    assert intake.read(0) == []
    pipelines, pipeline = [], intake.client.pipeline
    intake.client.pipeline = lambda *args, **kwargs: pipelines.append(kwargs) or pipeline(*args, **kwargs)
    assert [e.entry_id for e in intake.read(2)] == fast + normal[:2]
    assert len(pipelines) == 1
    assert [e.entry_id for e in intake.read(5, block_ms=10)] == normal[2:]
    assert intake.read(5, block_ms=10) == []


def test_a_blocking_read_takes_up_to_the_room_of_each_lane_and_holds_back_nothing(intake, any_client):
    """COUNT applies per stream: what the read returns is all handed over, none kept pending
    unseen (a peer would reclaim an entry held but not refreshed)."""
    fast = [submit(any_client, Request(id=f"f{i}", prompt_ids=[5]), "fast") for i in range(2)]
    normal = [submit(any_client, Request(id=f"n{i}", prompt_ids=[5])) for i in range(2)]
    assert [e.entry_id for e in intake.read(1, block_ms=10)] == [fast[0], normal[0]]
    assert [e.entry_id for e in intake.read(1, block_ms=10)] == [fast[1], normal[1]]
    assert intake.read(1, block_ms=10) == []


def test_ack_deletes_the_entries_and_records_dead_letters(intake, any_client):
    submit(any_client, Request(id="good", prompt_ids=[5]))
    any_client.xadd(KEYS.requests("normal"), {b"junk": b"\x00"})
    good, junk = intake.read(5)
    any_client.set(KEYS.attempt("good"), b"1 owner")
    intake.ack([good], [(junk, "entry has no 'm' field", None)], fences=[KEYS.attempt("good")])
    assert 0 < any_client.ttl(KEYS.attempt("good")) <= 60, "the fence outlives the entry by the replay TTL"
    assert any_client.xlen(KEYS.requests("normal")) == 0
    assert any_client.xpending(KEYS.requests("normal"), GROUP)["pending"] == 0
    [(_, letter)] = any_client.xrange(KEYS.dead_letters)
    junk_entry = pack({b"junk": b"\x00"})
    assert letter == {b"tenant": b"default", b"id": b"", b"reason": b"entry has no 'm' field", b"entry": junk_entry,
                      b"entry_bytes": str(len(junk_entry)).encode(),
                      b"stream": KEYS.requests("normal").encode(), b"entry_id": junk.entry_id.encode()}


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.binary(max_size=64), msgpack_values.map(pack),
                 st.dictionaries(st.sampled_from(["id", "prompt_ids", "params", "lane", "v", "prompt"]),
                                 msgpack_values, max_size=6).map(pack)))
def test_no_entry_makes_decoding_raise(data):
    assert isinstance(decode_entry(entry({FIELD: data})), (Request, Rejected))


def test_nesting_deep_enough_to_exhaust_the_stack_is_rejected():
    assert isinstance(decode_entry(entry({FIELD: b"\x91" * 200_000 + b"\x00"})), Rejected)
