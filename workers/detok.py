"""Incremental detokenization: text for each new token as soon as it is complete.

OpenVINO GenAI's TextStreamer holds a few tokens back before it releases text, which costs
the first token ~50 ms on this CPU (measured). This decodes a short window instead, once per
push: what the window's text adds to what it has already released is new text, unless it
ends in an incomplete UTF-8 sequence (U+FFFD), which waits for the next token. (Decoding the
window with and without the newest tokens, twice per token, was two thirds of the worker's
Python time per decode step: about 0.45 ms of a 10 ms step, measured with py-spy.)

For logprobs, tokens are pushed one at a time, so each token's piece of the text is known:
a character split across tokens is the piece of the token that completes it. `TokenBytes`
gives a token's exact bytes from the vocabulary.
"""

from __future__ import annotations

from typing import Any

_INCOMPLETE = "\ufffd"


class Detokenizer:
    """The text of a window of tokens, decoded once per push: what it adds to the window's
    text already released is new. The window starts where the previous one's last release
    began (so a tokenizer that drops a leading space, or merges pieces, sees the context it
    needs) and slides every WINDOW tokens, which costs one more decode then."""

    WINDOW = 8

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # start of the decoding window
        self.read = 0  # tokens whose text has been released
        self.last = 0  # where the last release began
        self.shown = ""  # the text of ids[prefix:read]

    def _text(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True)) if ids else ""

    @property
    def released(self) -> int:
        """How many of the tokens pushed have had their text released."""
        return self.read

    def push(self, new_ids: list[int]) -> str:
        """New text for these tokens ("" while a character is incomplete)."""
        self.ids.extend(new_ids)
        after = self._text(self.ids[self.prefix:])
        if after.endswith(_INCOMPLETE) or len(after) <= len(self.shown):
            return ""
        new = after[len(self.shown):]
        self.last, self.read, self.shown = self.read, len(self.ids), after
        if self.read - self.prefix > self.WINDOW:
            self.prefix = self.last
            self.shown = self._text(self.ids[self.prefix:self.read])
        return new

    def flush(self) -> str:
        """Whatever is left at the end, even an incomplete character."""
        after = self._text(self.ids[self.prefix:])
        rest = after[len(self.shown):] if len(after) > len(self.shown) else ""
        self.prefix = self.last = self.read = len(self.ids)
        self.shown = ""
        return rest


class TokenBytes:
    """A token's exact bytes, as it stands in the text: its vocabulary entry, or nothing for
    a special token (end of turn...), which decoding leaves out of the text."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._vocab: dict[int, bytes] | None = None
        self._special: dict[int, bool] = {}
        self._size: int | None = None

    def _entries(self) -> dict[int, bytes]:
        if self._vocab is None:
            # NOTE: read on the first request that asks, not at load: 49k entries for SmolLM2.
            self._vocab = {int(i): bytes(b) for b, i in self.tokenizer.get_vocab().items()}
        return self._vocab

    @property
    def vocab_size(self) -> int:
        """One more than the largest token id."""
        if self._size is None:
            self._size = max(self._entries(), default=-1) + 1
        return self._size

    def entry(self, token: int) -> bytes:
        """The token's vocabulary entry, a special token's name included."""
        return self._entries().get(token, b"")

    def __call__(self, token: int) -> bytes:
        special = self._special.get(token)
        if special is None:
            # NOTE: a piece of a split character decodes to "" either way; a special token
            # only when skipped.
            shown = self.tokenizer.decode([token], skip_special_tokens=False)
            kept = self.tokenizer.decode([token], skip_special_tokens=True)
            special = self._special[token] = bool(shown) and not kept
        return b"" if special else self._entries().get(token, b"")
