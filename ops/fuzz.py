"""Fuzz campaign: hostile lane-stream entries against a live worker and a real Redis.

    python -m ops.fuzz [--entries 10000] [--seed 0]

Starts a private redis-server (ops/demo.py's redis_at) and one worker on the tiny random model
(random:llama: no tokenizer, so text prompts are refused too), registers a second and a third
tenant, and XADDs the entries raw to the lane streams of all three, as any holder of a tenant's
producer role could. Hypothesis draws them (seeded: the same seed makes the same entries):
good requests (greedy, a few tokens, some with extra junk fields or another tenant's id), valid
requests with extreme parameters (up to the model's length), requests reusing the id of an
earlier one of their tenant, and bad entries: each a valid request with one defect (an id aimed
at other keys, too long or of a wrong type, a NaN or infinite number, a value out of range, a
wrong protocol version, token ids outside the vocabulary, a field of a wrong type, unknown or
missing, invalid UTF-8, deep nesting, a field past protocol.py's MAX_* bounds, a whole entry of
megabytes, a prompt past the model's limits), or raw bytes (garbage, truncated, trailing bytes,
no `m` field), many with another tenant's id. The worker is turned in a plain loop as the
entries go in, a few dozen ahead of it.

Then every check, each failure a line in the report's problems: no failed turn, crash or wedge,
the worker alive and ready, a canary request per tenant served after the campaign; every bad
entry dead-lettered once, with its tenant, its usable id (or none), a reason naming its defect
and a bounded copy of it; an error event (seq 0, invalid_request or too_long) in that id's replay stream of
that tenant, and nothing else there; a reused id refused as a duplicate (or acked as a repeat
once its original finished), never run; every good request's tokens those of the offline engine,
its events numbered from 0, once each, in order; no key in Redis but those the entries' own ids
and tenants account for (so no entry wrote into another tenant's keys or another request's
stream); lane streams empty with nothing pending; no error in the worker's log. Prints the counts
and exits 1 on any problem.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import re
import string
import tempfile
import time
import traceback
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import redis
import structlog
import torch
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ops.demo import redis_at
from ops.tool import ToolError, run_tool
from producer.protocol import (DEFAULT_TENANT, FIELD, GROUP, LANES, MAX_ENTRY_BYTES, MAX_MESSAGES, MAX_PROMPT_CHARS,
                               MAX_PROMPT_IDS, MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, MAX_TOKENS,
                               PROTOCOL_VERSION, REQUEST_ID, DoneEvent, ErrorEvent, Keys, Lane, SamplingParams, Tenant,
                               TokenEvent, decode_event)
from worker.config import WorkerConfig
from worker.engine.config import EngineConfig
from worker.engine.engine import Engine
from worker.engine.models import load_model
from worker.intake import DEAD_LETTER_ENTRY_BYTES
from worker.service import Worker

MODEL, NUM_BLOCKS = "random:llama", 256
TENANTS = (DEFAULT_TENANT, "team-a", "team-b")
KEYS = Keys("sb")
AHEAD = 32  # entries XADDed at a time, whenever fewer than half as many wait
WEDGE_S = 30.0  # no entry acked for this long while some wait: the worker is wedged
CANARY = "canary"  # the id of the good request sent to each tenant after the campaign
SHOWN_PROBLEMS = 20


# --- entries ---------------------------------------------------------------------------
class Repeat:
    """`item` repeated `times` (a str or bytes, else a list), built only as the entry is encoded:
    a megabyte entry costs no memory while it waits its turn."""

    __slots__ = ("item", "times")

    def __init__(self, item: Any, times: int) -> None:
        self.item, self.times = item, times


def _built(value: Any) -> Any:
    if isinstance(value, Repeat):
        return value.item * value.times if isinstance(value.item, (str, bytes)) else [value.item] * value.times
    raise NotImplementedError(type(value))


class _UsableId:
    """Where a request document's id goes once the entry is given one (FuzzEntry.request_id)."""


USABLE_ID = _UsableId()


@dataclass(frozen=True)
class FuzzEntry:
    """One entry of the campaign and what the worker must make of it. `body` is a request document
    (a dict that may hold msgspec.Raw, Repeat and USABLE_ID), or the payload's bytes as they go."""

    kind: str
    body: Any
    reason: str | None = None  # a bad entry's: what its dead letter's reason must contain; None: served
    served: str | None = None  # "good" (tokens checked against the offline engine) or "extreme" (any completion)
    prompt_ids: list[int] | None = None
    params: SamplingParams | None = None
    extra_fields: dict[bytes, bytes] = field(default_factory=dict)  # stream entry fields besides FIELD
    has_field: bool = True  # False: the entry has no FIELD at all
    id_stem: str = "bad"  # of its own id, when it has a usable one
    borrow: bool = False  # take another tenant's good request's id (an attack aimed at it, or a twin there)
    duplicate: bool = False  # a request under the id of an earlier good request, in its tenant and stream
    tenant: str = DEFAULT_TENANT
    lane: Lane = "normal"
    request_id: str | None = None  # what the worker must answer to; None when the entry has no usable id

    @property
    def usable(self) -> bool:
        return isinstance(self.body, dict) and self.body.get("id") is USABLE_ID

    @property
    def keys(self) -> Keys:
        return KEYS.of(self.tenant)

    def payload(self) -> bytes:
        if isinstance(self.body, bytes):
            return self.body
        document = {name: self.request_id if value is USABLE_ID else value for name, value in self.body.items()}
        return msgspec.msgpack.encode(document, enc_hook=_built)

    def fields(self) -> dict[bytes, bytes]:
        return ({FIELD: self.payload()} if self.has_field else {}) | self.extra_fields


@dataclass(frozen=True)
class Limits:
    """What the worker's model takes, which decides where token ids and lengths go wrong."""

    vocab_size: int
    max_model_len: int

    @classmethod
    def of(cls, engine: Engine) -> Limits:
        return cls(engine.info.vocab_size, engine.max_model_len)


