"""A JSON schema for structured output is checked before it reaches a worker.

OpenVINO GenAI compiles the schema (with XGrammar) inside the continuous-batching step, and a
schema it cannot compile throws there and leaves the pipeline unusable: every request on that
worker fails and the worker restarts. Measured: not JSON, a root that is not an object, an
unknown or mistyped `type`, an unresolved `$ref`, a pattern that is not a regex, `minimum`
above `maximum` (or minItems above maxItems, or exclusive bounds that leave no number), an
empty `enum`/`anyOf`, an object or array whose counts no value fits, a `false` subschema, and
regex constructs Python accepts but XGrammar does not each did that. So
every schema (response formats and tool parameters alike, see gateway/api/request_path.py) is walked
here once, in time linear in its size, and refused with a 400 naming what is wrong.

Work and memory are linear in the schema's text: each subschema is one node, counted as it is
met against `max_schema_nodes` (and its nesting against `max_schema_depth`, protocol/config/)
before its children are queued. A node's place (`#/properties/x/anyOf/3`) is a link to its
parent's, spelled out only for an error message, each name cut to NAME_CHARS. NOTE: built up
front, one 256 KiB property name holding `anyOf` of 4,000 subschemas made 4,000 copies of it:
1 GiB of paths for a 279 KiB body (issue 27).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any, TypeAlias

from npu_proxy.gateway.content.regex_budget import too_costly
from npu_proxy.gateway.core.errors import invalid

TYPES = frozenset({"string", "number", "integer", "boolean", "object", "array", "null"})
_SCHEMA = ("not", "additionalProperties", "items", "additionalItems", "contains",
           "propertyNames", "if", "then", "else", "unevaluatedProperties", "unevaluatedItems")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf")
_PAIRS = (("minimum", "maximum"), ("minLength", "maxLength"), ("minItems", "maxItems"),
          ("minProperties", "maxProperties"))
# NOTE: what XGrammar takes. An integer's bound outside int64 (as a double) or not whole fails
# a check inside the pipeline's step (seen: `minimum: 1e19`, `exclusiveMinimum: 9.3e18`, type
# ["integer", "null"] with `minimum: 1e19` aborted the process, killing the llm worker with
# every stream on it: issue 43); 2**53 is where doubles stop being whole numbers. A count
# (maxLength, maxItems, ...) beyond int64 is read as a double and fails the same way.
MAX_INTEGER = 2**53
MAX_COUNT = 2**31 - 1
MAX_NODES = 20_000
MAX_DEPTH = 64
MAX_CHARS = 15_000
MAX_ENUM = 1_000
NAME_CHARS = 64

# A node's place: its parent's place and its own name within it (None: the root, `#`).
Where: TypeAlias = tuple["Where", str] | None


class SchemaError(ValueError):
    pass


def spell(where: Where) -> str:
    """A place as a JSON pointer, each name cut to NAME_CHARS characters."""
    parts: list[str] = []
    while where is not None:
        where, name = where
        parts.append(name if len(name) <= NAME_CHARS else name[:NAME_CHARS] + "…")
    return "/".join(["#", *reversed(parts)])


def check_schema(text: str, max_nodes: int = MAX_NODES, max_depth: int = MAX_DEPTH,
                 max_chars: int = MAX_CHARS, max_enum: int = MAX_ENUM) -> None:
    """Raise a 400 when the schema is one a worker could not compile, or is larger than
    `max_nodes` subschemas, deeper than `max_depth`, has more than `max_chars` characters
    of names and literals or more than `max_enum` enum values."""
    try:
        walk(json.loads(text), max_nodes, max_depth, max_chars, max_enum)
    except (ValueError, RecursionError) as exc:
        raise invalid(f"invalid JSON schema for structured output: {exc}") from None


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def walk(root: Any, max_nodes: int = MAX_NODES, max_depth: int = MAX_DEPTH,
         max_chars: int = MAX_CHARS, max_enum: int = MAX_ENUM) -> int:
    """Check every subschema of `root`; the number of them."""
    if not isinstance(root, dict):
        raise SchemaError("the schema must be a JSON object")
    stack: list[tuple[Any, Where, int]] = [(root, None, 0)]
    met = 1
    chars = 0
    values = 0

    def spend(n: int) -> None:
        # Names and literals the worker's grammar spells out (OpenAI counts the same ones).
        nonlocal chars
        chars += n
        if chars > max_chars:
            raise SchemaError(f"the schema's property names, definition names and enum/const "
                              f"strings pass {max_chars} characters (max_schema_chars)")

    def queue(children: list[tuple[Any, Where]], depth: int) -> None:
        nonlocal met
        met += len(children)
        if met > max_nodes:
            raise SchemaError(f"the schema has more than {max_nodes} subschemas "
                              "(max_schema_nodes)")
        if depth > max_depth:
            raise SchemaError(f"the schema nests deeper than {max_depth} levels "
                              "(max_schema_depth)")
        stack.extend((child, where, depth) for child, where in children)

    while stack:
        node, where, depth = stack.pop()
        if isinstance(node, bool):
            continue
        if not isinstance(node, dict):
            raise SchemaError(f"{spell(where)} must be a schema (an object or a boolean)")
        _check_node(root, node, where)
        if isinstance(node.get("enum"), list):
            # NOTE: each value is one alternative the worker's grammar compiles while every
            # stream on it waits (200,000 integers held them 8 s): OpenAI's own limit.
            values += len(node["enum"])
            if values > max_enum:
                raise SchemaError(f"the schema has more than {max_enum} enum values "
                                  "(max_schema_enum_values)")
        spend(sum(len(v) for v in node.get("enum", ()) if isinstance(v, str))
              + (len(node["const"]) if isinstance(node.get("const"), str) else 0))
        for key in _SCHEMA:
            if key in node:
                sub = node[key]
                if key == "items" and isinstance(sub, list):
                    at: Where = (where, "items")
                    queue([(s, (at, str(i))) for i, s in enumerate(sub)], depth + 1)
                else:
                    queue([(sub, (where, key))], depth + 1)
        for key in _SCHEMA_LISTS:
            if key in node:
                subs = node[key]
                if not isinstance(subs, list) or not subs:
                    raise SchemaError(f"{spell((where, key))} must be a non-empty array of "
                                      "schemas")
                at = (where, key)
                _no_false(key, enumerate(subs), at)
                queue([(s, (at, str(i))) for i, s in enumerate(subs)], depth + 1)
        for key in _SCHEMA_MAPS:
            if key in node:
                subs = node[key]
                if not isinstance(subs, dict):
                    raise SchemaError(f"{spell((where, key))} must be an object of schemas")
                at = (where, key)
                spend(sum(len(name) for name in subs))
                if key == "patternProperties":
                    for pattern in subs:
                        _regex(pattern, partial(spell, at))
                _no_false(key, subs.items(), at)
                queue([(s, (at, name)) for name, s in subs.items()], depth + 1)
    return met


def _no_false(key: str, subs: Iterable[tuple[Any, Any]], at: Where) -> None:
    if key in _NO_FALSE:
        for name, sub in subs:
            if sub is False:
                raise SchemaError(f"{spell((at, str(name)))} is `false`, a schema no value "
                                  "satisfies: leave it out")


def _check_node(root: dict[str, Any], node: dict[str, Any], at: Where) -> None:
    def fail(tail: str) -> SchemaError:
        return SchemaError(spell(at) + tail)

    if "type" in node:
        kind = node["type"]
        kinds = kind if isinstance(kind, list) else [kind]
        if not kinds or not all(isinstance(k, str) and k in TYPES for k in kinds):
            raise fail(f"/type must be one of {sorted(TYPES)} or a list of them")
    if "enum" in node and (not isinstance(node["enum"], list) or not node["enum"]):
        raise fail("/enum must be a non-empty array")
    if "required" in node and (not isinstance(node["required"], list) or not all(
            isinstance(r, str) for r in node["required"])):
        raise fail("/required must be an array of strings")
    for key in _COUNTS:
        if key in node and (not isinstance(node[key], int) or isinstance(node[key], bool)
                            or not 0 <= node[key] <= MAX_COUNT):
            raise fail(f"/{key} must be an integer from 0 to {MAX_COUNT}")
    for key in _BOUNDS:
        if key in node and not (_number(node[key]) and math.isfinite(node[key])):
            raise fail(f"/{key} must be a finite number")
    if _integer(node):
        for key in _BOUNDS[:4]:
            if key in node and (node[key] != int(node[key]) or abs(node[key]) > MAX_INTEGER):
                raise fail(f"/{key} of an integer must be a whole number from -{MAX_INTEGER} "
                           f"to {MAX_INTEGER}")
    for low, high in _PAIRS:
        if low in node and high in node and node[low] > node[high]:
            raise fail(f": {low} {node[low]} is above {high} {node[high]}")
    if _no_number_between(node):
        raise fail(": no number lies within its minimum/maximum and exclusive bounds")
    empty = _empty_container(node)
    if empty:
        raise fail(f": {empty}")
    if "pattern" in node:
        _regex(node["pattern"], lambda: spell((at, "pattern")))
    if "$ref" in node:
        _resolve(root, node["$ref"], at)


def _integer(node: dict[str, Any]) -> bool:
    """Is `integer` the node's type, or one of its types?"""
    kind = node.get("type")
    return kind == "integer" or (isinstance(kind, list) and "integer" in kind)


