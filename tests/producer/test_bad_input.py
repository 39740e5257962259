"""Bad input gets a clear error: what passes the type and range checks but cannot go on the wire
(an int beyond msgpack's 64 bits, text with a lone surrogate) is refused with InvalidRequest,
naming the field, before the id is claimed: nothing of it is left in Redis. Each case runs
through both clients."""

import asyncio
import re

import msgspec
import pytest
import redis

from producer import AsyncProducer, InvalidRequest, Producer, Request, SamplingParams
from producer.core import ProducerCore, Steps
from producer.protocol import Keys
from producer.submission import build_request

KEYS = Keys("sb")
CLIENTS = pytest.mark.parametrize("client", ["sync", "async"])
HUGE = 2**64  # one past what a msgpack integer holds

CASES = pytest.mark.parametrize("submit, field, problem", [
    ({"prompt_ids": [1], "params": {"top_k": HUGE}}, "params.top_k", f"{HUGE} is out of range"),
    ({"prompt_ids": [1], "params": {"stop_token_ids": [3, HUGE]}}, "params.stop_token_ids[1]",
     f"{HUGE} is out of range"),
    ({"prompt_ids": [1, HUGE]}, "prompt_ids[1]", f"{HUGE} is out of range"),
    ({"prompt": "ok \ud800"}, "prompt", "not valid UTF-8"),
    ({"messages": [{"role": "system", "content": "x"}, {"role": "user", "content": "\udcff"}]},
     "messages[1].content", "not valid UTF-8"),
    ({"prompt_ids": [1], "params": {"stop": ["fine", "\ud800"]}}, "params.stop[1]", "not valid UTF-8"),
], ids=["top_k", "stop_token_ids", "prompt_ids", "prompt", "message", "stop"])


def call(client: str, url: str, method: str, *args, **kwargs):
    if client == "sync":
        with Producer(url) as producer:
            return getattr(producer, method)(*args, **kwargs)

    async def run():
        async with AsyncProducer(url) as producer:
            return await getattr(producer, method)(*args, **kwargs)

    return asyncio.run(run())


def nothing_in_redis(url: str) -> bool:
    return redis.Redis.from_url(url).keys("*") == []


@CLIENTS
@CASES
def test_unencodable_input_is_refused_before_the_id_is_claimed(client, redis_url, submit, field, problem):
    with pytest.raises(InvalidRequest) as refused:
        call(client, redis_url, "submit", request_id="bad-1", **submit)
    assert str(refused.value).startswith(f"invalid request: {field}: {problem}")
    if problem == "not valid UTF-8":  # the surrogate is shown escaped: the message itself prints anywhere
        str(refused.value).encode()
        assert "'\\ud" in str(refused.value)
    assert nothing_in_redis(redis_url)  # no claim ("enqueuing" for 10 s), no stream, no group


@CLIENTS
@pytest.mark.parametrize("pin, field", [
    ({"prompt_ids": [HUGE]}, "prompt_ids[0]"),
    ({"prompt": "\ud800"}, "prompt"),
    ({"messages": [{"role": "system", "content": "\ud800"}]}, "messages[0].content"),
])
def test_an_unencodable_pin_is_refused_before_redis(client, redis_url, pin, field):
    with pytest.raises(InvalidRequest, match="invalid request: " + re.escape(field) + ": "):
        call(client, redis_url, "pin", "bad-pin", **pin)
    assert nothing_in_redis(redis_url)


def test_a_ready_request_that_cannot_be_encoded_is_refused():
    with pytest.raises(InvalidRequest, match=r"invalid request: prompt_ids\[0\]: 18446744073709551616 is out of range"):
        build_request(Request(prompt_ids=[HUGE]))
    with pytest.raises(InvalidRequest, match=r"invalid request: params.top_k: 2\*\*199\+ is out of range"):
        build_request(prompt_ids=[1], params={"top_k": 2**199})  # not its 60 digits
    with pytest.raises(InvalidRequest, match=r"invalid request: prompt: not valid UTF-8 text"):
        build_request(Request(prompt="\udcff"))


def test_the_core_refuses_an_unencodable_request_before_its_first_redis_call():
    """A Request that skipped build_request (msgspec.convert runs the same type checks)."""
    request = msgspec.convert({"id": "core-1", "prompt_ids": [HUGE]}, Request)
    core = ProducerCore(KEYS, max_backlog=10, claim_ttl=60, poll_interval=1.0)
    for flow in (core.submit(request), core.pin(request)):
        with pytest.raises(InvalidRequest, match=r"prompt_ids\[0\]"):
            Steps(flow).next()  # raises at once: no operation was asked for


@CLIENTS
@pytest.mark.parametrize("submit, problem", [
    ({"prompt_ids": [7] * (2**20 + 1)}, "prompt_ids: expected `array` of length <= 1048576"),
    ({"prompt": "a" * (2**20 + 1)}, "prompt: expected `str` of length <= 1048576"),
    ({"messages": [{"role": "user", "content": "hi"}] * 2049}, "messages: expected `array` of length <= 2048"),
    ({"prompt_ids": [1], "params": {"stop": ["x" * 257]}}, "params.stop[0]: expected `str` of length <= 256"),
    ({"prompt_ids": [1], "params": {"stop_token_ids": [1] * 65}}, "params.stop_token_ids: expected `array` of length"),
    ({"prompt_ids": [1], "params": {"max_tokens": 2**20 + 1}}, "max_tokens must be in [1, 1048576]"),
    ({"messages": [{"role": "user", "content": "a" * 2**19}] * 3}, "characters of content in all"),
], ids=["prompt_ids", "prompt", "messages", "stop", "stop_token_ids", "max_tokens", "conversation"])
def test_input_past_the_protocols_bounds_is_refused_before_redis(client, redis_url, submit, problem):
    with pytest.raises(InvalidRequest, match=re.escape(problem)):
        call(client, redis_url, "submit", request_id="big-1", **submit)
    assert nothing_in_redis(redis_url)


def test_a_ready_request_past_the_bounds_is_refused_as_the_worker_would():
    """Built directly, a Request skips the decoder's length checks; the producer decodes what it
    would send, so it refuses what the worker would."""
    with pytest.raises(InvalidRequest, match=re.escape("params.stop[0]: expected `str` of length <= 256")):
        build_request(Request(prompt_ids=[1], params=SamplingParams(stop=["x" * 257])))
    with pytest.raises(InvalidRequest, match=re.escape("params.stop[0]: expected `str` of length <= 256")):
        build_request(prompt_ids=[1], params=SamplingParams(stop=["x" * 257]))