# --- strategies ------------------------------------------------------------------------
NAN, INF = float("nan"), float("inf")
ID_TEXT = st.text(string.ascii_letters + string.digits + "_-", min_size=1, max_size=40)
# Ids that end up inside key names when not refused: other tenants' keys and hash tags, patterns.
AIMED_IDS = ["team-a}:out", "{team-b.fast.0}", "*", "sb:t:team-a:{good-1}:out", "good-1}:attempt", "}{", "?",
             "default:{x}", "x}:tok", "../team-b", "sb:dead", "sb:tenants", "a b", "a\nb", "a\x00b", "é"]
INT64, UINT64 = (-2**63, 2**63 - 1), (0, 2**64 - 1)
FLOAT_PARAMS = ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")
SCALARS = (st.none() | st.booleans() | st.integers(INT64[0], UINT64[1]) | st.floats() | st.text(max_size=12)
           | st.binary(max_size=12))
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                      | st.dictionaries(st.text(max_size=6), inner, max_size=3), max_leaves=8)
TYPE_NAMES = {type(None): "None", bool: "bool", int: "int", float: "float", str: "str", bytes: "bytes",
              list: "array", dict: "object"}
# Where a value of a wrong type goes, and the msgpack types msgspec takes there.
TYPED = {"prompt": {"str", "None"}, "prompt_ids": {"array", "None"}, "prompt_ids[0]": {"int"},
         "messages": {"array", "None"}, "messages[0]": {"object"}, "messages[0].role": {"str"},
         "messages[0].content": {"str"}, "params": {"object"}, "params.max_tokens": {"int"},
         "params.temperature": {"int", "float"}, "params.top_k": {"int"}, "params.seed": {"int", "None"},
         "params.stop": {"array"}, "params.stop[0]": {"str"}, "params.stop_token_ids": {"array"},
         "params.ignore_eos": {"bool"}, "params.logprobs": {"int", "None"}, "lane": {"str", "None"},
         "deadline": {"int", "float", "None"}, "submitted_at": {"int", "float"}, "v": {"int"}}
FIELDS_OF = {"": {"id", "prompt", "messages", "prompt_ids", "params", "lane", "deadline", "submitted_at", "v"},
             "params": {field.name for field in msgspec.structs.fields(SamplingParams)},
             "messages[0]": {"role", "content"}}
FAR_FUTURE, PAST = 4e9, 1e9  # deadlines in 2096 and 2001


def below(limit: float) -> st.SearchStrategy[float]:
    return st.floats(max_value=limit, exclude_max=True, allow_nan=False, allow_infinity=False)


def above(limit: float) -> st.SearchStrategy[float]:
    return st.floats(min_value=limit, exclude_min=True, allow_nan=False, allow_infinity=False)


OUT_OF_RANGE = [  # (path, values past its range, what the refusal says)
    ("params.max_tokens", st.integers(INT64[0], 0) | st.integers(MAX_TOKENS + 1, UINT64[1]), "max_tokens must be in"),
    ("params.temperature", below(0) | above(100), "temperature must be in"),
    ("params.top_k", st.integers(INT64[0], -1), "top_k must be >= 0"),
    ("params.top_p", below(0) | st.just(0.0) | above(1), "top_p must be in"),
    ("params.min_p", below(0) | above(1), "min_p must be in"),
    ("params.repetition_penalty", below(0) | st.just(0.0) | above(10), "repetition_penalty must be in"),
    ("params.presence_penalty", below(-2) | above(2), "presence_penalty must be in"),
    ("params.frequency_penalty", below(-2) | above(2), "frequency_penalty must be in"),
    ("params.seed", st.integers(INT64[0], -1) | st.integers(2**63, UINT64[1]), "seed must be in"),
    ("params.logprobs", st.integers(INT64[0], -1) | st.integers(21, UINT64[1]), "logprobs must be in"),
    ("params.stop_token_ids", st.lists(st.integers(INT64[0], -1), min_size=1, max_size=4),
     "stop_token_ids must be >= 0"),
    ("params.stop", st.just([""]), "stop strings must be non-empty"),
]
NON_FINITE = [*((f"params.{name}", f"{name} must be in") for name in FLOAT_PARAMS),
              ("deadline", "deadline must be a finite"), ("submitted_at", "submitted_at must be a finite")]


def put(document: dict, path: str, value: Any) -> dict:
    """`document` with `value` at `path` ("params.stop[0]", "messages[0].role"), copied on the way."""
    head, _, rest = path.partition(".")
    name, _, index = head.partition("[")
    copy = dict(document)
    if not index:
        copy[name] = put(copy[name], rest, value) if rest else value
        return copy
    items, i = list(copy[name]), int(index.rstrip("]"))
    items[i] = put(items[i], rest, value) if rest else value
    copy[name] = items
    return copy


def get(document: dict, path: str) -> Any:
    for part in filter(None, path.split(".")):
        name, _, index = part.partition("[")
        document = document[name] if not index else document[name][int(index.rstrip("]"))]
    return document


