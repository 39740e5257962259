"""Prefix analyzer: how much of the traffic starts with the same tokens, and whether to pin it.

    python -m ops.prefixes --jsonl requests.jsonl      # Requests as the producer enqueues them, or an ops.load trace
    python -m ops.prefixes --redis-url redis://localhost:6379/0 --count 2000   # the lane streams, newest first
    python -m ops.prefixes --eviction-check            # offline: a pinned prefix under pressure, pinned vs not

Each prompt is tokenized as the worker does it (worker.engine.inputs, with the model's tokenizer for
text and chat prompts: --tokenizer, default the bundled SmolLM2's) and cut to its first --head tokens
(default 128). Requests are grouped by their first KV block, since only whole blocks are ever shared:
a group's common prefix is the longest one all its members start with, its coverage the share of
requests in it. When the top group covers more than --threshold (default 50%) and shares a whole block,
the report recommends pinning it and prints the commands: by token ids, and in the form the requests
use when it tokenizes to the group's own tokens (the common system prompt or leading messages of chat
requests, the common text of text prompts cut back to a word boundary), the one that pins more first.

The lane streams hold only requests not finished yet (workers delete what they ack): on a live
deployment they show the backlog; for history, log what the producers enqueue as JSONL.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import redis
from rich.console import Console
from rich.table import Table
from transformers import AutoTokenizer

from ops.load.trace import read_jsonl
from ops.tool import run_tool
from producer.connect import add_cluster_flag, connect
from producer.protocol import (DEFAULT_TENANT, FIELD, LANES, Keys, Message, SamplingParams,
                               decode_request)
from producer.shell import TENANT_ENV
from worker.engine.config import EngineConfig
from worker.engine.engine import Engine
from worker.engine.inputs import PromptError, encode_prompt
from worker.engine.models import load_model, smollm2_cache

HEAD_TOKENS = 128
BLOCK_SIZE = EngineConfig().block_size
PIN_THRESHOLD = 0.5
NO_LIMIT = sys.maxsize


class PromptRecord(msgspec.Struct):
    """One request's prompt, from a line of either file format (other fields are ignored)."""

    prompt: str | None = None
    messages: list[Message] | None = None
    prompt_ids: list[int] | None = None


@dataclass(frozen=True)
class Prompt:
    record: PromptRecord
    token_ids: list[int]  # the whole prompt, as the worker tokenizes it

    @property
    def kind(self) -> str:
        return "prompt_ids" if self.record.prompt_ids is not None else \
            "messages" if self.record.messages is not None else "prompt"


@dataclass
class PrefixGroup:
    """Requests that share at least their first KV block."""

    members: list[Prompt] = field(repr=False)
    common_ids: list[int]  # the longest prefix of every member's head
    share: float  # of all requests

    @property
    def requests(self) -> int:
        return len(self.members)


@dataclass
class Coverage:
    requests: int
    head_tokens: int
    block_size: int
    prompt_tokens: int  # of all prompts, whole
    groups: list[PrefixGroup]  # of 2 requests or more, the largest first
    unshared: int  # requests that share no whole block with any other

    def pinnable_blocks(self, group: PrefixGroup) -> int:
        return len(group.common_ids) // self.block_size

    def cacheable_share(self, group: PrefixGroup) -> float:
        """Of all prompt tokens, those the group's pinned prefix would serve from the cache."""
        return group.requests * self.pinnable_blocks(group) * self.block_size / max(self.prompt_tokens, 1)


# --- reading ---------------------------------------------------------------------------------
def read_streams(client: redis.Redis, keys: Keys, count: int) -> list[PromptRecord]:
    """The newest `count` entries of each lane stream; entries that do not decode are skipped."""
    records = []
    for lane in LANES:
        for _, fields in client.xrevrange(keys.requests(lane), count=count):
            try:
                request = decode_request(fields.get(FIELD, b""))
            except msgspec.DecodeError:
                continue
            records.append(PromptRecord(request.prompt, request.messages, request.prompt_ids))
    return records


def tokenize(records: list[PromptRecord], tokenizer: Any) -> list[Prompt]:
    """As the worker does (chat requests with the generation prompt); prompts the tokenizer cannot
    encode are left out."""
    prompts = []
    for record in records:
        if record.prompt_ids is not None:
            prompts.append(Prompt(record, list(record.prompt_ids)))
            continue
        messages = None if record.messages is None else [msgspec.structs.asdict(m) for m in record.messages]
        try:
            ids = encode_prompt(tokenizer, prompt=record.prompt, messages=messages, max_prompt_tokens=NO_LIMIT)
        except PromptError:
            continue
        prompts.append(Prompt(record, ids))
    return prompts


