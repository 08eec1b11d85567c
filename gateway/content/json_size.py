"""A decoded JSON value's depth and the length of its text, measured without building it.

Tool definitions are turned into prompt text with `json.dumps`, which can be longer than
what was sent (1e15 becomes 1000000000000000.0) and recurses (parameters nested 400 to 900
deep gave a 500 with a traceback). `measure` walks the value once, without recursion, so
both are known, and refused, before any text is made.
"""

from __future__ import annotations

from typing import Any

from npu_proxy.gateway.core.errors import invalid

# NOTE: real tool schemas nest a few levels (an object of arrays of objects is 5); this is far
# above any of them and far below where json.dumps and the chat template's Jinja recurse out.
MAX_DEPTH = 64


def _text(s: str) -> int:
    """An upper bound of the characters of `json.dumps(s, ensure_ascii=False)`."""
    if s.isprintable():
        return len(s) + 2 + s.count('"') + s.count("\\")
    return 6 * len(s) + 2  # NOTE: at worst every character is a \uXXXX escape


def measure(value: Any, where: str, param: str = "tools") -> int:
    """An upper bound of the characters `json.dumps(value, ensure_ascii=False)` writes; a 400
    naming `where` when the value nests deeper than MAX_DEPTH."""
    size = 0
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            if depth > MAX_DEPTH:
                raise invalid(f"{where} nests deeper than {MAX_DEPTH} levels", param=param)
            size += 2 + 2 * max(len(node) - 1, 0)
            for key, item in node.items():
                size += _text(str(key)) + 2
                stack.append((item, depth + 1))
        elif isinstance(node, list):
            if depth > MAX_DEPTH:
                raise invalid(f"{where} nests deeper than {MAX_DEPTH} levels", param=param)
            size += 2 + 2 * max(len(node) - 1, 0)
            stack.extend((item, depth + 1) for item in node)
        elif isinstance(node, str):
            size += _text(node)
        elif isinstance(node, bool) or node is None:
            size += 5
        elif isinstance(node, float):
            size += len(repr(node))
        elif isinstance(node, int):
            size += node.bit_length() // 3 + 2  # NOTE: log10(2) < 1/3; no str() of a huge int
        else:
            size += len(str(node))
    return size
