"""Incremental detokenization against the real SmolLM2 tokenizer (byte-level BPE)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from worker.engine.detok import REPLACEMENT, IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer):
    return smollm2_tokenizer


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def stream(detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1) -> list[str]:
    """Feed `ids` `chunk` at a time; the deltas, finish() last."""
    deltas = [detok.add(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    return deltas + [detok.finish()]


def stream_until_stop(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    """Feed `ids` one at a time, as the engine does, until a stop string ends it; the deltas,
    then finish() unless a stop string ended it."""
    deltas = []
    for token in ids:
        deltas.append(detok.add([token]))
        if detok.stop_reached:
            return deltas
    return deltas + [detok.finish()]


@pytest.mark.parametrize("text", ["I like 🙂, 🦜 and 👍🏽!", "日本語と你好世界 ok", "Жук € 🫠"])
def test_characters_split_across_byte_tokens_never_come_out_broken(tokenizer, text):
    ids = encode(tokenizer, text)
    assert sum(REPLACEMENT in tokenizer.decode([i]) for i in ids) >= 2  # really split
    detok = IncrementalDetokenizer(tokenizer, encode(tokenizer, "Say:"))
    deltas = stream(detok, ids)
    assert not any(REPLACEMENT in d for d in deltas)
    assert "".join(deltas) == text == tokenizer.decode(ids)
    assert deltas[-1] == ""  # nothing was left over for finish()


def test_first_token_keeps_its_leading_space(tokenizer):
    prompt, output = encode(tokenizer, "Say hello"), encode(tokenizer, " there friend")
    detok = IncrementalDetokenizer(tokenizer, prompt)
    assert detok.add(output[:1]) == " there"


def test_stop_string_spanning_two_tokens(tokenizer):
    ids = encode(tokenizer, "Hello world, goodbye")
    detok = IncrementalDetokenizer(tokenizer, [], stop=["o w"])
    deltas = stream(detok, ids)
    assert "".join(deltas) == "Hell"
    assert detok.stop_reached and detok.stop_string == "o w" and detok.finished
    assert detok.add(encode(tokenizer, " more")) == "" and detok.finish() == ""


def test_stop_string_inside_one_token_drops_the_rest_of_it(tokenizer):
    ids = encode(tokenizer, "Hello world, goodbye")
    detok = IncrementalDetokenizer(tokenizer, [], stop=["orl", "never"])
    texts = []
    for i in range(len(ids)):
        texts.append(detok.add(ids[i:i + 1]))
        if detok.stop_reached:
            break
    assert "".join(texts) == "Hello w"
    assert i == 1  # ended on the token " world" itself
    assert detok.stop_string == "orl"


def test_possible_stop_start_is_held_until_disproved(tokenizer):
    ids = encode(tokenizer, "one two three four")
    detok = IncrementalDetokenizer(tokenizer, [], stop=[" two three hundred"])
    released = [detok.add([i]) for i in ids]
    assert released == ["one", "", "", " two three four"]  # " two", " three" waited
    assert detok.finish() == "" and not detok.stop_reached


def test_held_text_is_flushed_by_finish(tokenizer):
    ids = encode(tokenizer, "the end is near")
    detok = IncrementalDetokenizer(tokenizer, [], stop=[" nearby"])
    deltas = stream(detok, ids)
    assert deltas[-1] == " near"
    assert "".join(deltas) == "the end is near" and detok.stop_string is None


def test_finish_renders_a_truly_incomplete_last_character_like_decode(tokenizer):
    ids = encode(tokenizer, "ok 🦜")[:-1]  # cut inside the emoji, as max_tokens would
    deltas = stream(IncrementalDetokenizer(tokenizer, []), ids)
    assert REPLACEMENT not in "".join(deltas[:-1])
    assert "".join(deltas) == tokenizer.decode(ids) and deltas[-1].endswith(REPLACEMENT)


def test_no_stop_strings_and_multi_token_steps(tokenizer):
    text = "A longer answer, with punctuation; numbers 12345 and 🙂 emoji."
    ids = encode(tokenizer, text)
    for chunk in (1, 2, 3, 7):
        assert "".join(stream(IncrementalDetokenizer(tokenizer, [1, 2]), ids, chunk)) == text


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tokenizer, skip):
    ids = encode(tokenizer, "Hi") + [tokenizer.eos_token_id]
    deltas = stream(IncrementalDetokenizer(tokenizer, [], skip_special_tokens=skip), ids)
    assert "".join(deltas) == ("Hi" if skip else "Hi<|im_end|>")


def test_only_a_small_window_is_decoded_per_step(tokenizer):
    class Counting:
        longest = 0

        def decode(self, ids, **kwargs):
            Counting.longest = max(Counting.longest, len(ids))
            return tokenizer.decode(ids, **kwargs)

    ids = encode(tokenizer, "word " * 300 + "日本語 🦜")
    deltas = stream(IncrementalDetokenizer(Counting(), encode(tokenizer, "a long prompt " * 50)), ids)
    assert "".join(deltas) == tokenizer.decode(ids)
    assert Counting.longest <= 8


# --- resuming: an earlier attempt emitted ids[:cut], a fresh detokenizer goes on -----------

def assert_resumes_like_undisturbed(tokenizer, prompt: list[int], ids: list[int], stop: list[str]) -> list[int]:
    """Resume at every cut point before the run ended: the deltas of the rest, token for token,
    and the stop string found are the undisturbed run's. -> the cut points where the earlier
    attempt had held text back (decode of what it emitted is more than it released)."""
    undisturbed = IncrementalDetokenizer(tokenizer, prompt, stop=stop)
    deltas = stream_until_stop(undisturbed, ids)
    held_back = []
    for cut in range(len(deltas)):  # the last delta is finish()'s, or the stop string's token
        resumed = IncrementalDetokenizer(tokenizer, prompt, stop=stop, emitted_ids=ids[:cut])
        assert stream_until_stop(resumed, ids[cut:]) == deltas[cut:], f"resumed after {cut} tokens"
        assert resumed.stop_string == undisturbed.stop_string
        if "".join(deltas[:cut]) != tokenizer.decode(ids[:cut]):
            held_back.append(cut)
    return held_back


@pytest.mark.parametrize("text", ["I like 🦜 and 日本語!", "Жук € 🫠", "a 🙂🙂 b"])
def test_resumed_inside_a_character_releases_the_whole_character(tokenizer, text):
    ids = encode(tokenizer, text)
    held_back = assert_resumes_like_undisturbed(tokenizer, encode(tokenizer, "Say:"), ids, [])
    assert held_back  # some cut points do fall inside a character


@pytest.mark.parametrize("text, stop", [
    ("one two three four five", " three four"),  # " three" held by the earlier attempt
    ("I like 🦜 and 日本語!", "🦜 and"),  # starts inside a split character
    ("I like 🦜 and 日本語!", "and 日"),  # ends inside one
    ("the end is near", " nearby"),  # held, never completed: finish() releases it
])
def test_resumed_inside_a_stop_string_stops_where_an_undisturbed_run_does(tokenizer, text, stop):
    ids = encode(tokenizer, text)
    held_back = assert_resumes_like_undisturbed(tokenizer, encode(tokenizer, "Say:"), ids, [stop])
    assert held_back


# --- property: any token sequence, including invalid UTF-8 fragments -------------------

@pytest.fixture(scope="module")
def token_pools(tokenizer):
    fragments = [i for i in range(len(tokenizer)) if REPLACEMENT in tokenizer.decode([i])]
    return fragments, list(tokenizer.all_special_ids)


def pieces(tokenizer, fragments, specials):
    text = st.text(alphabet=st.sampled_from(list("ab ,.\nЖ€日本語🦜🙂👍🏽")), max_size=12)
    return st.lists(st.one_of(
        text.map(lambda t: encode(tokenizer, t)),
        st.lists(st.sampled_from(fragments), min_size=1, max_size=4),
        st.lists(st.sampled_from(specials), min_size=1, max_size=1),
        st.lists(st.integers(0, len(tokenizer) - 1), min_size=1, max_size=3),
    ), max_size=8).map(lambda parts: [i for part in parts for i in part])


def draw_stop(data, full: str) -> list[str]:
    """No stop string, or a short piece of the full output text."""
    if not full or not data.draw(st.booleans(), "with_stop"):
        return []
    start = data.draw(st.integers(0, len(full) - 1), "stop_start")
    return [full[start:start + data.draw(st.integers(1, 4), "stop_len")]]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_property_deltas_add_up_to_the_full_decode(tokenizer, token_pools, data):
    strategy = pieces(tokenizer, *token_pools)
    prompt, output = data.draw(strategy, "prompt"), data.draw(strategy, "output")
    skip = data.draw(st.booleans(), "skip_special_tokens")
    full = tokenizer.decode(output, skip_special_tokens=skip)
    stop = draw_stop(data, full)
    detok = IncrementalDetokenizer(tokenizer, prompt, stop=stop, skip_special_tokens=skip)
    released, fed = "", 0
    while fed < len(output) and not detok.finished:
        step = data.draw(st.integers(1, 3), "step")
        released += detok.add(output[fed:fed + step])
        fed += step
        # Released text is final: a prefix of every later decode, so a U+FFFD in it is a
        # real invalid byte, never half of a character that a later token completes.
        assert full.startswith(released)
        assert tokenizer.decode(output[:fed], skip_special_tokens=skip).startswith(released)
    released += detok.finish()
    if stop and stop[0] in full:
        assert detok.stop_string == stop[0]
        assert released == full[: full.index(stop[0])]
    else:
        assert released == full and not detok.stop_reached


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_property_a_resumed_stream_goes_on_exactly_like_the_undisturbed_one(tokenizer, token_pools, data):
    strategy = pieces(tokenizer, *token_pools)
    prompt, output = data.draw(strategy, "prompt"), data.draw(strategy, "output")
    stop = draw_stop(data, tokenizer.decode(output))
    undisturbed = IncrementalDetokenizer(tokenizer, prompt, stop=stop)
    deltas = stream_until_stop(undisturbed, output)
    cut = data.draw(st.integers(0, len(deltas) - 1), "cut")
    resumed = IncrementalDetokenizer(tokenizer, prompt, stop=stop, emitted_ids=output[:cut])
    assert stream_until_stop(resumed, output[cut:]) == deltas[cut:]
    assert resumed.stop_string == undisturbed.stop_string
