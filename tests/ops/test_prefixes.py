"""The prefix analyzer: coverage arithmetic, the pinning threshold, the pin command in the requests'
own form, its sources (JSONL, lane streams), and small end-to-end runs of the tool."""

import json
import random

import pytest

from ops.prefixes import (PromptRecord, common_prefix_length, coverage, eviction_check, main, read_streams,
                          recommend, tokenize)
from producer.protocol import FIELD, Keys, Message, Request, encode

BLOCK = 16


def ids_record(ids) -> PromptRecord:
    return PromptRecord(prompt_ids=list(ids))


def traffic(shares: dict[int, int], unique: int, seed: int = 0) -> list[PromptRecord]:
    """`shares[length]` requests start with a prefix of `length` tokens of their own group (every group's
    first block differs), then 40 random tokens; `unique` requests share nothing."""
    rng = random.Random(seed)
    records = []
    for group, (length, count) in enumerate(shares.items()):
        prefix = [1000 * (group + 1) + i for i in range(length)]
        records += [ids_record(prefix + [rng.randrange(10**6, 10**7) for _ in range(40)]) for _ in range(count)]
    records += [ids_record(rng.randrange(10**6, 10**7) for _ in range(60)) for _ in range(unique)]
    rng.shuffle(records)
    return records


def test_common_prefix_length_of_lists_and_strings():
    assert common_prefix_length([[1, 2, 3], [1, 2, 4], [1, 2]]) == 2
    assert common_prefix_length(["abc d", "abc e"]) == 4 and common_prefix_length([[5]]) == 1


def test_coverage_groups_by_first_block_with_common_prefix_lengths():
    result = coverage(tokenize(traffic({200: 60, 50: 25}, unique=15), None), head_tokens=128, block_size=BLOCK)
    assert (result.requests, result.unshared) == (100, 15)
    first, second = result.groups
    assert (first.requests, first.share, len(first.common_ids)) == (60, 0.6, 128)  # cut at the head
    assert (second.requests, second.share, len(second.common_ids)) == (25, 0.25, 50)
    assert (result.pinnable_blocks(first), result.pinnable_blocks(second)) == (8, 3)
    prompt_tokens = 60 * 240 + 25 * 90 + 15 * 60
    assert result.prompt_tokens == prompt_tokens
    assert result.cacheable_share(second) == pytest.approx(25 * 48 / prompt_tokens)


def test_prompts_shorter_than_a_block_share_nothing():
    result = coverage(tokenize([ids_record(range(10))] * 3 + [ids_record(range(20))] * 2, None), block_size=BLOCK)
    assert [group.requests for group in result.groups] == [2] and result.unshared == 3


@pytest.mark.parametrize("top_requests, recommended", [(51, True), (50, False), (30, False)])
def test_pinning_is_recommended_only_above_the_threshold(top_requests, recommended):
    result = coverage(tokenize(traffic({64: top_requests}, unique=100 - top_requests), None), block_size=BLOCK)
    commands = recommend(result, None, threshold=0.5)
    assert len(commands) == recommended  # token ids only: there is no tokenizer
    if recommended:
        [pin] = commands
        command = pin.argv
        assert pin.pinned_tokens == 64
        assert command[:4] == ["python", "-m", "producer", "pin"] and command[5] == "--ids"
        assert command[6] == ",".join(str(1000 + i) for i in range(64))


@pytest.mark.parametrize("repeats, forms", [(12, ["--system", "--ids"]), (2, ["--ids", "--system"])])
def test_a_chat_system_prompt_is_recommended_as_such_unless_the_ids_pin_more(smollm2_tokenizer, repeats, forms):
    """Rendered, 12 repeats are 150 tokens: more than the heads show. 2 repeats are 30 tokens, 1 block,
    and the requests share 38 (the user turn's marker and "Where is parcel number" too): the ids pin 2."""
    system = Message("system", "You are the support assistant of Example Inc. Answer briefly. " * repeats)
    records = [PromptRecord(messages=[system, Message("user", f"Where is parcel number {i}?")]) for i in range(6)]
    records += [PromptRecord(messages=[Message("user", f"A question about topic {i} of many")]) for i in range(4)]
    result = coverage(tokenize(records, smollm2_tokenizer), block_size=BLOCK)
    assert result.groups[0].requests == 6
    commands = recommend(result, smollm2_tokenizer)
    assert [command.argv[5] for command in commands] == forms
    assert [command.pinned_tokens for command in commands] == ([144, 128] if repeats == 12 else [32, 16])
    assert commands[forms.index("--system")].argv[6] == system.content


