"""What one entry may carry (protocol.py's MAX_* bounds), as a worker meets it: an entry past
them is refused before it is decoded, or as it is, and dead-lettered with a bounded copy; the
red team's oversize entries stalled the loop for seconds and filled Redis with their copies."""

import msgspec
import pytest

from producer.protocol import FIELD, MAX_ENTRY_BYTES, MAX_MESSAGES, MAX_PROMPT_CHARS, ErrorEvent, Request
from worker.intake import DEAD_LETTER_ENTRY_BYTES

from .conftest import KEYS, backlog, greedy, offline, replay, run_until, submit, tokens_of

pack = msgspec.msgpack.encode

OVERSIZE = {
    "entry past MAX_ENTRY_BYTES": ({"id": "huge", "prompt_ids": [7] * MAX_ENTRY_BYTES}, "bytes, more than"),
    "prompt past MAX_PROMPT_CHARS": ({"id": "long", "prompt": "a" * (MAX_PROMPT_CHARS + 1)}, "of length <="),
    "100,000 messages": ({"id": "chatty", "messages": [{"role": "user", "content": "hi"}] * 100_000},
                         f"of length <= {MAX_MESSAGES}"),
    "a stop string of 300 characters": ({"id": "stops", "prompt_ids": [5], "params": {"stop": ["x" * 300]}},
                                        "of length <= 256"),
    "messages past MAX_PROMPT_CHARS together": (
        {"id": "wide", "messages": [{"role": "user", "content": "a" * (MAX_PROMPT_CHARS // 2 + 1)}] * 2},
        "characters of content in all"),
}


@pytest.mark.parametrize("name", OVERSIZE)
def test_an_oversize_entry_gets_an_error_event_and_a_bounded_dead_letter(make_worker, client, model, name):
    worker = make_worker()
    fields, reason = OVERSIZE[name]
    data = pack(fields)
    entry_id = client.xadd(KEYS.requests("normal"), {FIELD: data}).decode()
    submit(client, Request(id="good", prompt_ids=[5, 6, 7], params=greedy(4)))
    run_until([worker], lambda: backlog(client) == 0)
    [(_, letter)] = client.xrange(KEYS.dead_letters)
    assert letter[b"entry_id"].decode() == entry_id and reason in letter[b"reason"].decode()
    assert letter[b"entry"] == data[:DEAD_LETTER_ENTRY_BYTES] and int(letter[b"entry_bytes"]) == len(data)
    [event] = replay(client, fields["id"])
    assert isinstance(event, ErrorEvent) and event.code == "invalid_request" and reason in event.message
    assert tokens_of(replay(client, "good")) == offline(model, [[5, 6, 7]], [greedy(4)])[0]
