"""encode_prompt: the one place where a prompt becomes token ids (and is truncated)."""

from __future__ import annotations

import pytest

from worker.engine.inputs import PromptError, encode_prompt


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer):
    return smollm2_tokenizer


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🦜, what's 2+2?"},
        {"role": "assistant", "content": "4."}, {"role": "user", "content": "And 3+3?"}]


def template_ids(tokenizer, messages) -> list[int]:
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_plain_prompt_is_the_tokenizers_encoding(tokenizer):
    assert encode_prompt(tokenizer, prompt="Hello world", max_prompt_tokens=100) == \
        tokenizer.encode("Hello world")


def test_messages_match_the_chat_template_ids(tokenizer):
    ids = encode_prompt(tokenizer, messages=CHAT, max_prompt_tokens=1000)
    assert ids == template_ids(tokenizer, CHAT)
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\n")  # generation prompt added
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>") and ids[1] != ids[0]


def test_tool_role_and_extra_known_keys_are_accepted(tokenizer):
    messages = [{"role": "user", "content": "x", "name": "ann"}, {"role": "tool", "content": "42",
                                                                  "tool_call_id": "c1"}]
    assert encode_prompt(tokenizer, messages=messages, max_prompt_tokens=1000)


def test_prompt_ids_pass_through(tokenizer):
    assert encode_prompt(tokenizer, prompt_ids=[5, 0, len(tokenizer) - 1], max_prompt_tokens=3) == \
        [5, 0, len(tokenizer) - 1]
    assert encode_prompt(tokenizer, prompt_ids=[70_000], max_prompt_tokens=3, vocab_size=80_000) == [70_000]


@pytest.mark.parametrize("given", [{}, {"prompt": "a", "prompt_ids": [1]},
                                   {"prompt": "a", "messages": CHAT, "prompt_ids": [1]}])
def test_exactly_one_input(tokenizer, given):
    with pytest.raises(PromptError, match="exactly one of prompt, messages, prompt_ids"):
        encode_prompt(tokenizer, max_prompt_tokens=10, **given)
    assert issubclass(PromptError, ValueError)


@pytest.mark.parametrize("given, message", [
    ({"prompt": ""}, "prompt is empty"),
    ({"prompt": 5}, "prompt must be a string"),
    ({"messages": []}, "non-empty list"),
    ({"prompt_ids": []}, "prompt_ids is empty"),
])
def test_empty_or_mistyped_input_is_rejected(tokenizer, given, message):
    with pytest.raises(PromptError, match=message):
        encode_prompt(tokenizer, max_prompt_tokens=10, **given)


