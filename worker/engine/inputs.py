"""Prompt -> token ids, in exactly one place. Truncation happens here and nowhere else.

A request brings exactly one of: `prompt` (plain text), `messages` (chat, rendered with
the tokenizer's chat template plus the assistant generation prompt) or `prompt_ids`
(already tokenized). A pinned prefix (Engine.pin) is encoded here too, its messages
without the generation prompt: the head of every conversation that goes on from them.
Anything wrong raises PromptError, which callers turn into an `error` event with the
message as the reason.
"""

from __future__ import annotations

from typing import Any, Literal

ROLES = ("system", "user", "assistant", "tool")
MESSAGE_KEYS = {"role", "content", "name", "tool_call_id"}
# Tokenizing costs microseconds a character (about 3 s for 2**20 of them here): a text far past
# the limit would stall the worker's loop. Past CHARS_PER_TOKEN_BOUND characters a token of the
# limit, only the part that decides is tokenized first: the head, which shows the text too long
# once it alone has more tokens than the limit (reject), or the tail, whose last tokens are what
# is kept (left). Cutting changes at most a few tokens next to the cut: CUT_SLACK_TOKENS.
CHARS_PER_TOKEN_BOUND = 8
CUT_SLACK_TOKENS = 8


class PromptError(ValueError):
    """The prompt cannot be served as given; the message says why."""


class PromptTooLong(PromptError):
    """The prompt (with the output asked for) does not fit the model length."""


def encode_prompt(
    tokenizer: Any,
    *,
    prompt: str | None = None,
    messages: list[dict] | None = None,
    prompt_ids: list[int] | None = None,
    max_prompt_tokens: int,
    truncate: Literal["reject", "left"] = "reject",
    vocab_size: int | None = None,
    add_generation_prompt: bool = True,
) -> list[int]:
    """Token ids for the one input given, at most `max_prompt_tokens` long.

    truncate="reject" refuses an over-long prompt; "left" keeps its last
    max_prompt_tokens tokens (the end of a prompt is what the answer continues).
    vocab_size defaults to len(tokenizer); pass the model's if its embedding is larger.
    """
    given = [name for name, value in (("prompt", prompt), ("messages", messages),
                                      ("prompt_ids", prompt_ids)) if value is not None]
    if len(given) != 1:
        raise PromptError("give exactly one of prompt, messages, prompt_ids; got "
                          + (", ".join(given) if given else "none"))
    if truncate not in ("reject", "left"):
        raise PromptError(f"truncate must be 'reject' or 'left', got {truncate!r}")
    if isinstance(max_prompt_tokens, bool) or not isinstance(max_prompt_tokens, int) \
            or max_prompt_tokens < 1:
        raise PromptError(f"max_prompt_tokens must be a positive int, got {max_prompt_tokens!r}")

    if prompt is not None:
        if not isinstance(prompt, str):
            raise PromptError(f"prompt must be a string, got {type(prompt).__name__}")
        if not prompt:
            raise PromptError("prompt is empty")
        ids, whole = _encode_text(tokenizer, prompt, max_prompt_tokens, truncate, add_special_tokens=True)
    elif messages is not None:
        # The rendered text already holds the template's special tokens (BOS, role markers);
        # letting encode add its own would double the BOS.
        ids, whole = _encode_text(tokenizer, _render_messages(tokenizer, messages, add_generation_prompt),
                                  max_prompt_tokens, truncate, add_special_tokens=False)
    else:
        ids, whole = _check_ids(prompt_ids, len(tokenizer) if vocab_size is None else vocab_size), True
    if not ids:
        raise PromptError("prompt encodes to no tokens")

    if len(ids) > max_prompt_tokens:
        if truncate == "reject":
            raise PromptTooLong(f"prompt is {'' if whole else 'more than '}{len(ids)} tokens, longer than the "
                              f"limit of {max_prompt_tokens} tokens")
        ids = ids[-max_prompt_tokens:]
    return ids


def _encode_text(tokenizer: Any, text: str, max_prompt_tokens: int, truncate: str,
                 add_special_tokens: bool) -> tuple[list[int], bool]:
    """-> (token ids, whether they are the whole text's). Only when the text is long past the
    limit are they a part's (see CHARS_PER_TOKEN_BOUND), and then more than the limit."""
    window = (max_prompt_tokens + CUT_SLACK_TOKENS) * CHARS_PER_TOKEN_BOUND
    if len(text) > window:
        ids = list(tokenizer.encode(text[:window] if truncate == "reject" else text[-window:],
                                    add_special_tokens=add_special_tokens))
        if len(ids) > max_prompt_tokens + CUT_SLACK_TOKENS:
            return (ids if truncate == "reject" else ids[CUT_SLACK_TOKENS:]), False
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens)), True


def _render_messages(tokenizer: Any, messages: Any, add_generation_prompt: bool) -> str:
    if not isinstance(messages, list) or not messages:
        raise PromptError("messages must be a non-empty list")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise PromptError(f"messages[{i}] must be an object, got {type(message).__name__}")
        unknown = set(message) - MESSAGE_KEYS
        if unknown:
            raise PromptError(f"messages[{i}] has unknown keys {sorted(unknown)}; "
                              f"allowed: {sorted(MESSAGE_KEYS)}")
        if message.get("role") not in ROLES:
            raise PromptError(f"messages[{i}].role must be one of {ROLES}, got {message.get('role')!r}")
        if not isinstance(message.get("content"), str):
            raise PromptError(f"messages[{i}].content must be a string, "
                              f"got {type(message.get('content')).__name__}")
    if not getattr(tokenizer, "chat_template", None):
        raise PromptError("this model's tokenizer has no chat template; send prompt or prompt_ids")
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as error:  # a template may raise on a role order it does not support
        raise PromptError(f"chat template rejected the messages: {error}") from error


def _check_ids(prompt_ids: Any, vocab_size: int) -> list[int]:
    if not isinstance(prompt_ids, (list, tuple)):
        raise PromptError(f"prompt_ids must be a list of ints, got {type(prompt_ids).__name__}")
    if not prompt_ids:
        raise PromptError("prompt_ids is empty")
    return check_token_ids(prompt_ids, vocab_size, "prompt_ids")


def check_token_ids(ids: Any, vocab_size: int, name: str) -> list[int]:
    """`ids` (called `name` in the error) as a list, if each is an int in the vocabulary."""
    for i, token in enumerate(ids):
        if isinstance(token, bool) or not isinstance(token, int):
            raise PromptError(f"{name}[{i}] must be an int, got {token!r}")
        if not 0 <= token < vocab_size:
            raise PromptError(f"{name}[{i}] = {token} is outside the vocabulary [0, {vocab_size})")
    return list(ids)
