"""The fleet model's arithmetic: its load spreads the requests in flight evenly over a cluster's
masters (by their ids' hash slots) and leaves the ids to the producer on one node; a fleet's
events per round trip, and the masters it needs once each carries so few."""

import math

import pytest
from redis.crc import key_slot

from ops.fleet.load import Load
from ops.fleet.round_trips import RoundTripCost, events_per_round_trip, masters_needed
from ops.fleet.scenario import QUICK

THREE_MASTERS = [[(0, 5460)], [(5461, 10922)], [(10923, 16383)]]


def test_each_slot_s_requests_have_their_keys_on_the_slot_s_master():
    load = Load("redis://unused", True, QUICK, THREE_MASTERS, seed=3, control=None)
    ids = [load.request_id(slot) for slot in range(30)]
    assert len(set(ids)) == len(ids)
    for slot, request_id in enumerate(ids):
        (start, end), = THREE_MASTERS[slot % 3]
        assert start <= key_slot(request_id.encode()) <= end, (slot, request_id)


def test_a_master_of_several_ranges_gets_ids_in_any_of_them():
    ranges = [(0, 99), (16_000, 16_383)]
    load = Load("redis://unused", True, QUICK, [ranges], seed=1, control=None)
    slots = {key_slot(load.request_id(0).encode()) for _ in range(200)}
    assert all(any(start <= slot <= end for start, end in ranges) for slot in slots)
    assert any(slot <= 99 for slot in slots) and any(slot >= 16_000 for slot in slots)


def test_on_one_node_the_producer_picks_the_ids():
    assert Load("redis://unused", False, QUICK, [], seed=1, control=None).request_id(0) is None


def test_events_per_round_trip_fall_as_masters_grow():
    assert events_per_round_trip(64, 1) == 64
    assert events_per_round_trip(64, 3) == pytest.approx(21.33, abs=0.01)  # all three hold some
    assert 1.2 < events_per_round_trip(64, 120) < 1.4
    assert events_per_round_trip(1, 50) == pytest.approx(1)


COST = RoundTripCost({64: 20.0, 8: 30.0, 1: 50.0})


def test_cost_per_event_is_read_between_the_sizes_measured():
    assert COST.per_event_us(64) == 20 and COST.per_event_us(1) == 50 and COST.per_event_us(500) == 20
    assert COST.per_event_us(2) == pytest.approx(30 + 20 * (0.5 - 0.125) / (1 - 0.125))


def test_masters_needed_counts_the_fleet_s_own_round_trips():
    flat = RoundTripCost({64: 20.0, 1: 20.0})  # no cost per round trip: the plain division
    assert masters_needed(3_200_000, 25_000, 3, 64, flat) == 128
    assert masters_needed(3_200_000, 25_000, 3, 64, flat, utilization=0.5) == 256
    needed = masters_needed(3_200_000, 25_000, 3, 64, COST)
    extra_us = COST.per_event_us(events_per_round_trip(64, needed)) - COST.per_event_us(events_per_round_trip(64, 3))
    assert 20 < extra_us < 30  # the writes of ~1.3 events per round trip, against ~21 on three masters
    assert needed == math.ceil(3_200_000 * (1 / 25_000 + extra_us / 1e6))  # its own fixed point
