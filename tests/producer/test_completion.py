"""Completion.from_events: the events of one request, as they come off the wire, folded in
order into one result, per-token logprobs included (and how compact they travel)."""

import msgspec

from producer.completion import Completion
from producer.protocol import ErrorEvent, TokenEvent, TokenLogprob, TopLogprob, decode_event, encode
from tests.producer.fake_worker import done


def logprob(token_id: int, value: float) -> TokenLogprob:
    return TokenLogprob(value, f"t{token_id}", [TopLogprob(token_id, value, f"t{token_id}"), TopLogprob(0, -9.0)])


def off_the_wire(*events):
    return [decode_event(encode(event)) for event in events]


def test_logprobs_are_folded_in_order_across_events_and_attempts():
    events = off_the_wire(
        TokenEvent(seq=0, attempt=1, ids=[5, 6], text="ab", logprobs=[logprob(5, -0.1), logprob(6, -0.2)]),
        TokenEvent(seq=1, attempt=1, ids=[], text="c"),  # text held back until now: no token, no logprob
        TokenEvent(seq=2, attempt=2, ids=[7], text="d", logprobs=[logprob(7, -0.3)]),  # resumed elsewhere
        done(3, reason="length", completion_tokens=3, attempt=2))
    completion = Completion.from_events("r", events)
    assert (completion.token_ids, completion.text, completion.attempts) == ([5, 6, 7], "abcd", 2)
    assert completion.logprobs == [logprob(5, -0.1), logprob(6, -0.2), logprob(7, -0.3)]


def test_a_request_that_ends_in_an_error_keeps_the_logprobs_of_its_tokens():
    events = off_the_wire(TokenEvent(seq=0, attempt=1, ids=[5], text="a", logprobs=[logprob(5, -0.1)]),
                          ErrorEvent(seq=1, attempt=1, code="internal", message="boom"))
    completion = Completion.from_events("r", events)
    assert completion.finish_reason == "error" and completion.logprobs == [logprob(5, -0.1)]


def test_logprobs_are_absent_unless_asked_for_and_compact_when_they_are():
    def wire(logprobs):
        return msgspec.msgpack.decode(encode(TokenEvent(seq=0, attempt=1, ids=[5], text="a", logprobs=logprobs)))
    assert "logprobs" not in wire(None)
    assert wire([TokenLogprob(-0.5)])["logprobs"] == [{"logprob": -0.5}]  # logprobs=0, no tokenizer
    assert wire([logprob(5, -0.5)])["logprobs"] == [{"logprob": -0.5, "text": "t5",
                                                     "top": [[5, -0.5, "t5"], [0, -9.0, ""]]}]
    plain = off_the_wire(TokenEvent(seq=0, attempt=1, ids=[5], text="a"), done(1))
    assert Completion.from_events("r", plain).logprobs is None
