"""Pinned prefixes from Redis: published by the producer (API and CLI), applied by every worker at
its housekeeping, unpinned the same way; a pin that does not fit is logged once and tried again
when room is made; a worker's own --pin-prefix pins stay."""

import asyncio
import json

import pytest
import structlog

from producer import AsyncProducer, Producer
from producer.protocol import MAX_PROMPT_CHARS, DoneEvent, Request, decode_request, encode
from tests.worker.conftest import KEYS, greedy, offline, prompts_of, replay, run_until, submit, tokens_of
from worker.engine.models import load_model

SYSTEM = list(range(100, 148))  # three KV blocks of 16


@pytest.fixture
def producer(redis_url):
    with Producer(redis_url) as producer:
        yield producer


def cached_tokens(client, request_id: str) -> int:
    done = replay(client, request_id)[-1]
    assert isinstance(done, DoneEvent) and done.finish_reason == "length"
    return done.usage.cached_tokens


def test_a_published_pin_is_applied_kept_under_pressure_and_unpinned(make_worker, producer, client):
    worker = make_worker(engine_options={"num_blocks": 64, "max_model_len": 256})
    producer.pin("system", prompt_ids=SYSTEM + [7])
    worker.housekeeping()
    assert worker.engine.pins == {"system": SYSTEM}
    submit(client, Request(id="warm", prompt_ids=SYSTEM + [5], params=greedy(2)))
    flood = [Request(id=f"flood{i}", prompt_ids=prompt, params=greedy(2))  # 4x the pool in all
             for i, prompt in enumerate(prompts_of(16, seed=3, low=200, high=200))]
    for request in flood:
        submit(client, request)
    run_until([worker], lambda: not worker.flights and not client.xlen(KEYS.requests("normal")))
    submit(client, Request(id="later", prompt_ids=SYSTEM + [9], params=greedy(2)))
    run_until([worker], lambda: not worker.flights and not client.xlen(KEYS.requests("normal")))
    assert cached_tokens(client, "warm") == 0 and cached_tokens(client, "later") == 48
    worker.housekeeping()
    assert worker.metrics.pinned_blocks._value.get() == 3

    assert producer.unpin("system") and not producer.unpin("system")
    worker.housekeeping()
    assert worker.engine.pins == {} and worker.metrics.pinned_blocks._value.get() == 0


def test_a_pin_that_does_not_fit_is_logged_once_and_tried_again_when_room_is_made(make_worker, producer):
    worker = make_worker(engine_options={"num_blocks": 24, "max_model_len": 256})  # 8 blocks may be pinned
    producer.pin("first", prompt_ids=list(range(100, 180)))  # 5 blocks
    worker.housekeeping()
    producer.pin("second", prompt_ids=list(range(200, 280)))
    with structlog.testing.capture_logs() as logs:
        worker.housekeeping()
        worker.housekeeping()
    refused = [entry for entry in logs if entry["event"] == "pin.refused"]
    assert [entry["pin"] for entry in refused] == ["second"] and "does not fit" in refused[0]["reason"]
    assert list(worker.engine.pins) == ["first"]
    producer.unpin("first")
    worker.housekeeping()
    assert list(worker.engine.pins) == ["second"]



def test_pins_written_over_by_hand_are_logged_and_the_worker_keeps_serving(make_worker, client, model):
    worker = make_worker(engine_options={"num_blocks": 64, "max_model_len": 256})
    client.hset(KEYS.pins, b"\xff\xfe", encode(Request(prompt_ids=SYSTEM)))  # a name that is not UTF-8
    worker.housekeeping()
    assert list(worker.engine.pins.values()) == [SYSTEM]
    client.delete(KEYS.pins)
    client.set(KEYS.pins, b"not a hash")
    with structlog.testing.capture_logs() as logs:
        worker.housekeeping()
        worker.housekeeping()
        submit(client, Request(id="served", prompt_ids=[5, 6, 7], params=greedy(3)))
        run_until([worker], lambda: not worker.flights and not client.xlen(KEYS.requests("normal")))
    assert [entry["event"] for entry in logs if entry["event"].startswith(("pins.", "worker.turn"))] == ["pins.unreadable"]
    assert worker.engine.pins == {}  # the key no longer holds the pin
    assert tokens_of(replay(client, "served")) == offline(model, [[5, 6, 7]], [greedy(3)])[0]

