"""Text and chat prompts through the worker on the bundled SmolLM2-135M (the tiny random model
has no tokenizer): the streamed text deltas add up to the offline engine's text."""

import pytest

from producer.protocol import Message, Request
from worker.config import WorkerConfig
from worker.engine.config import EngineConfig
from worker.engine.engine import Engine
from worker.engine.models import SMOLLM2_NAME, load_model
from worker.entries import engine_prompt
from worker.service import Worker

from .conftest import assert_numbered, backlog, greedy, replay, run_until, submit, tokens_of

pytestmark = [pytest.mark.real_model, pytest.mark.usefixtures("one_thread")]


def test_text_and_chat_prompts_stream_the_offline_engines_text(redis_url, client):
    model, tokenizer = load_model(SMOLLM2_NAME)
    config = EngineConfig.from_options(SMOLLM2_NAME, num_blocks=64)
    requests = [Request(id="text", prompt="The capital of France is", params=greedy(8)),
                Request(id="chat", messages=[Message(role="user", content="Say hi.")], params=greedy(8))]
    offline = Engine(config, model=model, tokenizer=tokenizer)
    for request in requests:
        offline.add_request(request.id, **engine_prompt(request), params=request.params)
    expected = {request.id: ([], []) for request in requests}
    while offline.has_unfinished:
        for output in offline.step():
            expected[output.request_id][0].extend(output.token_ids)
            expected[output.request_id][1].append(output.text)

    worker = Worker(WorkerConfig(engine=config, redis_url=redis_url, name="real"),
                    engine=Engine(config, model=model, tokenizer=tokenizer))
    try:
        for request in requests:
            submit(client, request)
        run_until([worker], lambda: backlog(client) == 0, timeout=60)
    finally:
        worker.close()
    for request in requests:
        events = replay(client, request.id)
        assert_numbered(events)
        tokens, texts = expected[request.id]
        assert tokens_of(events) == tokens and len(tokens) == 8
        assert "".join(event.text for event in events[:-1]) == "".join(texts) != ""
