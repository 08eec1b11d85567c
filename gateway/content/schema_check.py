"""A JSON schema for structured output is checked before it reaches a worker.

OpenVINO GenAI compiles the schema (with XGrammar) inside the continuous-batching step, and a
schema it cannot compile throws there and leaves the pipeline unusable: every request on that
worker fails and the worker restarts. Measured: not JSON, a root that is not an object, an
unknown or mistyped `type`, an unresolved `$ref`, a pattern that is not a regex, `minimum`
above `maximum` (or minItems above maxItems), and an empty `enum`/`anyOf` each did that. So
every schema (response formats and tool parameters alike, see gateway/api/request_path.py) is walked
here once, in time linear in its size, and refused with a 400 naming what is wrong.
"""

from __future__ import annotations

import json
import re
from typing import Any

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
MAX_NODES = 20_000
MAX_DEPTH = 64


class SchemaError(ValueError):
    pass


def check_schema(text: str) -> None:
    """Raise a 400 when the schema is one a worker could not compile."""
    try:
        _walk(json.loads(text))
    except (ValueError, RecursionError) as exc:
        raise invalid(f"invalid JSON schema for structured output: {exc}") from None


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _walk(root: Any) -> None:
    if not isinstance(root, dict):
        raise SchemaError("the schema must be a JSON object")
    stack: list[tuple[Any, str, int]] = [(root, "#", 0)]
    seen = 0
    while stack:
        node, where, depth = stack.pop()
        seen += 1
        if seen > MAX_NODES or depth > MAX_DEPTH:
            raise SchemaError(f"the schema is too large (over {MAX_NODES} subschemas or "
                              f"{MAX_DEPTH} levels)")
        if isinstance(node, bool):
            continue
        if not isinstance(node, dict):
            raise SchemaError(f"{where} must be a schema (an object or a boolean)")
        _check_node(root, node, where)
        for key in _SCHEMA:
            if key in node:
                sub = node[key]
                if key == "items" and isinstance(sub, list):
                    stack.extend((s, f"{where}/items/{i}", depth + 1) for i, s in enumerate(sub))
                else:
                    stack.append((sub, f"{where}/{key}", depth + 1))
        for key in _SCHEMA_LISTS:
            if key in node:
                subs = node[key]
                if not isinstance(subs, list) or not subs:
                    raise SchemaError(f"{where}/{key} must be a non-empty array of schemas")
                stack.extend((s, f"{where}/{key}/{i}", depth + 1) for i, s in enumerate(subs))
        for key in _SCHEMA_MAPS:
            if key in node:
                subs = node[key]
                if not isinstance(subs, dict):
                    raise SchemaError(f"{where}/{key} must be an object of schemas")
                if key == "patternProperties":
                    for pattern in subs:
                        _regex(pattern, f"{where}/{key}")
                stack.extend((s, f"{where}/{key}/{name}", depth + 1) for name, s in subs.items())


def _check_node(root: dict[str, Any], node: dict[str, Any], where: str) -> None:
    if "type" in node:
        kind = node["type"]
        kinds = kind if isinstance(kind, list) else [kind]
        if not kinds or not all(isinstance(k, str) and k in TYPES for k in kinds):
            raise SchemaError(f"{where}/type must be one of {sorted(TYPES)} or a list of them")
    if "enum" in node and (not isinstance(node["enum"], list) or not node["enum"]):
        raise SchemaError(f"{where}/enum must be a non-empty array")
    if "required" in node and (not isinstance(node["required"], list) or not all(
            isinstance(r, str) for r in node["required"])):
        raise SchemaError(f"{where}/required must be an array of strings")
    for key in _COUNTS:
        if key in node and (not isinstance(node[key], int) or isinstance(node[key], bool)
                            or node[key] < 0):
            raise SchemaError(f"{where}/{key} must be a non-negative integer")
    for key in _BOUNDS:
        if key in node and not _number(node[key]):
            raise SchemaError(f"{where}/{key} must be a number")
    for low, high in _PAIRS:
        if low in node and high in node and node[low] > node[high]:
            raise SchemaError(f"{where}: {low} {node[low]} is above {high} {node[high]}")
    if "pattern" in node:
        _regex(node["pattern"], f"{where}/pattern")
    if "$ref" in node:
        _resolve(root, node["$ref"], where)


# Escapes XGrammar's regex converter refuses (word boundaries, backreferences, Unicode
# classes); any `(?` group but `(?:` (lookaround, names, flags) is refused as well.
_UNSUPPORTED_ESCAPES = frozenset("bBkpP123456789")


def _regex(pattern: Any, where: str) -> None:
    if not isinstance(pattern, str):
        raise SchemaError(f"{where} must be a string")
    try:
        re.compile(pattern)
    except re.error as exc:
        raise SchemaError(f"{where} is not a regular expression: {exc}") from None
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\" and i + 1 < n:
            if pattern[i + 1] in _UNSUPPORTED_ESCAPES:
                raise SchemaError(f"{where}: \\{pattern[i + 1]} is not supported in patterns")
            i += 2
            continue
        if c == "(" and pattern.startswith("(?", i) and not pattern.startswith("(?:", i):
            raise SchemaError(f"{where}: only (?:...) groups are supported, not "
                              f"{pattern[i:i + 3]!r}")
        i += 1


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
        _regex(pattern, "the regex")
    except SchemaError as exc:
        raise invalid(f"invalid regex for structured output: {exc}", param="structured_outputs"
                      ) from None


def _resolve(root: dict[str, Any], ref: Any, where: str) -> None:
    """Only references inside the schema itself (`#/...`) can be compiled."""
    if not isinstance(ref, str) or not ref.startswith("#"):
        raise SchemaError(f"{where}/$ref must point inside the schema (\"#/...\")")
    target: Any = root
    for part in ref[1:].split("/")[1:] if ref != "#" else []:
        name = part.replace("~1", "/").replace("~0", "~")
        if isinstance(target, dict) and name in target:
            target = target[name]
        elif isinstance(target, list) and name.isdigit() and int(name) < len(target):
            target = target[int(name)]
        else:
            raise SchemaError(f"{where}/$ref {ref!r} points at nothing in the schema")