def invalid_utf8(text: str, broken: bytes) -> msgspec.Raw:
    """A msgpack str whose bytes are `text` with a sequence that is not UTF-8 in the middle."""
    data = text[:len(text) // 2].encode() + broken + text[len(text) // 2:].encode()
    header = bytes([0xa0 | len(data)]) if len(data) < 32 else bytes([0xd9, len(data)])
    return msgspec.Raw(header + data)


def nested(depth: int, maps: bool) -> bytes:
    """`depth` arrays (or maps {"a": ...}) one inside the other, around a 1, as msgpack."""
    return (b"\x81\xa1a" if maps else b"\x91") * depth + b"\x01"


SHALLOW, DEEP = st.integers(1, 100), st.integers(10_000, 200_000)  # nesting the worker reads an id past, or not


@st.composite
def shuffled(draw, document: dict) -> dict:
    """The same fields in another order: a decoder must not depend on the id coming first."""
    return dict(draw(st.permutations(list(document.items()))))


def token_ids(limits: Limits, max_size: int = 40) -> st.SearchStrategy[list[int]]:
    return st.lists(st.integers(2, limits.vocab_size - 1), min_size=1, max_size=max_size)


@st.composite
def base_document(draw, limits: Limits, shape: str = "prompt_ids") -> dict:
    """A valid request document (the id still to come), with a stop string and a message to aim at."""
    prompt = ({"prompt_ids": draw(token_ids(limits, 8))} if shape == "prompt_ids" else
              {"messages": [{"role": "user", "content": draw(st.text(max_size=20))}]})
    return {"id": USABLE_ID, **prompt, "params": {"max_tokens": draw(st.integers(1, 4)), "temperature": 0.0,
                                                  "stop": ["x"]}}


def bad(draw, kind: str, document: Any, reason: str) -> FuzzEntry:
    """A bad entry; its own id, if it has a usable one, begins with a drawn stem, or it borrows one."""
    return FuzzEntry(kind, document, reason=reason, id_stem=draw(ID_TEXT), borrow=draw(st.booleans()))


@st.composite
def good(draw, limits: Limits) -> FuzzEntry:
    prompt = draw(token_ids(limits))
    params = SamplingParams(max_tokens=draw(st.integers(1, 6)), temperature=0.0, ignore_eos=True,
                            logprobs=draw(st.none() | st.integers(0, 5)),
                            seed=draw(st.none() | st.integers(0, INT64[1])))
    optional = draw(st.fixed_dictionaries({}, optional={
        "lane": st.sampled_from(LANES), "v": st.just(PROTOCOL_VERSION), "deadline": st.floats(FAR_FUTURE, 1e12),
        "submitted_at": st.floats(allow_nan=False, allow_infinity=False)}))
    junk = draw(st.dictionaries(st.binary(min_size=1, max_size=8).filter(lambda name: name != FIELD),
                                st.binary(max_size=16), max_size=2))
    document = draw(shuffled({"id": USABLE_ID, "prompt_ids": prompt, "params": msgspec.to_builtins(params),
                              **optional}))
    return FuzzEntry("good request", document, served="good", prompt_ids=prompt, params=params, extra_fields=junk,
                     id_stem="good", borrow=draw(st.booleans()))


@st.composite
def duplicate(draw, limits: Limits) -> FuzzEntry:
    """Refused as a duplicate while its original is in flight, acked as a repeat once that finished;
    never run under the original's id (a hijack)."""
    return dataclasses.replace(draw(good(limits)), kind="duplicate id, same tenant", served=None, reason="duplicate",
                               duplicate=True)


@st.composite
def extreme(draw, limits: Limits) -> FuzzEntry:
    """Valid, but at the edges of every range (prompts up to the model's length too): served, whatever
    tokens it gets."""
    params = SamplingParams(
        max_tokens=draw(st.integers(1, 8)), temperature=draw(st.floats(0, 100)), top_k=draw(st.integers(0, INT64[1])),
        top_p=draw(st.floats(0, 1, exclude_min=True)), min_p=draw(st.floats(0, 1)),
        repetition_penalty=draw(st.floats(0, 10, exclude_min=True)), presence_penalty=draw(st.floats(-2, 2)),
        frequency_penalty=draw(st.floats(-2, 2)), seed=draw(st.none() | st.integers(0, INT64[1])),
        stop=draw(st.lists(st.text(min_size=1, max_size=MAX_STOP_CHARS // 8), max_size=MAX_STOP_STRINGS)),
        stop_token_ids=draw(st.lists(st.integers(*UINT64), max_size=MAX_STOP_TOKEN_IDS)),
        ignore_eos=draw(st.booleans()), logprobs=draw(st.none() | st.integers(0, 20)))
    deadline = draw(st.none() | st.floats(0, PAST) | st.floats(FAR_FUTURE, 1e300))
    length, pattern = draw(st.integers(1, limits.max_model_len - params.max_tokens)), draw(token_ids(limits))
    prompt = (pattern * length)[:length]  # drawn token by token, long prompts would overrun hypothesis's buffer
    document = {"id": USABLE_ID, "prompt_ids": prompt, "params": msgspec.to_builtins(params),
                "lane": draw(st.none() | st.sampled_from(LANES)), "deadline": deadline}
    return FuzzEntry("valid, extreme params", draw(shuffled(document)), served="extreme", params=params)


@st.composite
def bad_id(draw, limits: Limits) -> FuzzEntry:
    request_id = draw(st.one_of(
        st.builds(lambda head, char, tail: head + char + tail, ID_TEXT, st.sampled_from(":{}*/ \n.%?é\x00"), ID_TEXT),
        st.just(""), st.integers(65, 5000).map(lambda length: "a" * length), st.sampled_from(AIMED_IDS),
        st.text(max_size=30).filter(lambda text: not REQUEST_ID.fullmatch(text))))
    document = draw(base_document(limits)) | {"id": request_id}
    return bad(draw, "id refused by its pattern", document, "request id must match")


@st.composite
def id_of_wrong_type(draw, limits: Limits) -> FuzzEntry:
    value = draw(VALUES.filter(lambda value: not isinstance(value, str)))
    return bad(draw, "id of a wrong type", draw(base_document(limits)) | {"id": value},
               f"got `{TYPE_NAMES[type(value)]}` - at `$.id`")


@st.composite
def non_finite(draw, limits: Limits) -> FuzzEntry:
    path, reason = draw(st.sampled_from(NON_FINITE))
    document = put(draw(base_document(limits)), path, draw(st.sampled_from([NAN, INF, -INF])))
    return bad(draw, "NaN or infinite number", draw(shuffled(document)), reason)


@st.composite
def out_of_range(draw, limits: Limits) -> FuzzEntry:
    path, values, reason = draw(st.sampled_from(OUT_OF_RANGE))
    document = put(draw(base_document(limits)), path, draw(values))
    return bad(draw, "number out of range", draw(shuffled(document)), reason)


@st.composite
def wrong_version(draw, limits: Limits) -> FuzzEntry:
    version = draw(st.integers(INT64[0], UINT64[1]).filter(lambda v: v != PROTOCOL_VERSION))
    return bad(draw, "wrong protocol version", draw(shuffled(draw(base_document(limits)) | {"v": version})),
               f"unsupported protocol version {version}")


@st.composite
def outside_vocabulary(draw, limits: Limits) -> FuzzEntry:
    document = draw(base_document(limits))
    prompt, negative = list(document["prompt_ids"]), draw(st.booleans())
    at = draw(st.integers(0, len(prompt) - 1))
    prompt[at] = draw(st.integers(INT64[0], -1) if negative else st.integers(limits.vocab_size, UINT64[1]))
    reason = "prompt_ids must be non-negative token ids" if negative else f"prompt_ids[{at}] = {prompt[at]} is outside"
    return bad(draw, "token id outside the vocabulary", document | {"prompt_ids": prompt}, reason)


@st.composite
def wrong_type(draw, limits: Limits) -> FuzzEntry:
    path, accepted = draw(st.sampled_from(sorted(TYPED.items())))
    value = draw(VALUES.filter(lambda value: TYPE_NAMES[type(value)] not in accepted))
    document = put(draw(base_document(limits, "messages" if path.startswith("messages") else "prompt_ids")),
                   path, value)
    return bad(draw, "field of a wrong type", document, f"got `{TYPE_NAMES[type(value)]}` - at `$.{path}`")


@st.composite
def unknown_field(draw, limits: Limits) -> FuzzEntry:
    where = draw(st.sampled_from(sorted(FIELDS_OF)))
    name = draw(st.text(min_size=1, max_size=16).filter(lambda name: name not in FIELDS_OF[where]))
    document = draw(base_document(limits, "messages" if where.startswith("messages") else "prompt_ids"))
    document = put(document, where, get(document, where) | {name: draw(VALUES)}) if where else \
        document | {name: draw(VALUES)}
    return bad(draw, "unknown field", document, f"unknown field `{name}`")


@st.composite
def not_a_choice(draw, limits: Limits) -> FuzzEntry:
    path = draw(st.sampled_from(["lane", "messages[0].role"]))
    value = draw(st.text(max_size=12).filter(lambda text: text not in {*LANES, "system", "user", "assistant", "tool"}))
    document = draw(base_document(limits, "messages" if path.startswith("messages") else "prompt_ids"))
    document = put(document, path, value)
    return bad(draw, "not one of the choices", document, f"Invalid enum value {value!r}")


@st.composite
def missing_field(draw, limits: Limits) -> FuzzEntry:
    name = draw(st.sampled_from(["role", "content"]))
    document = draw(base_document(limits, "messages"))
    message = {key: value for key, value in document["messages"][0].items() if key != name}
    return bad(draw, "missing field", document | {"messages": [message]}, f"missing required field `{name}`")


@st.composite
def not_one_prompt(draw, limits: Limits) -> FuzzEntry:
    chosen = draw(st.sampled_from([(), ("prompt", "prompt_ids"), ("messages", "prompt_ids"),
                                   ("prompt", "messages", "prompt_ids")]))
    prompts = {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "prompt_ids": [5]}
    document = {"id": USABLE_ID, **{name: prompts[name] for name in chosen}}
    return bad(draw, "not exactly one prompt", draw(shuffled(document)), "give exactly one of")


@st.composite
def not_utf8(draw, limits: Limits) -> FuzzEntry:
    path = draw(st.sampled_from(["id", "prompt", "messages[0].content", "messages[0].role", "params.stop[0]", "lane"]))
    broken = draw(st.sampled_from([b"\x80", b"\xff", b"\xc0\x80", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xe2\x82"]))
    text = invalid_utf8(draw(st.text(string.ascii_letters, max_size=20)), broken)
    document = draw(base_document(limits, "messages" if path.startswith("messages") else "prompt_ids"))
    if path == "prompt":
        document = {name: value for name, value in document.items() if name != "prompt_ids"}
    return bad(draw, "invalid UTF-8", put(document, path, text), "Invalid UTF-8")


@st.composite
def deep_nesting(draw, limits: Limits) -> FuzzEntry:
    """Past a depth the worker cannot even skip the nesting to read the id (its decoder's stack runs out)."""
    path, maps, reason = draw(st.sampled_from([
        ("nested", True, "unknown field `nested`"), ("prompt_ids[0]", False, "got `array` - at `$.prompt_ids[0]`"),
        ("params", True, "unknown field `a` - at `$.params`"),
        ("messages[0].content", False, "got `array` - at `$.messages[0].content`"),
        ("", False, "Expected `object`, got `array`")]))
    deep = draw(st.booleans())
    depth = draw(DEEP if deep else SHALLOW)
    if not path:  # the whole entry
        return FuzzEntry("deep nesting", nested(depth, maps), reason=reason)
    document = draw(base_document(limits, "messages" if path.startswith("messages") else "prompt_ids"))
    document = put(document, path, msgspec.Raw(nested(depth, maps)))
    if deep:  # an id the worker cannot reach past the nesting: it must answer to none
        document = document | {"id": draw(ID_TEXT)}
    return bad(draw, "deep nesting", document, reason)


@st.composite
def oversize_field(draw, limits: Limits) -> FuzzEntry:
    """Past a MAX_* bound of protocol.py, at a cost of kilobytes."""
    path, value, bound = draw(st.sampled_from([
        ("params.stop", st.integers(MAX_STOP_STRINGS + 1, 64).map(lambda n: ["x"] * n), MAX_STOP_STRINGS),
        ("params.stop[0]", st.integers(MAX_STOP_CHARS + 1, 4 * MAX_STOP_CHARS).map(lambda n: "x" * n),
         MAX_STOP_CHARS),
        ("params.stop_token_ids", st.integers(MAX_STOP_TOKEN_IDS + 1, 500).map(lambda n: [3] * n), MAX_STOP_TOKEN_IDS),
        ("messages", st.integers(MAX_MESSAGES + 1, MAX_MESSAGES + 100).map(
            lambda n: Repeat({"role": "user", "content": "hi"}, n)), MAX_MESSAGES)]))
    document = draw(base_document(limits, "messages" if path == "messages" else "prompt_ids"))
    return bad(draw, "oversize field", put(document, path, draw(value)), f"of length <= {bound} - at `$.{path}`")


@st.composite
def huge_entry(draw, limits: Limits) -> FuzzEntry:
    """Megabytes: a prompt, prompt_ids or conversation past its bound, or a whole entry past MAX_ENTRY_BYTES."""
    extra, variant = draw(st.integers(1, 1000)), draw(st.sampled_from(["prompt", "prompt_ids", "messages", "entry"]))
    document, reason = {
        "prompt": ({"prompt": Repeat("a", MAX_PROMPT_CHARS + extra)},
                   f"of length <= {MAX_PROMPT_CHARS} - at `$.prompt`"),
        "prompt_ids": ({"prompt_ids": Repeat(7, MAX_PROMPT_IDS + extra)},
                       f"of length <= {MAX_PROMPT_IDS} - at `$.prompt_ids`"),
        "messages": ({"messages": [{"role": "user", "content": Repeat("a", MAX_PROMPT_CHARS // 2 + extra)}] * 2},
                     "characters of content in all"),
        "entry": ({"prompt_ids": [5], "padding": Repeat(b"x", MAX_ENTRY_BYTES + extra)},
                  f"more than {MAX_ENTRY_BYTES}"),
    }[variant]
    return bad(draw, "huge entry (megabytes)", {"id": USABLE_ID, **document}, reason)


@st.composite
def past_model_limits(draw, limits: Limits) -> FuzzEntry:
    """Decodes, but the engine cannot take it: the model's length, an empty prompt, text without a tokenizer."""
    variant = draw(st.sampled_from(["max_tokens", "prompt_ids", "empty", "prompt", "messages"]))
    if variant == "max_tokens":
        document, reason = ({"prompt_ids": [5], "params": {"max_tokens": draw(st.integers(limits.max_model_len,
                                                                                          MAX_TOKENS))}},
                            "leaves no room for a prompt")
    elif variant == "prompt_ids":
        max_tokens = draw(st.integers(1, 8))
        length = draw(st.integers(limits.max_model_len - max_tokens + 1, 2 * limits.max_model_len))
        document, reason = {"prompt_ids": [5] * length, "params": {"max_tokens": max_tokens}}, "longer than the limit"
    elif variant == "empty":
        document, reason = {"prompt_ids": []}, "prompt_ids is empty"
    elif variant == "prompt":
        document, reason = {"prompt": draw(st.text(max_size=20))}, "this model has no tokenizer"
    else:
        message = {"role": draw(st.sampled_from(["system", "user"])), "content": draw(st.text(max_size=20))}
        document, reason = {"messages": [message]}, "this model has no tokenizer"
    return bad(draw, "past the model's limits", draw(shuffled({"id": USABLE_ID, **document})), reason)


def _loaded(data: bytes) -> Any:
    try:
        return msgspec.msgpack.decode(data)
    except (msgspec.DecodeError, RecursionError):
        return None


@st.composite
def raw_entry(draw, limits: Limits) -> FuzzEntry:
    """Bytes that are no request document at all, so no id can be read from them."""
    kind = draw(st.sampled_from(["raw bytes", "msgpack, not a map", "truncated", "trailing bytes", "random map"]))
    if kind in ("truncated", "trailing bytes"):
        valid = msgspec.msgpack.encode({"id": "x", "prompt_ids": draw(token_ids(limits))})
    if kind == "raw bytes":
        body = draw(st.binary(max_size=200).filter(lambda data: not isinstance(_loaded(data), dict)))
        reason = "invalid request: "
    elif kind == "msgpack, not a map":
        value = draw(VALUES.filter(lambda value: not isinstance(value, dict)))
        body, reason = msgspec.msgpack.encode(value), f"Expected `object`, got `{TYPE_NAMES[type(value)]}`"
    elif kind == "truncated":
        body, reason = valid[:draw(st.integers(0, len(valid) - 1))], "truncated"
    elif kind == "trailing bytes":
        body, reason = valid + draw(st.binary(min_size=1, max_size=20)), "trailing characters"
    else:  # no id, and no prompt either: never a request
        names = st.text(max_size=8).filter(lambda name: name not in {"id", "prompt", "messages", "prompt_ids"})
        body, reason = msgspec.msgpack.encode(draw(st.dictionaries(names, VALUES, max_size=4))), "invalid request: "
    return FuzzEntry(kind, body, reason=reason)


@st.composite
def no_field(draw, limits: Limits) -> FuzzEntry:
    fields = draw(st.dictionaries(st.binary(min_size=1, max_size=8).filter(lambda name: name != FIELD),
                                  st.binary(max_size=32), min_size=1, max_size=3))
    return FuzzEntry("no 'm' field", b"", reason=f"entry has no {FIELD.decode()!r} field", extra_fields=fields,
                     has_field=False)


FAMILIES = {good: 14, duplicate: 2, extreme: 4, bad_id: 3, id_of_wrong_type: 2, non_finite: 3, out_of_range: 4,
            wrong_version: 2, outside_vocabulary: 3, wrong_type: 5, unknown_field: 2, not_a_choice: 2, missing_field: 1,
            not_one_prompt: 1, not_utf8: 3, deep_nesting: 3, oversize_field: 3, huge_entry: 1, past_model_limits: 3,
            raw_entry: 6, no_field: 1}  # weights: each family's share of the entries


@st.composite
def placed(draw, family: st.SearchStrategy[FuzzEntry]) -> FuzzEntry:
    return dataclasses.replace(draw(family), tenant=draw(st.sampled_from(TENANTS)), lane=draw(st.sampled_from(LANES)))


def generate(count: int, seed_value: int, limits: Limits) -> list[FuzzEntry]:
    """`count` entries, the same ones for the same seed. Each family gets its share of them (its
    weight), drawn by hypothesis one per example (its generation phase only, no database); the
    families are then mixed by a random.Random of the seed, and each entry gets its id."""
    total, drawn, start = sum(FAMILIES.values()), [], 0
    for family, weight in FAMILIES.items():
        end = start + weight
        drawn += examples(placed(family(limits)), round(count * end / total) - round(count * start / total), seed_value)
        start = end
    random.Random(seed_value).shuffle(drawn)
    return with_ids(drawn)


def examples(strategy: st.SearchStrategy[FuzzEntry], count: int, seed_value: int) -> list[FuzzEntry]:
    drawn: list[FuzzEntry] = []
    if not count:
        return drawn

    @seed(seed_value)
    @settings(max_examples=count, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(entry: FuzzEntry) -> None:
        drawn.append(entry)

    collect()
    if len(drawn) < count:
        raise ValueError(f"hypothesis drew {len(drawn)} entries of {strategy!r}, not {count}")
    return drawn[:count]


def with_ids(drawn: list[FuzzEntry]) -> list[FuzzEntry]:
    """Own ids end in the entry's index, so none repeats in a tenant. A borrower takes the latest
    good id of another tenant not yet used in its own: one tenant's bad entry aimed at another's
    request, or two tenants' requests under one id. A duplicate goes after the latest good request
    (later in the same stream: the original is always read first); with none yet, it is one."""
    used: dict[str, set[str]] = defaultdict(set)
    good_ids: dict[str, list[str]] = defaultdict(list)
    latest_good: FuzzEntry | None = None
    named = []
    for index, entry in enumerate(drawn):
        request_id = None
        if entry.duplicate and latest_good is not None:
            entry = dataclasses.replace(entry, tenant=latest_good.tenant, lane=latest_good.lane)
            request_id = latest_good.request_id
        elif entry.usable:
            if entry.duplicate:
                entry = dataclasses.replace(entry, kind="good request", served="good", reason=None, duplicate=False)
            borrowed = [other for tenant, ids in good_ids.items() if tenant != entry.tenant
                        for other in ids[-3:] if other not in used[entry.tenant]] if entry.borrow else []
            request_id = borrowed[-1] if borrowed else f"{entry.id_stem}-{index}"
            used[entry.tenant].add(request_id)
        entry = dataclasses.replace(entry, request_id=request_id)
        named.append(entry)
        if entry.served == "good":
            good_ids[entry.tenant].append(request_id)
            latest_good = entry
    return named


# --- the campaign ----------------------------------------------------------------------
@dataclass
class Sent:
    entry: FuzzEntry
    stream: str
    entry_id: str
    size: int  # of the payload the dead letter describes
    head: bytes  # its first DEAD_LETTER_ENTRY_BYTES


@dataclass
class Report:
    entries: Counter = field(default_factory=Counter)  # by kind
    dead_letters: Counter = field(default_factory=Counter)  # by reason, less what varies (reason_label)
    error_events: int = 0
    repeats_acked: int = 0  # duplicates of a finished request, acked without a dead letter
    good: int = 0
    good_completed: int = 0
    good_right: int = 0
    extreme: int = 0
    extreme_completed: int = 0
    canaries: int = 0
    canaries_right: int = 0
    turns: int = 0
    failed_turns: int = 0
    crashes: int = 0
    wedges: int = 0
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)


def campaign(worker: Worker, client: redis.Redis, fuzzed: list[FuzzEntry]) -> Report:
    """Run the entries through `worker` (registering the tenants), then check everything it left."""
    report = Report(entries=Counter(entry.kind for entry in fuzzed))
    register_tenants(client, worker)
    started = time.monotonic()
    with structlog.testing.capture_logs() as logs:
        sent = drive(worker, client, fuzzed, report)
        if not report.crashes and not report.wedges:
            sent += drive(worker, client, [canary(tenant) for tenant in TENANTS], report)
    report.seconds = time.monotonic() - started
    expected = offline_tokens(worker.engine, [item.entry for item in sent if item.entry.served == "good"])
    check_health(worker, report)
    check_outcomes(client, sent, expected, Limits.of(worker.engine), report)
    check_keys(client, worker, sent, report)
    report.problems += [f"the worker logged {entry['log_level']} {entry['event']}: {entry.get('error', '')}"
                        for entry in logs if entry["log_level"] in ("error", "critical")]
    return report


def canary(tenant: str) -> FuzzEntry:
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    document = {"id": USABLE_ID, "prompt_ids": [5, 6, 7], "params": msgspec.to_builtins(params)}
    return FuzzEntry("canary", document, served="good", prompt_ids=[5, 6, 7], params=params, tenant=tenant,
                     request_id=CANARY)


def register_tenants(client: redis.Redis, worker: Worker) -> None:
    for tenant in TENANTS:
        if tenant != DEFAULT_TENANT:
            client.hset(KEYS.tenants, tenant, msgspec.json.encode(Tenant()))
    worker.serve_registered()


def drive(worker: Worker, client: redis.Redis, fuzzed: list[FuzzEntry], report: Report) -> list[Sent]:
    """XADD the entries AHEAD at a time and turn the worker until it has acked all of them."""
    streams = [KEYS.of(tenant).requests(lane) for tenant in TENANTS for lane in LANES]
    waiting = iter(fuzzed)
    sent: list[Sent] = []
    left, acked, progress = len(fuzzed), 0, time.monotonic()
    while True:
        pipe = client.pipeline(transaction=False)
        for stream in streams:
            pipe.xlen(stream)
        backlog = sum(pipe.execute())
        if backlog < AHEAD // 2 and left:
            batch = [entry for _, entry in zip(range(AHEAD), waiting)]
            sent += send(client, batch)
            left, backlog = left - len(batch), backlog + len(batch)
        elif not backlog and not left and not worker.flights:
            return sent
        if len(sent) - backlog > acked:
            acked, progress = len(sent) - backlog, time.monotonic()
        elif time.monotonic() - progress > WEDGE_S:
            report.wedges += 1
            report.problems.append(f"wedged: no entry acked for {WEDGE_S:.0f} s, {backlog} waiting, "
                                   f"{len(worker.flights)} in flight")
            return sent
        try:
            worker.turn()
        except Exception:  # Worker.run would end here: the process crashes
            report.crashes += 1
            report.problems.append(f"the worker crashed: {traceback.format_exc()}")
            return sent
        report.turns += 1
        report.failed_turns += int(worker.failed_turns > 0)  # reset by every turn that succeeds


def send(client: redis.Redis, batch: list[FuzzEntry]) -> list[Sent]:
    pipe = client.pipeline(transaction=False)
    described = []
    for entry in batch:
        fields, stream = entry.fields(), entry.keys.requests(entry.lane)
        pipe.xadd(stream, fields)
        payload = fields[FIELD] if entry.has_field else msgspec.msgpack.encode(fields)  # as the dead letter keeps it
        described.append((entry, stream, len(payload), payload[:DEAD_LETTER_ENTRY_BYTES]))
    return [Sent(entry, stream, entry_id.decode(), size, head)
            for (entry, stream, size, head), entry_id in zip(described, pipe.execute())]


def offline_tokens(engine: Engine, served: list[FuzzEntry]) -> dict[tuple[str, str], list[int]]:
    """(tenant, id) -> the greedy tokens of the engine run directly on the same model, without Redis."""
    offline = Engine(engine.config, model=engine.model)
    names = {f"{entry.tenant}/{entry.request_id}": (entry.tenant, entry.request_id) for entry in served}
    for entry in served:
        offline.add_request(f"{entry.tenant}/{entry.request_id}", prompt_ids=entry.prompt_ids, params=entry.params)
    tokens: dict[tuple[str, str], list[int]] = {name: [] for name in names.values()}
    while offline.has_unfinished:
        for output in offline.step():
            tokens[names[output.request_id]] += output.token_ids
    return tokens


def check_health(worker: Worker, report: Report) -> None:
    for probe in (worker.health.liveness, worker.health.readiness):
        status, answer = probe()
        if status != 200:
            report.problems.append(f"the worker's health: {status} {answer}")


def read_replays(client: redis.Redis, requests: list[tuple[str, str]]) -> list[list]:
    pipe = client.pipeline(transaction=False)
    for tenant, request_id in requests:
        pipe.xrange(KEYS.of(tenant).replay(request_id))
    return [[decode_event(fields[FIELD]) for _, fields in replay] for replay in pipe.execute()]


def read_dead_letters(client: redis.Redis) -> dict[tuple[str, str], list[dict[bytes, bytes]]]:
    """(stream, entry id) -> its dead letters."""
    letters: dict[tuple[str, str], list[dict[bytes, bytes]]] = defaultdict(list)
    start = "-"
    while batch := client.xrange(KEYS.dead_letters, start, "+", count=1000):
        for _, letter in batch:
            letters[(letter[b"stream"].decode(), letter[b"entry_id"].decode())].append(letter)
        start = "(" + batch[-1][0].decode()
    return letters


def check_outcomes(client: redis.Redis, sent: list[Sent], expected: dict[tuple[str, str], list[int]],
                   limits: Limits, report: Report) -> None:
    letters = read_dead_letters(client)
    answering = [item for item in sent if item.entry.request_id is not None]
    replays = read_replays(client, [(item.entry.tenant, item.entry.request_id) for item in answering])
    events_of = {(item.entry.tenant, item.entry.request_id): events for item, events in zip(answering, replays)}
    for item in sent:
        entry, mine = item.entry, letters.pop((item.stream, item.entry_id), [])
        name = f"{entry.kind} {entry.tenant}/{entry.request_id or '-'} ({item.stream} {item.entry_id})"
        events = events_of.get((entry.tenant, entry.request_id), [])
        if entry.served:
            if mine:
                report.problems.append(f"{name}: served, yet dead-lettered: {mine[0][b'reason']!r:.200}")
            check_served(name, entry, events, expected, limits, report)
            continue
        if entry.duplicate and not mine:  # its original had finished: acked as a repeat, its result standing
            report.repeats_acked += 1
            continue
        if len(mine) != 1:
            report.problems.append(f"{name}: {len(mine)} dead letters, not 1")
            continue
        if problem := dead_letter_problem(item, mine[0]):
            report.problems.append(f"{name}: {problem}")
            continue
        reason = mine[0][b"reason"].decode()
        report.dead_letters[reason_label(reason)] += 1
        if entry.request_id is None or entry.duplicate:  # the original's stream is checked with the original
            continue
        error = events[0] if len(events) == 1 and isinstance(events[0], ErrorEvent) else None
        if error is None or (error.seq, error.attempt) != (0, 1) or error.code not in ("invalid_request", "too_long") \
                or error.message[:DEAD_LETTER_ENTRY_BYTES] != reason:
            report.problems.append(f"{name}: its replay stream holds {events!r:.300}, not one invalid_request (or "
                                   "too_long) error with the dead letter's reason")
        else:
            report.error_events += 1
    report.problems += [f"a dead letter of no entry sent: {letters!r:.300}"] if letters else []


def reason_label(reason: str) -> str:
    """A dead letter's reason without what varies from entry to entry (values, names, paths), to count by."""
    reason = reason.removeprefix("invalid request: ").removeprefix("invalid sampling params: ")
    reason = re.split(r" - at `|[,;] got |; this side| \(byte |: give ", reason)[0]
    reason = re.sub(r"(unknown field|required field|Invalid enum value) .*", r"\1", reason, flags=re.DOTALL)
    reason = re.sub(r"`[^`]*`", "`…`", reason)
    return re.sub(r"(?<![\w{,.*-])-?\d+(?![\w.*])", "N", reason)  # not those of UTF-8, {1,64} or 2**63


def dead_letter_problem(item: Sent, letter: dict[bytes, bytes]) -> str | None:
    entry = item.entry
    wanted = {b"tenant": entry.tenant.encode(), b"id": (entry.request_id or "").encode(),
              b"entry": item.head, b"entry_bytes": str(item.size).encode()}
    wrong = {name: letter.get(name) for name, value in wanted.items() if letter.get(name) != value}
    if wrong:
        return f"its dead letter says {wrong!r:.300}"
    if entry.reason not in letter[b"reason"].decode():
        return f"its dead letter's reason {letter[b'reason']!r:.300} does not say {entry.reason!r}"
    return None


def check_served(name: str, entry: FuzzEntry, events: list, expected: dict[tuple[str, str], list[int]],
                 limits: Limits, report: Report) -> None:
    good = entry.served == "good"
    if entry.kind == "canary":
        report.canaries += 1
    elif good:
        report.good += 1
    else:
        report.extreme += 1
    tokens = [token for event in events if isinstance(event, TokenEvent) for token in event.ids]
    numbered = [event.seq for event in events] == list(range(len(events))) and \
        all(isinstance(event, TokenEvent) for event in events[:-1]) and all(event.attempt == 1 for event in events)
    done = events[-1] if events and isinstance(events[-1], DoneEvent) else None
    if not numbered or done is None or done.error is not None or done.usage.completion_tokens != len(tokens):
        report.problems.append(f"{name}: not served in order: {events!r:.300}")
        return
    if good:
        right = tokens == expected[(entry.tenant, entry.request_id)] and done.finish_reason == "length"
        if entry.kind == "canary":
            report.canaries_right += right
        else:
            report.good_completed += 1
            report.good_right += right
        if not right:
            report.problems.append(f"{name}: tokens {tokens}, not {expected[(entry.tenant, entry.request_id)]}")
    elif done.finish_reason in ("stop", "length", "deadline") and all(0 <= token < limits.vocab_size
                                                                       for token in tokens):
        report.extreme_completed += 1
    else:
        report.problems.append(f"{name}: finished {done.finish_reason} with tokens {tokens}")


def check_keys(client: redis.Redis, worker: Worker, sent: list[Sent], report: Report) -> None:
    """Every key is a shared one or one the entries' own tenants and ids account for; the lane
    streams are empty, nothing pending."""
    allowed = {KEYS.dead_letters, KEYS.tenants, KEYS.worker(worker.config.name)}
    for tenant in TENANTS:
        allowed |= {KEYS.of(tenant).requests(lane) for lane in LANES}
    for item in sent:
        if item.entry.request_id is not None:
            keys = item.entry.keys
            allowed |= {keys.replay(item.entry.request_id), keys.attempt(item.entry.request_id),
                        keys.submitted(item.entry.request_id)}
    unexpected = sorted(key for key in (name.decode(errors="replace") for name in client.scan_iter(count=1000))
                        if key not in allowed)
    if unexpected:
        report.problems.append(f"{len(unexpected)} keys no entry accounts for: {unexpected[:10]}")
    for tenant in TENANTS:
        for lane in LANES:
            stream = KEYS.of(tenant).requests(lane)
            length, pending = client.xlen(stream), client.xpending(stream, GROUP)["pending"]
            if length or pending:
                report.problems.append(f"{stream}: {length} entries left, {pending} pending")


# --- the tool --------------------------------------------------------------------------
def table(report: Report) -> Table:
    counts = Table(title="fuzz campaign", show_header=False)
    counts.add_column()
    counts.add_column(justify="right")
    counts.add_row("[bold]entries[/]", f"[bold]{sum(report.entries.values())}[/]")
    for kind, count in report.entries.most_common():
        counts.add_row(f"  {escape(kind)}", str(count))
    counts.add_section()
    counts.add_row("[bold]dead-lettered[/]", f"[bold]{sum(report.dead_letters.values())}[/]")
    for reason, count in report.dead_letters.most_common():
        counts.add_row(f"  {escape(reason)}", str(count))
    counts.add_section()
    for label, value in [
            ("error events sent (usable ids)", report.error_events),
            ("duplicates of finished requests acked as repeats", report.repeats_acked),
            ("good requests completed / right tokens",
             f"{report.good_completed} / {report.good_right} of {report.good}"),
            ("extreme valid requests completed", f"{report.extreme_completed} of {report.extreme}"),
            ("canaries after the campaign, right tokens", f"{report.canaries_right} of {report.canaries}"),
            ("worker turns", report.turns), ("failed turns", report.failed_turns), ("crashes", report.crashes),
            ("wedges", report.wedges), ("problems", len(report.problems)),
            ("time through the worker", f"{report.seconds:.1f} s")]:
        counts.add_row(label, str(value))
    return counts


def fuzz_worker(redis_url: str) -> Worker:
    """One worker on the tiny random model, named for this campaign."""
    engine = EngineConfig.from_options(MODEL, num_blocks=NUM_BLOCKS)
    config = WorkerConfig(engine=engine, name="fuzz", redis_url=redis_url)
    return Worker(config, engine=Engine(engine, model=load_model(MODEL)[0]))


def run(console: Console, count: int, seed_value: int) -> None:
    torch.set_num_threads(1)  # a tiny model gains nothing from threads
    with tempfile.TemporaryDirectory(prefix="streambatch-fuzz-") as scratch, \
            redis_at(None, Path(scratch), console) as url, \
            structlog.testing.capture_logs():  # the worker's log, kept from the table (the campaign checks it)
        worker = fuzz_worker(url)
        try:
            with console.status(f"drawing {count} entries (seed {seed_value})"):
                fuzzed = generate(count, seed_value, Limits.of(worker.engine))
            with console.status(f"running {count} entries through the worker"), redis.Redis.from_url(url) as client:
                report = campaign(worker, client, fuzzed)
        finally:
            worker.close()
    console.print(table(report))
    for problem in report.problems[:SHOWN_PROBLEMS]:
        console.print(f"[red]problem:[/] {escape(problem)}")
    if report.problems:
        raise ToolError(f"{len(report.problems)} problems (above, at most {SHOWN_PROBLEMS} of them)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ops.fuzz", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entries", type=int, default=10_000, help="how many entries to send")
    parser.add_argument("--seed", type=int, default=0, help="hypothesis's seed: the same one makes the same entries")
    args = parser.parse_args(argv)
    console = Console()
    return run_tool("fuzz", lambda: run(console, args.entries, args.seed), console)


if __name__ == "__main__":
    raise SystemExit(main())
