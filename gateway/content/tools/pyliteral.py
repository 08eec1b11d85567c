"""A tool call a model wrote as a Python dict (`{'name': 'Read', 'arguments': {...}}`), read
as the JSON value it means.

NOTE: Qwen2.5-Coder-1.5B under Continue's `cn` wrote its one call so, single-quoted, in inline
backticks (issue 42): a call the client could have run, lost as text. Read with
`ast.literal_eval`, which evaluates literals only, after a linear scan bounds the dict: a
string may not span lines, and anything that is not plain JSON data (a set, bytes, a tuple
key, a complex number) makes it no call.
"""

from __future__ import annotations

import ast
import logging
import math
from typing import Any

from npu_proxy.gateway.content.tools.brackets import Brackets

# NOTE: literal_eval reads ~1 MB/s (0.35 s for a 300 kB dict, against JSON's ~50x faster) in
# the gateway's event loop: a longer Python dict is no call (it stays text).
MAX_LITERAL = 16_384
log = logging.getLogger(__name__)


def python_literal(text: str, pos: int) -> tuple[Any, int] | None:
    """The JSON value of the Python dict that begins at `pos`, and where it ends; None when
    none does."""
    end = _balanced_end(text, pos)
    if end is None:
        return None
    try:
        value = ast.literal_eval(text[pos:end])
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None
    data = _as_json(value)
    return None if data is _NOT_JSON else (data, end)


def _balanced_end(text: str, pos: int) -> int | None:
    """Where the dict opened at `pos` closes; None if it does not within MAX_LITERAL
    characters, or a string runs past its line."""
    if text[pos:pos + 1] != "{":
        return None
    scan = Brackets(pos)
    end = scan.scan(text, pos + MAX_LITERAL)
    if end is None and len(text) > pos + MAX_LITERAL and text.startswith("{'name'", pos):
        log.info("a tool call written as a Python dict longer than %d characters is left "
                 "as text", MAX_LITERAL)
    return end if end is not None and scan.closed else None


_NOT_JSON = object()


def _as_json(value: Any) -> Any:
    """`value` as JSON data (a tuple read as a list), or _NOT_JSON. Recursion is bounded by
    the parser's own nesting limit (a literal nested deeper is a SyntaxError above)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else _NOT_JSON  # 1e999 reads as inf
    if value is None or isinstance(value, bool | int | str):
        return value
    if isinstance(value, list | tuple):
        items = [_as_json(v) for v in value]
        return _NOT_JSON if any(v is _NOT_JSON for v in items) else items
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            return _NOT_JSON
        out = {k: _as_json(v) for k, v in value.items()}
        return _NOT_JSON if any(v is _NOT_JSON for v in out.values()) else out
    return _NOT_JSON