def test_a_text_prefix_is_cut_back_to_a_word_boundary(smollm2_tokenizer):
    preamble = ("You translate for the support desk of Example Inc. Translate the following customer message "
                "into French, keeping names and order numbers exactly as they are: ")
    records = [PromptRecord(prompt=preamble + tail) for tail in ("hello there", "help me", "hexagonal nuts")]
    command = recommend(coverage(tokenize(records, smollm2_tokenizer), block_size=BLOCK), smollm2_tokenizer)[0].argv
    assert command[5:] == ["--text", preamble.rstrip()]  # "...are: he" would tokenize otherwise than the prompts


def test_mixed_forms_are_pinned_by_token_ids_only(smollm2_tokenizer):
    text = "Summarize the following report for an executive audience in three bullet points. " * 2
    ids = smollm2_tokenizer.encode(text)
    records = [PromptRecord(prompt=text + "Q1 sales"), PromptRecord(prompt_ids=ids + [42, 43])]
    [command] = recommend(coverage(tokenize(records, smollm2_tokenizer), block_size=BLOCK), smollm2_tokenizer)
    assert command.argv[5] == "--ids" and len(command.argv[6].split(",")) == command.pinned_tokens
    assert command.pinned_tokens >= BLOCK and command.pinned_tokens % BLOCK == 0


def test_the_lane_streams_are_read_newest_first(client):
    keys = Keys("sb")
    for i in range(5):
        client.xadd(keys.requests("normal"), {FIELD: encode(Request(prompt_ids=[i] * 20))})
    client.xadd(keys.requests("fast"), {FIELD: b"garbage"})
    records = read_streams(client, keys, count=3)
    assert [record.prompt_ids[0] for record in records] == [4, 3, 2]


@pytest.fixture
def client(redis_url):
    import redis
    return redis.Redis.from_url(redis_url)


def test_the_tool_on_a_trace_recommends_the_command(tmp_path, capsys):
    from ops.load.trace import generate, write_trace
    path = tmp_path / "trace.jsonl"
    write_trace(path, generate(200, 10.0, seed=1, shared_prefix_share=0.7, shared_prefix_tokens=96))
    assert main(["--jsonl", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    top = report["groups"][0]
    assert top["share"] > 0.6 and top["common_tokens"] >= 96 and top["pinnable_blocks"] >= 6
    [pin] = report["pin_commands"]
    assert pin["command"].startswith("python -m producer pin prefix-") and " --ids " in pin["command"]
    assert pin["pinned_tokens"] == 16 * top["pinnable_blocks"]
    assert main(["--jsonl", str(path)]) == 0
    assert "recommendation: the top prefix covers" in capsys.readouterr().out


def test_a_file_it_cannot_read_or_a_redis_it_cannot_reach_is_one_line_and_status_1(tmp_path, capsys,
                                                                                     monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # rich would fold a long path at 80

    def said() -> str:
        [line] = capsys.readouterr().out.splitlines()
        return line

    assert main(["--jsonl", str(tmp_path / "missing.jsonl")]) == 1
    assert "prefixes failed: [Errno 2] No such file or directory" in said()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt_ids": [1, 2]}\n{"prompt_ids": [1,\n')
    assert main(["--jsonl", str(bad)]) == 1
    assert f"prefixes failed: {bad}:2: " in said()
    assert main(["--redis-url", "redis://127.0.0.1:1/0"]) == 1
    assert "prefixes failed: Error 111 connecting to 127.0.0.1:1" in said()


def test_the_eviction_check_pinned_keeps_every_block_unpinned_loses_them():
    check = eviction_check(num_blocks=48, prefix_blocks=2, flood_requests=16, flood_tokens=100, later_requests=2)
    pinned, unpinned = check.runs
    assert check.flood_blocks > 2 * check.num_blocks
    assert pinned.later_cached_tokens == [32, 32] and pinned.min_resident_pinned_blocks == 2
    assert unpinned.later_cached_tokens == [0, 0]