# --- coverage --------------------------------------------------------------------------------
def common_prefix_length(sequences: list) -> int:
    """Of lists or strings: the prefix all share is the one the lexicographically first and last share."""
    first, last = min(sequences), max(sequences)
    length = 0
    while length < min(len(first), len(last)) and first[length] == last[length]:
        length += 1
    return length


def coverage(prompts: list[Prompt], head_tokens: int = HEAD_TOKENS, block_size: int = BLOCK_SIZE) -> Coverage:
    by_first_block: dict[tuple[int, ...], list[Prompt]] = {}
    for prompt in prompts:
        if len(prompt.token_ids) >= block_size:
            by_first_block.setdefault(tuple(prompt.token_ids[:block_size]), []).append(prompt)
    groups = []
    for members in by_first_block.values():
        if len(members) >= 2:
            heads = [prompt.token_ids[:head_tokens] for prompt in members]
            groups.append(PrefixGroup(members, heads[0][:common_prefix_length(heads)], len(members) / len(prompts)))
    groups.sort(key=lambda group: (-group.requests, -len(group.common_ids)))
    return Coverage(requests=len(prompts), head_tokens=head_tokens, block_size=block_size,
                    prompt_tokens=sum(len(prompt.token_ids) for prompt in prompts), groups=groups,
                    unshared=len(prompts) - sum(group.requests for group in groups))


# --- recommendation --------------------------------------------------------------------------
@dataclass(frozen=True)
class PinCommand:
    argv: list[str]  # python -m producer pin ...
    pinned_tokens: int  # that the pin keeps resident: whole blocks

    @property
    def shell(self) -> str:
        return shlex.join(self.argv)


def recommend(result: Coverage, tokenizer: Any, threshold: float = PIN_THRESHOLD) -> list[PinCommand]:
    """Commands that pin the top group's prefix, if it covers more than `threshold` of the requests
    and shares a whole block; the one that pins the most first, the requests' own form on a tie."""
    if not result.groups:
        return []
    top = result.groups[0]
    if top.share <= threshold or not result.pinnable_blocks(top):
        return []
    pin = ["python", "-m", "producer", "pin",
           "prefix-" + hashlib.blake2b(repr(top.common_ids).encode(), digest_size=4).hexdigest()]
    whole_blocks = top.common_ids[:result.pinnable_blocks(top) * result.block_size]
    commands = [PinCommand(pin + ["--ids", ",".join(map(str, whole_blocks))], len(whole_blocks))]
    own_form = _own_form(top, tokenizer, result.block_size)
    if own_form is not None:
        form, pinned = own_form
        commands.insert(0, PinCommand(pin + form, pinned))
    return sorted(commands, key=lambda command: -command.pinned_tokens)  # stable: the own form wins a tie


def _own_form(group: PrefixGroup, tokenizer: Any, block_size: int) -> tuple[list[str], int] | None:
    """The group's common prefix in the requests' own form, and the tokens it pins, if it pins a
    whole block of every member's tokens: --system / --messages for chat requests, --text for text
    prompts. It may pin more than the heads show (a long system prompt), or less (the head of the
    next message, which chat requests share too)."""
    kinds = {prompt.kind for prompt in group.members}
    if kinds == {"messages"}:
        conversations = [[(m.role, m.content) for m in prompt.record.messages] for prompt in group.members]
        leading = [Message(role, content) for role, content in conversations[0][:common_prefix_length(conversations)]]
        if not leading:
            return None
        messages = [msgspec.structs.asdict(message) for message in leading]
        pinned = _pinned_ids(tokenizer, block_size, messages=messages)
        form = ["--system", leading[0].content] if len(leading) == 1 and leading[0].role == "system" else \
            ["--messages", msgspec.json.encode(messages).decode()]
    elif kinds == {"prompt"}:
        texts = [prompt.record.prompt for prompt in group.members]
        text = texts[0][:common_prefix_length(texts)]
        cut = max(text.rfind(" "), text.rfind("\n"))
        text = text[:cut] if cut > 0 else text  # a word cut in two may tokenize otherwise than in the prompts
        pinned = _pinned_ids(tokenizer, block_size, prompt=text)
        form = ["--text", text]
    else:
        return None
    if not pinned or any(prompt.token_ids[:len(pinned)] != pinned for prompt in group.members):
        return None
    return form, len(pinned)


