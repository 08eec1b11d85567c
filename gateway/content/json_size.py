"""A decoded JSON value's depth and the length of its text, measured without building it.

Tool definitions are turned into prompt text with `json.dumps`, which can be longer than
what was sent (1e15 becomes 1000000000000000.0) and recurses (parameters nested 400 to 900
deep gave a 500 with a traceback). `measure` walks the value once, without recursion, so
both are known, and refused, before any text is made. Given a limit it stops as soon as the
size passes it: every node adds at least one character, so the nodes it visits are bounded
by the limit, not by the body (an enum of 400,000 numbers held the event loop for seconds).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from npu_proxy.gateway.core.errors import GatewayError, invalid

# NOTE: real tool schemas nest a few levels (an object of arrays of objects is 5); this is far
# above any of them and far below where json.dumps and the chat template's Jinja recurse out.
MAX_DEPTH = 64


def _text(s: str) -> int:
    """An upper bound of the characters of `json.dumps(s, ensure_ascii=False)`."""
    if s.isprintable():
        return len(s) + 2 + s.count('"') + s.count("\\")
    return 6 * len(s) + 2  # NOTE: at worst every character is a \uXXXX escape


def _scalar(node: Any) -> int:
    if isinstance(node, str):
        return _text(node)
    if isinstance(node, bool) or node is None:
        return 5
    if isinstance(node, float):
        return len(repr(node))
    if isinstance(node, int):
        return node.bit_length() // 3 + 2  # NOTE: log10(2) < 1/3; no str() of a huge int
    return len(str(node))


def measure(value: Any, where: str, param: str = "tools", limit: int | None = None) -> int:
    """An upper bound of the characters `json.dumps(value, ensure_ascii=False)` writes; a 400
    naming `where` when the value nests deeper than MAX_DEPTH. With a `limit`, the walk ends
    as soon as the size passes it and that partial size (above the limit) is returned."""
    bound = limit if limit is not None else -1
    size = 0
    # NOTE: containers are pushed as iterators, not as their items: a list of a million items
    # costs nothing until its items are reached, so stopping at the limit stops the work.
    stack: list[tuple[Iterator[Any], int]] = [(iter((value,)), 0)]
    while stack:
        items, depth = stack[-1]
        node = next(items, _END)
        if node is _END:
            stack.pop()
            continue
        if isinstance(node, dict):
            if depth >= MAX_DEPTH:
                raise invalid(f"{where} nests deeper than {MAX_DEPTH} levels", param=param)
            size += 2 + 2 * max(len(node) - 1, 0)
            stack.append((_pairs(node), depth + 1))
        elif isinstance(node, list):
            if depth >= MAX_DEPTH:
                raise invalid(f"{where} nests deeper than {MAX_DEPTH} levels", param=param)
            size += 2 + 2 * max(len(node) - 1, 0)
            stack.append((iter(node), depth + 1))
        elif isinstance(node, _Key):
            size += _text(node.key) + 2
        else:
            size += _scalar(node)
        if 0 <= bound < size:
            return size
    return size


class _Key:
    """A dict's key in the walk (its text and the `: ` after it), apart from a string value."""

    __slots__ = ("key",)

    def __init__(self, key: Any) -> None:
        self.key = str(key)


def _pairs(node: dict[Any, Any]) -> Iterator[Any]:
    for key, item in node.items():
        yield _Key(key)
        yield item


_END = object()


class ToolBudget:
    """The characters the tools of one request may add to its prompt (`max_prompt_chars`),
    charged tool by tool so that measuring stops once they pass it."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def charge(self, value: Any, where: str) -> int:
        """`measure(value)` within what is left: a 400 (`context_length_exceeded`, as for a
        prompt too long) as soon as the tools so far pass the limit."""
        size = measure(value, where, limit=self.limit - self.used)
        self.used += size
        if self.used > self.limit:
            raise GatewayError(400, "context_length_exceeded",
                               f"prompt is too long: the tools' definitions pass the limit of "
                               f"{self.limit} characters (max_prompt_chars)", param="tools")
        return size
