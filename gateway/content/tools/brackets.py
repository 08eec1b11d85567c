"""Where a JSON value or a Python literal that a model writes closes: one linear scan of its
brackets, strings skipped, that can be fed the text as it grows (a streamed reply).

NOTE: a double-quoted string may span lines (models put real line breaks in code they pass
as an argument; JSON is read with strict=False), a single-quoted one may not: a Python string
past its line is no literal, and an apostrophe in prose opens no string past its line.
"""

from __future__ import annotations

_PAIRS = {"{": "}", "[": "]", "(": ")"}
_CLOSERS = frozenset(_PAIRS.values())


class Brackets:
    """The brackets opened at `start` of a text, scanned as far as `scan` has been given it.
    `scan` returns None while they are open, else where the scan ended (one past it):
    `closed` says whether they closed there or can never close (a wrong closer, a
    single-quoted string past its line)."""

    def __init__(self, start: int) -> None:
        self._pos = start
        self._stack: list[str] = []
        self._quote = ""
        self._escaped = False
        self.closed = False

    def scan(self, text: str, limit: int | None = None) -> int | None:
        """Scan on through `text` (the same text, grown), up to `limit` if given."""
        stop = len(text) if limit is None else min(len(text), limit)
        stack = self._stack
        i = self._pos
        while i < stop:
            c = text[i]
            i += 1
            if self._quote:
                if self._escaped:
                    self._escaped = False
                elif c == "\\":
                    self._escaped = True
                elif c == self._quote:
                    self._quote = ""
                elif c == "\n" and self._quote == "'":
                    return self._end(i, closed=False)
            elif c in "'\"":
                self._quote = c
            elif c in _PAIRS:
                stack.append(_PAIRS[c])
            elif c in _CLOSERS:
                if not stack or stack.pop() != c:
                    return self._end(i, closed=False)
                if not stack:
                    return self._end(i, closed=True)
        self._pos = i
        return None

    def _end(self, at: int, closed: bool) -> int:
        self._pos, self.closed = at, closed
        return at