def _pinned_ids(tokenizer: Any, block_size: int, **prompt) -> list[int]:
    """The whole blocks a worker would pin for this prefix (Engine.pin tokenizes it so)."""
    try:
        ids = encode_prompt(tokenizer, **prompt, max_prompt_tokens=NO_LIMIT, add_generation_prompt=False)
    except PromptError:
        return []
    return ids[:len(ids) // block_size * block_size]


# --- the eviction check ----------------------------------------------------------------------
@dataclass
class EvictionRun:
    pinned: bool
    prefix_tokens: int
    later_cached_tokens: list[int]  # of each later request with the prefix, served from the cache
    min_resident_pinned_blocks: int | None  # during the flood, at the worst step; None unpinned

    @property
    def later_hit_share(self) -> float:
        return sum(self.later_cached_tokens) / (self.prefix_tokens * len(self.later_cached_tokens))


@dataclass
class EvictionCheck:
    num_blocks: int
    flood_requests: int
    flood_blocks: int  # the flood's prompts need this many blocks in all
    runs: list[EvictionRun]


def eviction_check(num_blocks: int = 64, prefix_blocks: int = 4, flood_requests: int = 32, flood_tokens: int = 200,
                   later_requests: int = 8, seed: int = 0) -> EvictionCheck:
    """The same traffic on two engines (random:llama, a small pool, offline), one with the system
    prompt pinned: a request computes the system prompt; a flood of unrelated prompts, many times the
    pool together, evicts every cached-free block; then later requests with the system prompt come."""
    model = load_model("random:llama")[0]
    rng = random.Random(seed)
    system = [rng.randrange(3, 500) for _ in range(prefix_blocks * BLOCK_SIZE)]
    flood = [[rng.randrange(3, 500) for _ in range(flood_tokens)] for _ in range(flood_requests)]
    runs = []
    for pinned in (True, False):
        engine = Engine(EngineConfig.from_options("random:llama", num_blocks=num_blocks, max_model_len=256),
                        model=model)
        if pinned:
            engine.pin("system", prompt_ids=system)
        _serve(engine, {"warm": system + [1]})
        resident = _serve(engine, {f"flood{i}": prompt for i, prompt in enumerate(flood)})[1]
        later, _ = _serve(engine, {f"later{i}": system + [rng.randrange(3, 500)] for i in range(later_requests)})
        runs.append(EvictionRun(pinned, len(system), list(later.values()), min(resident) if pinned else None))
    return EvictionCheck(num_blocks, flood_requests, flood_requests * -(-flood_tokens // BLOCK_SIZE), runs)


def _serve(engine: Engine, prompts: dict[str, list[int]]) -> tuple[dict[str, int], list[int]]:
    """Run the prompts to the end together -> (request id -> prompt tokens served from the cache,
    resident pinned blocks after each step)."""
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt_ids=prompt,
                           params=SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    cached, resident = {}, []
    while engine.has_unfinished:
        for output in engine.step():
            if output.finished:
                cached[output.request_id] = output.usage.cached_tokens
        resident.append(engine.pool.num_pinned_blocks)
    return cached, resident


# --- reports ---------------------------------------------------------------------------------
def coverage_json(result: Coverage, commands: list[PinCommand], top: int) -> dict:
    return {"requests": result.requests, "head_tokens": result.head_tokens, "block_size": result.block_size,
            "unshared": result.unshared,
            "groups": [{"requests": group.requests, "share": round(group.share, 4),
                        "common_tokens": len(group.common_ids), "pinnable_blocks": result.pinnable_blocks(group),
                        "cacheable_share": round(result.cacheable_share(group), 4)}
                       for group in result.groups[:top]],
            "pin_commands": [{"command": command.shell, "pinned_tokens": command.pinned_tokens}
                             for command in commands]}


def print_coverage(result: Coverage, commands: list[PinCommand], top: int, threshold: float,
                   console: Console) -> None:
    table = Table("#", "requests", "share", "cumulative", "common prefix", "pinnable blocks", "prompt tokens covered",
                  title=f"prefix coverage: {result.requests} requests, heads of {result.head_tokens} tokens, "
                        f"KV blocks of {result.block_size}")
    cumulative = 0.0
    for rank, group in enumerate(result.groups[:top], 1):
        cumulative += group.share
        common = len(group.common_ids)
        table.add_row(str(rank), str(group.requests), f"{group.share:.1%}", f"{cumulative:.1%}",
                      f"{common}{'+' if common == result.head_tokens else ''} tokens",
                      str(result.pinnable_blocks(group)), f"{result.cacheable_share(group):.1%}")
    console.print(table)
    if any(len(group.common_ids) == result.head_tokens for group in result.groups[:top]):
        console.print("(+: the whole head is shared; a longer --head shows how far)")
    console.print(f"sharing no whole block with another request: {result.unshared} "
                  f"({result.unshared / max(result.requests, 1):.1%})")
    if not commands:
        console.print(f"no recommendation: no prefix covers more than {threshold:.0%} of the requests")
        return
    console.print(f"recommendation: the top prefix covers {result.groups[0].share:.1%} of the requests "
                  f"(more than {threshold:.0%}): pin it on every worker with", style="bold")
    for rank, command in enumerate(commands):
        console.print(f"{'or, ' if rank else ''}pinning {command.pinned_tokens} tokens "
                      f"({command.pinned_tokens // result.block_size} blocks):")
        console.print(command.shell, soft_wrap=True, markup=False, highlight=False)
    console.print("(undo with `python -m producer unpin NAME`, list with `python -m producer pins`)")


def print_eviction_check(check: EvictionCheck, console: Console) -> None:
    console.print(f"eviction check: a pool of {check.num_blocks} KV blocks; a flood of {check.flood_requests} "
                  f"unrelated prompts needing {check.flood_blocks} blocks "
                  f"({check.flood_blocks / check.num_blocks:.1f}x the pool) between the request that computes "
                  f"the system prompt and the later ones")
    table = Table("system prompt", "later requests", "prefix tokens served from the cache",
                  "pinned blocks resident through the flood")
    for run in check.runs:
        table.add_row("pinned" if run.pinned else "not pinned", str(len(run.later_cached_tokens)),
                      f"{sum(run.later_cached_tokens)} of {run.prefix_tokens * len(run.later_cached_tokens)} "
                      f"({run.later_hit_share:.0%})",
                      "-" if run.min_resident_pinned_blocks is None else
                      f"at least {run.min_resident_pinned_blocks} of {run.prefix_tokens // BLOCK_SIZE}")
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ops.prefixes", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--jsonl", type=Path, help="one request per line: producer.protocol.Request fields, "
                                                   "or an ops.load trace (prompt_ids)")
    source.add_argument("--redis-url", help="read the newest --count entries of each lane stream")
    source.add_argument("--eviction-check", action="store_true", help="pinned vs not pinned under pressure, offline")
    add_cluster_flag(parser)
    parser.add_argument("--prefix", default="sb", help="key prefix shared with the workers")
    parser.add_argument("--tenant", default=os.environ.get(TENANT_ENV) or DEFAULT_TENANT,
                        help=f"whose lane streams to read (default: ${TENANT_ENV}, else {DEFAULT_TENANT})")
    parser.add_argument("--count", type=int, default=1000, help="entries per lane stream (default %(default)s)")
    parser.add_argument("--tokenizer", help="tokenizer directory for text and chat prompts (default: the bundled "
                                            "SmolLM2's); it must be the workers' model's")
    parser.add_argument("--head", type=int, default=HEAD_TOKENS,
                        help="tokens of each prompt compared (default %(default)s)")
    parser.add_argument("--block-size", type=int, default=BLOCK_SIZE,
                        help="the workers' KV block size (default %(default)s)")
    parser.add_argument("--threshold", type=float, default=PIN_THRESHOLD,
                        help="recommend pinning the top prefix when it covers more than this share "
                             "(default %(default)s)")
    parser.add_argument("--top", type=int, default=10, help="groups shown (default %(default)s)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    console = Console(highlight=False)
    return run_tool("prefixes", lambda: report(args, console), console)


def report(args, console: Console) -> None:
    if args.eviction_check:
        check = eviction_check()
        if args.json:
            print(msgspec.json.encode(check).decode())
        else:
            print_eviction_check(check, console)
        return
    if args.jsonl:
        records = read_jsonl(args.jsonl, PromptRecord)
    else:
        client = connect(args.redis_url, cluster=args.redis_cluster)
        records = read_streams(client, Keys(args.prefix, args.tenant), args.count)
    tokenizer = None
    if any(record.prompt_ids is None for record in records):
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or smollm2_cache())
    result = coverage(tokenize(records, tokenizer), args.head, args.block_size)
    commands = recommend(result, tokenizer, args.threshold)
    if args.json:
        print(msgspec.json.encode(coverage_json(result, commands, args.top)).decode())
    else:
        print_coverage(result, commands, args.top, args.threshold, console)


if __name__ == "__main__":
    sys.exit(main())