@pytest.mark.parametrize("messages, message", [
    ("hello", "non-empty list"),
    (["hello"], r"messages\[0\] must be an object"),
    ([{"role": "robot", "content": "x"}], r"messages\[0\].role must be one of"),
    ([{"content": "x"}], r"messages\[0\].role must be one of"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": None}], r"messages\[1\].content must be a string"),
    ([{"role": "user", "content": [{"type": "text"}]}], "content must be a string, got list"),
    ([{"role": "user", "content": "x", "weight": 2}], r"unknown keys \['weight'\]"),
])
def test_message_shape_is_validated(tokenizer, messages, message):
    with pytest.raises(PromptError, match=message):
        encode_prompt(tokenizer, messages=messages, max_prompt_tokens=1000)


@pytest.mark.parametrize("ids, message", [
    ([1, -1], r"prompt_ids\[1\] = -1 is outside the vocabulary \[0, 49152\)"),
    ([49152], r"prompt_ids\[0\] = 49152 is outside"),
    ([1, True], r"prompt_ids\[1\] must be an int"),
    ([1.0], r"prompt_ids\[0\] must be an int"),
    ("12", "prompt_ids must be a list of ints"),
])
def test_prompt_ids_are_validated(tokenizer, ids, message):
    with pytest.raises(PromptError, match=message):
        encode_prompt(tokenizer, prompt_ids=ids, max_prompt_tokens=10)


def test_over_long_prompt_is_rejected_by_default_naming_the_lengths(tokenizer):
    ids = list(range(10, 30))
    assert encode_prompt(tokenizer, prompt_ids=ids, max_prompt_tokens=20) == ids  # exactly fits
    with pytest.raises(PromptError, match="prompt is 20 tokens, longer than the limit of 19 tokens"):
        encode_prompt(tokenizer, prompt_ids=ids, max_prompt_tokens=19)
    text_ids = tokenizer.encode("one two three four five")
    with pytest.raises(PromptError, match=f"prompt is {len(text_ids)} tokens"):
        encode_prompt(tokenizer, prompt="one two three four five", max_prompt_tokens=2)


def test_left_truncation_keeps_the_last_tokens(tokenizer):
    ids = list(range(10, 30))
    assert encode_prompt(tokenizer, prompt_ids=ids, max_prompt_tokens=5, truncate="left") == ids[-5:]
    chat = encode_prompt(tokenizer, messages=CHAT, max_prompt_tokens=6, truncate="left")
    assert chat == template_ids(tokenizer, CHAT)[-6:]  # the generation prompt survives


@pytest.mark.parametrize("options, message", [
    ({"truncate": "right"}, "truncate must be 'reject' or 'left'"),
    ({"max_prompt_tokens": 0}, "max_prompt_tokens must be a positive int"),
    ({"max_prompt_tokens": True}, "max_prompt_tokens must be a positive int"),
])
def test_bad_options(tokenizer, options, message):
    with pytest.raises(PromptError, match=message):
        encode_prompt(tokenizer, **{"prompt": "hi", "max_prompt_tokens": 10, **options})


class BosTokenizer:
    """A tokenizer whose encode() prepends BOS and whose template writes BOS itself."""

    BOS = 1
    chat_template = "{{ bos }}..."

    def __len__(self):
        return 100

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        assert not tokenize and add_generation_prompt
        return "<s>" + "".join(f"[{m['role']}]{m['content']}" for m in messages) + "[assistant]"

    def encode(self, text, add_special_tokens=True):
        ids = [self.BOS] if add_special_tokens else []
        if text.startswith("<s>"):
            ids.append(self.BOS)
            text = text[3:]
        return ids + [2 + ord(c) % 90 for c in text]


def test_chat_prompt_gets_no_second_bos():
    ids = encode_prompt(BosTokenizer(), messages=[{"role": "user", "content": "hi"}], max_prompt_tokens=100)
    assert ids[0] == BosTokenizer.BOS and ids[1] != BosTokenizer.BOS
    plain = encode_prompt(BosTokenizer(), prompt="hi", max_prompt_tokens=100)
    assert plain[0] == BosTokenizer.BOS  # plain text still gets the tokenizer's own BOS


def test_tokenizer_without_chat_template():
    tokenizer = BosTokenizer()
    tokenizer.chat_template = None
    with pytest.raises(PromptError, match="no chat template"):
        encode_prompt(tokenizer, messages=[{"role": "user", "content": "hi"}], max_prompt_tokens=100)


def test_template_errors_become_prompt_errors():
    class Picky(BosTokenizer):
        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            raise ValueError("Conversation roles must alternate user/assistant")

    with pytest.raises(PromptError, match="chat template rejected the messages: Conversation roles"):
        encode_prompt(Picky(), messages=[{"role": "user", "content": "hi"}], max_prompt_tokens=100)


class CountingTokenizer:
    """The real tokenizer, counting the characters it is given to encode."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.chars = tokenizer, 0
        self.chat_template = tokenizer.chat_template

    def __len__(self):
        return len(self.tokenizer)

    def apply_chat_template(self, *args, **kwargs):
        return self.tokenizer.apply_chat_template(*args, **kwargs)

    def encode(self, text, **kwargs):
        self.chars += len(text)
        return self.tokenizer.encode(text, **kwargs)


def test_a_prompt_far_past_the_limit_is_refused_from_its_head_alone(tokenizer):
    """The red team's 8 MB prompt stalled every request on the worker for 5.7 s while it was
    tokenized whole; now only a head of a few characters a token of the limit is."""
    text = "The quick brown fox jumps over the lazy dog. " * 20_000  # 900,000 characters
    counting = CountingTokenizer(tokenizer)
    with pytest.raises(PromptError, match=r"prompt is more than \d+ tokens, longer than the limit of 100 tokens"):
        encode_prompt(counting, prompt=text, max_prompt_tokens=100)
    assert counting.chars <= 8 * 108
    counting.chars = 0
    with pytest.raises(PromptError, match="longer than the limit of 100 tokens"):
        encode_prompt(counting, messages=[{"role": "user", "content": text}], max_prompt_tokens=100)
    assert counting.chars <= 8 * 108


def test_left_truncation_of_a_long_prompt_keeps_the_tokens_the_whole_text_ends_with(tokenizer):
    text = "".join(f"word{i} and then some more, " for i in range(20_000))
    counting = CountingTokenizer(tokenizer)
    ids = encode_prompt(counting, prompt=text, max_prompt_tokens=200, truncate="left")
    assert ids == tokenizer.encode(text)[-200:] and counting.chars <= 8 * 208


def test_a_long_prompt_of_few_tokens_is_still_served_whole(tokenizer):
    """Long past the head's window in characters yet within the limit in tokens (runs of dashes
    are a token of 64): the head alone proves nothing, so the whole text is tokenized and served."""
    text = "-" * 2000
    whole = tokenizer.encode(text)
    assert len(text) > 8 * (len(whole) + 8 + 8)
    assert encode_prompt(tokenizer, prompt=text, max_prompt_tokens=len(whole) + 8) == whole