def test_an_8_mb_pin_is_refused_by_the_prompt_bound_before_it_is_tokenized(make_worker, client, model):
    """The red team's 8 MB pin made every worker tokenize it (7 s for each victim request)."""
    worker = make_worker(engine_options={"num_blocks": 64, "max_model_len": 256})

    class NoTokenizing:
        def __getattr__(self, name):
            raise AssertionError(f"the pin reached the tokenizer ({name})")

    worker.engine.tokenizer = NoTokenizing()
    client.hset(KEYS.pins, "huge", encode(Request(prompt="secret " * 1_200_000)))
    with structlog.testing.capture_logs() as logs:
        worker.housekeeping()
    (refused,) = [entry for entry in logs if entry["event"] == "pin.refused"]
    assert refused["pin"] == "huge" and str(MAX_PROMPT_CHARS) in refused["reason"]
    worker.engine.tokenizer = None
    submit(client, Request(id="served", prompt_ids=[5, 6, 7], params=greedy(3)))
    run_until([worker], lambda: not worker.flights and not client.xlen(KEYS.requests("normal")))
    assert worker.engine.pins == {} and tokens_of(replay(client, "served")) == offline(model, [[5, 6, 7]], [greedy(3)])[0]


def test_a_pin_published_again_replaces_the_old_prefix(make_worker, producer):
    worker = make_worker()
    producer.pin("system", prompt_ids=SYSTEM)
    worker.housekeeping()
    producer.pin("system", prompt_ids=SYSTEM[:32])
    worker.housekeeping()
    assert worker.engine.pins == {"system": SYSTEM[:32]}
    assert worker.engine.pool.blocks_pinned_with([]) == 2  # the old pin's third block is free again


def test_own_pins_stay_and_a_text_pin_without_a_tokenizer_is_refused(make_worker, producer, redis_url,
                                                                     smollm2_tokenizer):
    from worker.config import WorkerConfig
    from worker.engine.config import EngineConfig
    from worker.engine.engine import Engine
    from worker.service import Worker

    text = "You are the support assistant of Example Inc. Answer briefly and politely. " * 3
    engine = Engine(EngineConfig.from_options("random:llama", num_blocks=256), model=load_model("random:llama")[0],
                    tokenizer=smollm2_tokenizer)
    worker = Worker(WorkerConfig(engine=engine.config, name="own", redis_url=redis_url, pin_prefix=[text]),
                    engine=engine)
    try:
        producer.pin("other", prompt_ids=SYSTEM)
        worker.housekeeping()
        producer.unpin("other")
        worker.housekeeping()
        own = smollm2_tokenizer.encode(text)
        assert worker.engine.pins == {"--pin-prefix:1": own[:len(own) // 16 * 16]}
    finally:
        worker.close()

    tokenless = make_worker(pin_prefix=["no tokenizer here"])
    with structlog.testing.capture_logs() as logs:
        tokenless.housekeeping()
    assert [(entry["event"], entry["reason"]) for entry in logs if entry["event"].startswith("pin.")] == \
        [("pin.refused", "this model has no tokenizer: give prompt_ids")]
    assert tokenless.engine.pins == {}


def test_the_async_producer_pins_too(redis_url):
    async def pin_and_list():
        async with AsyncProducer(redis_url) as producer:
            await producer.pin("chat", messages=[{"role": "system", "content": "Be brief."}])
            pins = await producer.pins()
            return pins, await producer.unpin("chat"), await producer.pins()

    pins, removed, after = asyncio.run(pin_and_list())
    assert [message.content for message in pins["chat"].messages] == ["Be brief."]
    assert removed and after == {}


def test_the_cli_pins_lists_and_unpins(cli, client):
    assert cli("pin", "ids", "--ids", "1,2,3")[0] == 0
    assert cli("pin", "support", "--system", "You are a support agent.")[0] == 0
    assert cli("pin", "text", "--text", "Translate to French:")[0] == 0
    assert cli("pin", "few-shot", "--messages", '[{"role": "system", "content": "Be brief."}, '
                                                '{"role": "user", "content": "Hi"}]')[0] == 0
    stored = {name.decode(): decode_request(value) for name, value in client.hgetall(KEYS.pins).items()}
    assert stored["ids"].prompt_ids == [1, 2, 3] and stored["text"].prompt == "Translate to French:"
    assert [(m.role, m.content) for m in stored["support"].messages] == [("system", "You are a support agent.")]
    assert [m.role for m in stored["few-shot"].messages] == ["system", "user"]

    status, out, _ = cli("pins", "--json")
    assert status == 0 and json.loads(out)["ids"] == {"prompt_ids": [1, 2, 3]}
    status, out, _ = cli("pins")
    assert status == 0 and "support" in out and "3 token ids" in out and "Translate to French:" in out

    assert cli("unpin", "ids")[:2] == (0, "")
    status, _, err = cli("unpin", "ids")
    assert status == 1 and "no prefix named ids is pinned" in err
    status, _, err = cli("pin", "bad name", "--text", "x")
    assert status == 1 and "request id must match" in err
    assert sorted(json.loads(cli("pins", "--json")[1])) == ["few-shot", "support", "text"]
