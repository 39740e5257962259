"""EventSequencer: in order, each once, whatever mix of replays, duplicates and reorderings
the two sources deliver."""

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from producer.errors import EventsLost
from producer.sequencer import EventSequencer
from tests.producer.fake_worker import done, error, token


def events_of(n: int, terminal=done):
    """n token events, then the terminal one (seq n)."""
    return [token(seq, f"t{seq} ") for seq in range(n)] + [terminal(n)]


def feed(sequencer, deliveries):
    return [released for event in deliveries for released in sequencer.push(event)]


def test_every_ordering_of_a_small_stream_with_duplicates_comes_out_in_order_once():
    events = events_of(3)
    deliveries = events + [events[1], events[3]]  # two duplicates, one of them terminal
    orderings = {tuple(e.seq for e in ordering): ordering for ordering in itertools.permutations(deliveries)}
    assert len(orderings) == 720 // 4  # 6 deliveries, two seqs twice: every distinct ordering
    for ordering in orderings.values():
        sequencer = EventSequencer()
        assert feed(sequencer, ordering) == events
        assert sequencer.finished and not sequencer.has_gap


@given(st.integers(0, 12).flatmap(lambda n: st.tuples(
    st.just(n), st.lists(st.integers(0, n), min_size=0, max_size=3 * (n + 1)), st.randoms())))
def test_any_delivery_releases_the_longest_complete_prefix_exactly_once(case):
    n, extra, rng = case
    events = events_of(n)
    deliveries = events + [events[i] for i in extra]
    rng.shuffle(deliveries)
    missing = rng.choice([None, rng.randrange(n + 1)])  # maybe one event never arrives
    if missing is not None:
        deliveries = [event for event in deliveries if event.seq != missing]
    sequencer = EventSequencer()
    released = feed(sequencer, deliveries)
    expected = events if missing is None else events[:missing]
    assert released == expected
    assert sequencer.finished == (missing is None)
    assert sequencer.has_gap == (missing is not None and missing < n)  # later seqs held back


def test_first_copy_of_a_seq_wins_and_nothing_follows_a_terminal_event():
    sequencer = EventSequencer()
    first, stale = token(0, "a", attempt=1), token(0, "b", attempt=2)
    assert sequencer.push(first) == [first]
    assert sequencer.push(stale) == []
    assert sequencer.push(error(1)) == [error(1)]
    assert sequencer.push(token(2, "late")) == []
    assert sequencer.finished
    held = EventSequencer()
    early, early_again = token(1, "b", attempt=1), token(1, "B", attempt=2)
    assert held.push(early) == [] and held.push(early_again) == []
    assert held.push(token(0, "a"))[1] is early  # held back or not, the first copy is the one


def test_nothing_after_the_terminal_event_is_released_or_held():
    """The two terminal guards: an event past the terminal that arrives after it, and one that
    arrived early and is held when the terminal comes."""
    late = EventSequencer()
    late.push(token(0, "a"))
    assert late.push(error(1)) == [error(1)]
    assert late.push(token(2, "late")) == [] and not late.has_gap  # not held either: nothing is awaited
    early = EventSequencer()
    assert early.push(token(2, "early")) == [] and early.push(token(0, "a")) == [token(0, "a")]
    assert early.push(error(1)) == [error(1)]  # the early seq 2 stays unreleased
    assert early.finished and not early.has_gap


def test_held_back_events_are_released_when_the_gap_fills():
    sequencer = EventSequencer()
    assert sequencer.push(token(1, "b")) == [] and sequencer.has_gap
    assert sequencer.push(token(2, "c")) == []
    assert [e.seq for e in sequencer.push(token(0, "a"))] == [0, 1, 2]
    assert not sequencer.has_gap and sequencer.next_seq == 3


def test_a_replay_read_with_duplicates_fills_a_gap_left_by_the_channel():
    sequencer = EventSequencer()
    events = events_of(4)
    assert sequencer.push(events[0]) == [events[0]]
    assert sequencer.push(events[3]) == []  # 1 and 2 were not published to us
    assert sequencer.push_replayed(events[:4]) == events[1:4]
    assert sequencer.push_replayed(events) == [events[4]]
    assert sequencer.finished


@pytest.mark.parametrize("replayed, lost", [([2, 3], "0..1"), ([0, 2], "1..1")])
def test_a_hole_in_the_replay_stream_is_reported_not_waited_for(replayed, lost):
    sequencer = EventSequencer("req-1")
    with pytest.raises(EventsLost, match=f"events {lost} of request req-1"):
        sequencer.push_replayed([token(seq, "x") for seq in replayed])


def test_a_replay_read_ahead_of_the_channel_is_not_a_hole():
    sequencer = EventSequencer()
    assert [e.seq for e in sequencer.push_replayed([token(0, "a"), token(1, "b")])] == [0, 1]
    assert sequencer.push_replayed([]) == []
    assert sequencer.push(token(1, "b")) == [] and not sequencer.has_gap