def _no_number_between(node: dict[str, Any]) -> bool:
    """The bounds leave nothing: `exclusiveMinimum: 0` with `maximum: 0`, or for an integer
    `exclusiveMinimum: 0` with `exclusiveMaximum: 1`.

    NOTE: XGrammar turns the bounds into a range and fails the whole step when it is empty
    (seen: a replayed client's tool, `exclusiveMinimum: 0, maximum: 0`, under tool_choice
    auto, killed the llm worker and every request on it).
    """
    lows = [(node[k], k == "exclusiveMinimum") for k in ("minimum", "exclusiveMinimum")
            if k in node]
    highs = [(node[k], k == "exclusiveMaximum") for k in ("maximum", "exclusiveMaximum")
             if k in node]
    if not lows or not highs:
        return False
    low, low_open = max(lows)  # NOTE: at the same value the exclusive bound is the tighter
    high, high_open = min(highs, key=lambda bound: (bound[0], not bound[1]))
    if not all(math.isfinite(v) for v in (low, high)):
        return False
    if node.get("type") == "integer":
        first = math.floor(low) + 1 if low_open else math.ceil(low)
        last = math.ceil(high) - 1 if high_open else math.floor(high)
        return bool(first > last)
    return bool(low > high or (low == high and (low_open or high_open)))


