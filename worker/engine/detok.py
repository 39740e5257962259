"""Incremental detokenization: token ids in, final text deltas out, one request at a time.

Two things hold text back:
- a split character: byte-level tokens can end inside a multi-byte UTF-8 character, and
  the decoded tail then ends in U+FFFD. Nothing is released while it does; the next token
  usually completes the character (or shows the bytes really are invalid: the U+FFFD is
  then in the middle, is what tokenizer.decode gives too, and goes out).
- a possible stop string: text that could be the start of a stop string waits until the
  following text proves it is not. A completed stop string ends the request; neither it
  nor anything after it is ever released.

Only a small window of recent tokens is decoded per step (the prefix_offset/read_offset
technique known from vLLM): `prefix` is the text of ids[prefix_offset:read_offset], already
released, and decoding ids[prefix_offset:] gives it plus the new text. The window starts a
few prompt tokens back so that the first output token decodes with its real leading space.

A resumed request (its earlier attempt already emitted some output ids) gets those ids as
`emitted_ids`: they are replayed one token per add(), as the engine fed them, with the deltas
dropped (the earlier attempt released those). That leaves exactly the state of an undisturbed
run at that point, held-back text included: the half of a character, or the start of a stop
string, that the earlier attempt had not released yet comes out with the next tokens.

Contract: without a stop string, the deltas from add() plus finish() concatenate to exactly
tokenizer.decode(output_ids) with the same skip_special_tokens. finish() flushes a still
incomplete trailing character the way decode renders it (U+FFFD): the result text always
equals decode(output), and a reader can see it was cut mid-character. add() itself never
releases a U+FFFD that a later token would have turned into a character.
"""

from __future__ import annotations

from typing import Any, Sequence

REPLACEMENT = "\ufffd"
CONTEXT_TOKENS = 5  # prompt tokens decoded as context before the first output token


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int], stop: Sequence[str] = (),
                 skip_special_tokens: bool = True, emitted_ids: Sequence[int] = ()) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._stop = [s for s in stop if s]
        self._ids = list(prompt_ids[-CONTEXT_TOKENS:])
        self._read_offset = len(self._ids)
        self._prefix_offset = 0
        # Context that itself ends mid-character would blur the boundary: do without it.
        if self._decode(0, self._read_offset).endswith(REPLACEMENT):
            self._ids, self._read_offset = [], 0
        self._pending = ""  # decoded, final, not yet released (a possible stop-string start)
        self.stop_string: str | None = None
        self.finished = False
        for token in emitted_ids:  # one per add(), as the engine fed them: the same state results
            self.add([token])

    @property
    def stop_reached(self) -> bool:
        return self.stop_string is not None

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self._skip_special)

    def add(self, token_ids: Sequence[int]) -> str:
        """Take new output tokens; return the text that is now final (possibly "")."""
        if self.finished:
            return ""
        self._ids.extend(token_ids)
        prefix = self._decode(self._prefix_offset, self._read_offset)
        text = self._decode(self._prefix_offset)
        if len(text) <= len(prefix):
            return ""  # e.g. only skipped special tokens so far
        if text.endswith(REPLACEMENT):
            # A character is still incomplete: release nothing, but a stop string already
            # complete before it must end the request now, not one token later.
            if self._find_stop(self._pending + text[len(prefix):].rstrip(REPLACEMENT)) is None:
                return ""
            return self._release(text[len(prefix):].rstrip(REPLACEMENT))
        # The released window moves up: the next decode starts where this one was read to.
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return self._release(text[len(prefix):])

    def finish(self) -> str:
        """The request ended for another reason (length, EOS, cancel): flush what is held."""
        if self.finished:
            return ""
        prefix = self._decode(self._prefix_offset, self._read_offset)
        tail = self._decode(self._prefix_offset)[len(prefix):]
        delta = self._release(tail, final=True)
        self.finished = True
        return delta

    def _release(self, new_text: str, final: bool = False) -> str:
        text = self._pending + new_text
        # A stop string cannot start in released text (it would have been held), so the
        # pending text is the only place to look. The earliest match wins.
        match = self._find_stop(text)
        if match is not None:
            at, self.stop_string = match
            self._pending, self.finished = "", True
            return text[:at]
        hold = 0 if final else self._stop_prefix_length(text)
        self._pending = text[len(text) - hold:]
        return text[: len(text) - hold]

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        """The earliest stop string in `text` (the shortest on a tie), as (index, string)."""
        found = [(text.find(s), len(s), s) for s in self._stop]
        found = [(at, n, s) for at, n, s in found if at >= 0]
        if not found:
            return None
        at, _, stop = min(found)
        return at, stop

    def _stop_prefix_length(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        longest = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:k]):
                    longest = k
                    break
        return longest
