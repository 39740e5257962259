"""What the producer decides before touching Redis: validation and the lane estimate."""

import pytest

from producer import InvalidRequest, Request
from producer.submission import build_request, choose_lane, estimate_prompt_tokens


def test_the_estimate_is_exact_for_ids_and_generous_for_text():
    assert estimate_prompt_tokens(build_request(prompt_ids=[5] * 300)) == 300
    assert estimate_prompt_tokens(build_request("héllo")) == 2  # 6 UTF-8 bytes / 3
    chat = build_request(messages=[{"role": "system", "content": "abc"}, {"role": "user", "content": "abcd"}])
    assert estimate_prompt_tokens(chat) == (8 + 1) + (8 + 2)


@pytest.mark.parametrize("prompt_bytes, max_tokens, lane, expected", [
    (768, 128, None, "fast"),  # 256 estimated tokens: the rule's limit
    (769, 128, None, "normal"),
    (30, 129, None, "normal"),
    (30, 16, "normal", "normal"),  # asking for normal is always granted
    (3000, 16, "fast", "normal"),  # a claim of fast that breaks the rule is demoted
])
def test_lane_choice(prompt_bytes, max_tokens, lane, expected):
    request = build_request("x" * prompt_bytes, params={"max_tokens": max_tokens}, lane=lane)
    assert choose_lane(request) == expected
    assert request.lane == lane  # the caller's choice travels as given, for the worker's rule


def test_a_ready_request_comes_alone():
    with pytest.raises(InvalidRequest, match=r"pass a ready Request alone, not with \['lane'\]"):
        build_request(Request(prompt="x"), lane="fast")