def _empty_container(node: dict[str, Any]) -> str | None:
    """Why no object or array can satisfy the node's counts, if none can.

    NOTE: measured (2026-11-28): XGrammar fails the whole step on each of these, as on
    empty number ranges; it treats an object without `additionalProperties` as closed.
    """
    required = node.get("required", [])
    named = node.get("properties", {})
    if "maxProperties" in node and node["maxProperties"] < len(required):
        return f"maxProperties {node['maxProperties']} is below its {len(required)} required"
    closed = node.get("additionalProperties", False) is False and "patternProperties" not in node
    if closed and isinstance(named, dict) and node.get("minProperties", 0) > len(named):
        return (f"minProperties {node['minProperties']} is above the {len(named)} properties "
                "it allows")
    prefix = node.get("prefixItems", [])
    if isinstance(prefix, list):
        if "maxItems" in node and node["maxItems"] < len(prefix):
            return f"maxItems {node['maxItems']} is below its {len(prefix)} prefixItems"
        if node.get("items") is False and node.get("minItems", 0) > len(prefix):
            return (f"minItems {node['minItems']} is above the {len(prefix)} items "
                    "it allows")
    return None


# Schemas holding `false` where XGrammar fails the step (measured; `items: false` and an
# unused `$defs` entry compile).
_NO_FALSE = frozenset({"anyOf", "oneOf", "allOf", "prefixItems", "properties",
                       "patternProperties", "dependentSchemas"})


# Escapes XGrammar's regex converter refuses (word boundaries, backreferences, Unicode
# classes and names); any `(?` group but `(?:` (lookaround, names, flags) is refused as well.
_UNSUPPORTED_ESCAPES = frozenset("bBkNpP123456789")
_COUNT = re.compile(r"\{\d+(,\d*)?\}")


