"""Incremental detokenization: text for each new token as soon as it is complete.

OpenVINO GenAI's TextStreamer holds a few tokens back before it releases text, which costs
the first token ~50 ms on this CPU (measured). This decodes a short window instead: the
text of the window with and without the newest tokens; the difference is new text unless it
ends in an incomplete UTF-8 sequence (U+FFFD), which waits for the next token.
"""

from __future__ import annotations

from typing import Any

_INCOMPLETE = "\ufffd"


class Detokenizer:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # start of the decoding window
        self.read = 0  # tokens whose text has been released

    def _text(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True)) if ids else ""

    def push(self, new_ids: list[int]) -> str:
        """New text for these tokens ("" while a character is incomplete)."""
        self.ids.extend(new_ids)
        before = self._text(self.ids[self.prefix:self.read])
        after = self._text(self.ids[self.prefix:])
        if after.endswith(_INCOMPLETE) or len(after) <= len(before):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before):]

    def flush(self) -> str:
        """Whatever is left at the end, even an incomplete character."""
        before = self._text(self.ids[self.prefix:self.read])
        after = self._text(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return after[len(before):] if len(after) > len(before) else ""