def _regex(pattern: Any, where: Callable[[], str]) -> None:
    """Refuse a regex XGrammar cannot compile; `where()` names its place (spelt on error).

    NOTE: measured one by one in a worker (2026-11-28): each construct refused here is
    valid for Python's `re` and made the batch step throw, which kills the worker and every
    request on it. Near forms that compile (`a+?`, `a|`, `(a|)`, `[^]a]`, `[a*+]`, `\\{`,
    `}`) pass.
    """
    if not isinstance(pattern, str):
        raise SchemaError(f"{where()} must be a string")
    try:
        re.compile(pattern)
    except re.error as exc:
        raise SchemaError(f"{where()} is not a regular expression: {exc}") from None
    problem = _unsupported(pattern)
    if problem:
        raise SchemaError(f"{where()}: {problem} is not supported in patterns")
    costly = too_costly(pattern)
    if costly:
        raise SchemaError(f"{where()} is too costly to compile: {costly}")


def _unsupported(pattern: str) -> str | None:
    """The first construct of `pattern` (one `re` accepts) that XGrammar cannot compile."""
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            if i + 1 < n and pattern[i + 1] in _UNSUPPORTED_ESCAPES:
                return "\\" + pattern[i + 1]
            i += 2
        elif c == "[":
            if pattern.startswith("[]", i):
                return "a class whose first member is ']' (write '\\]')"
            i = _class_end(pattern, i + 2 if pattern.startswith("[^", i) else i + 1)
        elif c == "(":
            if pattern.startswith("(?", i) and not pattern.startswith("(?:", i):
                return f"the group {pattern[i:i + 3]!r} (only (?:...) is)"
            i += 3 if pattern.startswith("(?:", i) else 1
            if pattern.startswith("|", i):
                return "an empty alternative after '('"
        elif c == "|":
            if pattern.startswith("|", i + 1):
                return "an empty alternative ('||')"
            i += 1
        else:
            end = _quantifier_end(pattern, i)
            if end == i:
                if c == "{":
                    return "a '{' that starts no {m}, {m,} or {m,n} (write '\\{')"
                i += 1
                continue
            if pattern.startswith("+", end):
                return "a possessive quantifier"
            i = end + pattern.startswith("?", end)  # NOTE: `a+?` is lazy: it compiles
    return None


def _quantifier_end(pattern: str, i: int) -> int:
    """The index after a quantifier (`*`, `+`, `?`, `{m,n}`) starting at `i`, else `i`."""
    if pattern[i] in "*+?":
        return i + 1
    count = _COUNT.match(pattern, i)
    return count.end() if count else i


def _class_end(pattern: str, i: int) -> int:
    """The index after the `]` closing a character class whose body starts at `i`."""
    if pattern.startswith("]", i):
        i += 1  # NOTE: `[^]...]`: a first `]` is a member
    while i < len(pattern) and pattern[i] != "]":
        i += 2 if pattern[i] == "\\" else 1
    return i + 1


def check_regex(pattern: str) -> None:
    """Raise a 400 when a structured-output regex is one a worker could not compile.

    NOTE: measured: a raw NUL in the regex crashed the worker (SIGSEGV in XGrammar), and raw
    control characters in a class made it throw; escaped (`\\x00`) they compile.
    """
    bad = next((c for c in pattern if ord(c) < 32 and c not in "\t\n\r"), None)
    if bad is not None:
        raise invalid(f"invalid regex for structured output: control character {bad!r}; "
                      "write it escaped (\\xNN)", param="structured_outputs")
    try:
        _regex(pattern, lambda: "the regex")
    except SchemaError as exc:
        raise invalid(f"invalid regex for structured output: {exc}", param="structured_outputs"
                      ) from None


def _resolve(root: dict[str, Any], ref: Any, at: Where) -> None:
    """Only references inside the schema itself (`#/...`) can be compiled."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        raise SchemaError(f"{spell(at)}/$ref must point inside the schema (\"#/...\")")
    target: Any = root
    for part in ref[1:].split("/")[1:] if ref != "#" else []:
        name = part.replace("~1", "/").replace("~0", "~")
        if isinstance(target, dict) and name in target:
            target = target[name]
        elif isinstance(target, list) and name.isdigit() and int(name) < len(target):
            target = target[int(name)]
        else:
            raise SchemaError(f"{spell(at)}/$ref {ref[:NAME_CHARS]!r} points at nothing in "
                              "the schema")
