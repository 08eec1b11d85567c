"""A JSON schema for structured output as the EBNF grammar OpenVINO GenAI takes, with bounded
whitespace between the JSON's tokens.

NOTE: GenAI's `StructuredOutputConfig(json_schema=...)` builds its grammar with XGrammar's
`any_whitespace` on, and its Python API has no switch for it: measured with the embedded
SmolLM2-135M, "Invent a person" under a two-field schema came back as
`{\\n\\n"name"\\n\\n:\\n\\n"name"\\n\\n,\\n\\n"age"\\n\\n:\\n\\n\\n\\n\\n…` until max_tokens, a
reply that never parses. So the subset of JSON Schema that clients send (objects with
properties and required, arrays with items and minItems/maxItems, strings with
minLength/maxLength, integers with bounds, numbers, booleans, null, enum, const,
anyOf/oneOf, local `$ref`s, nesting) is compiled here to EBNF whose whitespace rule is
llama.cpp's (what Ollama constrains with): nothing, a space, or one or two newlines and up to
20 spaces or tabs of indentation. A schema with anything else (a pattern, a format, number
bounds, additional-property schemas...) gets None and keeps GenAI's own compiler, as before.

Like XGrammar's strict mode, an object with properties allows no others, and properties come
in the schema's order. Digits are bounded too (16 before the point, 16 after, 3 of exponent),
as llama.cpp does, so a number cannot run to the token limit either. Work is linear in the
schema: each subschema is compiled once (each `$ref` target once, whatever points at it).
"""

from __future__ import annotations

import json
import math
from typing import Any

WS = r'ws ::= "" | " " | "\n" [ \t]{0,20} | "\n\n" [ \t]{0,20}'
GENERIC = {
    "value": "object | array | string | number | boolean | null",
    "object": '"{" ws ( member ( ws "," ws member )* ws )? "}"',
    "member": 'string ws ":" ws value',
    "array": '"[" ws ( value ( ws "," ws value )* ws )? "]"',
    "string": r'"\"" char* "\""',
    "char": r'[^"\\\x00-\x1f] | "\\" ( ["\\/bfnrt] | "u" [0-9a-fA-F]{4} )',
    "integer": '"-"? ( "0" | [1-9] [0-9]{0,15} )',
    "number": 'integer ( "." [0-9]{1,16} )? ( [eE] [-+]? [0-9]{1,3} )?',
    "boolean": '"true" | "false"',
    "null": '"null"',
}
# What a rule uses, so that only the rules a grammar needs are written out.
_USES = {"value": ("object", "array", "string", "number", "boolean", "null"),
         "object": ("member",), "member": ("string", "value"), "array": ("value",),
         "string": ("char",), "number": ("integer",)}
# Keywords that describe a value but do not constrain it.
_NOTES = frozenset({"title", "description", "examples", "default", "$schema", "$comment",
                    "deprecated", "readOnly", "writeOnly", "$defs", "definitions"})
_BY_TYPE = {
    "string": frozenset({"minLength", "maxLength"}),
    "integer": frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}),
    "number": frozenset(),
    "boolean": frozenset(),
    "null": frozenset(),
    "object": frozenset({"properties", "required", "additionalProperties"}),
    "array": frozenset({"items", "minItems", "maxItems"}),
}
# NOTE: integer bounds past this many digits are left to GenAI (the range rules grow with them).
MAX_DIGITS = 18


class Unsupported(Exception):
    """The schema uses something this compiler leaves to GenAI's own."""


def schema_grammar(text: str, padded: bool = False) -> str | None:
    """The EBNF grammar for the JSON schema `text`, or None when it uses anything outside the
    subset compiled here (GenAI's own json_schema compiler then takes it). `padded`: a
    newline may come before and after the value (a tool call between its tags)."""
    try:
        root = json.loads(text)
        return _Compiler(root).grammar(padded)
    except (Unsupported, ValueError, TypeError, RecursionError):
        return None


def garbled_name(text: str) -> str | None:
    """A property name GenAI's own schema compiler mishandles, if the schema `text` has one.

    NOTE: measured on GenAI 2026.4: a name with a quote or a control character makes the
    grammar it builds fail to compile, which fails the step and the worker with it (503
    worker_lost), and a backslash comes out as a control character (invalid JSON). Such a
    schema that this compiler does not take is refused instead (a 400)."""
    stack: list[Any] = [json.loads(text)]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            props = node.get("properties")
            if isinstance(props, dict):
                for name in props:
                    if any(c in '"\\' or c < " " for c in name):
                        return str(name)
            stack.extend(node.values())
    return None


def literal(text: str) -> str:
    """`text` as an EBNF string literal: printable ASCII as is, anything else escaped."""
    out = []
    for c in text:
        if c in '"\\':
            out.append("\\" + c)
        elif " " <= c <= "~":
            out.append(c)
        elif 0xD800 <= ord(c) <= 0xDFFF:
            raise Unsupported("a lone surrogate")
        else:
            out.append(f"\\u{ord(c):04x}" if ord(c) <= 0xFFFF else f"\\U{ord(c):08x}")
    return '"' + "".join(out) + '"'


def json_literal(value: Any) -> str:
    """The EBNF literal of a JSON value written compactly."""
    return literal(json.dumps(value, ensure_ascii=False, separators=(",", ":")))


def _count(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0 \
            or not math.isfinite(value) or value != int(value):
        raise Unsupported("a count that is not a whole number")
    return int(value)


def repeat(item: str, low: int, high: int | None) -> str:
    """`item` between `low` and `high` (None: no limit) times."""
    if high is None:
        return f"{item}*" if low == 0 else f"{item}{{{low},}}"
    if low > high:
        raise Unsupported("a minimum above its maximum")
    return f"{item}{{{low},{high}}}"


class _Compiler:
    def __init__(self, root: Any) -> None:
        self.root = root
        self.rules: dict[str, str] = {}
        self.generic: set[str] = set()
        self.refs: dict[str, str] = {}
        # $refs being compiled with no object or array opened since: met again, they would
        # recurse without consuming a character (left recursion), which GenAI cannot compile.
        self.bare: set[str] = set()

    def grammar(self, padded: bool = False) -> str:
        top = self.expr(self.root)
        if padded:
            top = f'( "" | "\\n" ) {top} ( "" | "\\n" )'
        lines = [f"root ::= {top}", *(f"{n} ::= {body}" for n, body in self.rules.items())]
        needed = set(self.generic)
        while True:
            more = {u for n in needed for u in _USES.get(n, ())} - needed
            if not more:
                break
            needed |= more
        lines += [f"{n} ::= {GENERIC[n]}" for n in GENERIC if n in needed]
        return "\n".join([*lines, WS]) + "\n"

    def use(self, name: str) -> str:
        self.generic.add(name)
        return name

    def rule(self, body: str) -> str:
        name = f"r{len(self.rules)}"
        self.rules[name] = body
        return name

    def expr(self, node: Any) -> str:
        """An EBNF expression for the values `node` allows."""
        if node is True:
            return self.use("value")
        if not isinstance(node, dict):
            raise Unsupported("a schema that allows nothing")
        keys = set(node) - _NOTES
        if not keys:
            return self.use("value")
        for key in ("$ref", "const", "enum", "anyOf", "oneOf", "allOf"):
            if key in keys:
                extra = keys - {key, "type"} if key in ("const", "enum") else keys - {key}
                if extra:
                    raise Unsupported(f"{key} next to {sorted(extra)}")
                return self.combined(key, node[key])
        kinds = node.get("type")
        if kinds is None:
            raise Unsupported("constraints without a type")
        kinds = kinds if isinstance(kinds, list) else [kinds]
        allowed = {"type"}.union(*(_BY_TYPE.get(k, frozenset()) for k in kinds))
        if keys - allowed or not kinds or not all(k in _BY_TYPE for k in kinds):
            raise Unsupported(f"keywords {sorted(keys - allowed)}")
        alternatives = [self.typed(node, kind) for kind in kinds]
        return alternatives[0] if len(alternatives) == 1 else \
            self.rule(" | ".join(alternatives))

    def combined(self, key: str, value: Any) -> str:
        if key == "$ref":
            return self.ref(value)
        if key == "const":
            return json_literal(value)
        if not isinstance(value, list) or not value:
            raise Unsupported(f"{key} that is not a non-empty list")
        if key == "enum":
            return self.rule(" | ".join(json_literal(v) for v in value))
        if key == "allOf":
            if len(value) != 1:
                raise Unsupported("allOf of more than one schema")
            return self.expr(value[0])
        return self.rule(" | ".join(self.expr(v) for v in value))

    def ref(self, pointer: Any) -> str:
        if not isinstance(pointer, str) or not (pointer == "#" or pointer.startswith("#/")):
            raise Unsupported("a $ref outside this schema")
        if pointer in self.bare:
            raise Unsupported("a $ref that recurses before any character")
        if pointer not in self.refs:
            name = self.refs[pointer] = self.rule("")  # named first: a $ref may recurse
            self.bare.add(pointer)
            target = self.root
            for part in pointer[2:].split("/") if pointer != "#" else ():
                part = part.replace("~1", "/").replace("~0", "~")
                if not isinstance(target, dict) or part not in target:
                    raise Unsupported("an unresolved $ref")
                target = target[part]
            self.rules[name] = self.expr(target)
            self.bare.discard(pointer)
        return self.refs[pointer]

    def typed(self, node: dict[str, Any], kind: str) -> str:
        if kind == "string":
            low = _count(node.get("minLength", 0))
            high = _count(node["maxLength"]) if "maxLength" in node else None
            if low == 0 and high is None:
                return self.use("string")
            self.use("char")
            return self.rule(rf'"\"" {repeat("char", low, high)} "\""')
        if kind == "integer":
            return self.integer(node)
        if kind in ("object", "array"):
            bare, self.bare = self.bare, set()
            made = self.object(node) if kind == "object" else self.array(node)
            self.bare = bare
            return made
        return self.use(kind)

    def integer(self, node: dict[str, Any]) -> str:
        bounds = [node.get(k) for k in ("minimum", "exclusiveMinimum", "maximum",
                                        "exclusiveMaximum")]
        if all(b is None for b in bounds):
            return self.use("integer")
        for b in bounds:
            if b is not None and (isinstance(b, bool) or not isinstance(b, int | float)
                                  or not math.isfinite(b)):
                raise Unsupported("a bound that is not a number")
        lows = [math.ceil(bounds[0])] if bounds[0] is not None else []
        lows += [math.floor(bounds[1]) + 1] if bounds[1] is not None else []
        highs = [math.floor(bounds[2])] if bounds[2] is not None else []
        highs += [math.ceil(bounds[3]) - 1] if bounds[3] is not None else []
        low = max(lows) if lows else None
        high = min(highs) if highs else None
        if any(len(str(abs(b))) > MAX_DIGITS for b in (low, high) if b is not None) or (
                low is not None and high is not None and low > high):
            raise Unsupported("integer bounds this compiler leaves to GenAI")
        return self.rule(" | ".join(integer_range(low, high)))

    def object(self, node: dict[str, Any]) -> str:
        props = node.get("properties", {})
        required = node.get("required", [])
        extra = node.get("additionalProperties", True)
        if not isinstance(props, dict) or not isinstance(required, list) or \
                not isinstance(extra, bool) or not set(required) <= set(props):
            raise Unsupported("an object shape this compiler leaves to GenAI")
        if not props:
            return self.use("object") if extra else '"{" ws "}"'
        if extra and "additionalProperties" in node:
            raise Unsupported("named properties and others")
        names = list(props)
        pairs = [f"{json_literal(n)} ws \":\" ws {self.expr(props[n])}" for n in names]
        # tail[i][first]: properties i.. in order; `first` when none came before (no comma).
        # NOTE: with first set, at least one property must come, so that an object's
        # whitespace rules never stand side by side ("{" ws ws "}" would allow 4 newlines).
        tail: list[tuple[str | None, str | None]] = [(None, "")]
        for i in range(len(names) - 1, -1, -1):
            pair, need = pairs[i], names[i] in required
            after_first, after_rest = tail[0]
            rest_alts = [f'ws "," ws {pair} {after_rest}'.strip()]
            if not need:
                rest_alts.append(after_rest or '""')
            first_alts = [f"{pair} {after_rest}".strip()]
            if not need and after_first is not None:
                first_alts.append(after_first)
            # NOTE: the first property has no comma before it: no rest rule (none unused).
            tail.insert(0, (self.rule(" | ".join(first_alts)),
                            self.rule(" | ".join(rest_alts)) if i else None))
        first = tail[0][0]
        if all(n not in required for n in names):
            return self.rule(f'"{{" ws ( {first} ws )? "}}"')
        return self.rule(f'"{{" ws {first} ws "}}"')

    def array(self, node: dict[str, Any]) -> str:
        items = node.get("items", True)
        if isinstance(items, list):
            raise Unsupported("tuple items")
        low = _count(node.get("minItems", 0))
        high = _count(node["maxItems"]) if "maxItems" in node else None
        if high == 0:
            return '"[" ws "]"'
        item = self.expr(items)
        more = repeat(f'( ws "," ws {item} )', max(low - 1, 0), None if high is None else high - 1)
        body = f"{item} {more} ws"
        return self.rule(f'"[" ws {body} "]"' if low else f'"[" ws ( {body} )? "]"')


def integer_range(low: int | None, high: int | None) -> list[str]:
    """EBNF alternatives for the integers from `low` to `high` (None: unbounded)."""
    alts: list[str] = []
    if low is None or low < 0:  # the negative ones: "-" and a magnitude
        top = None if low is None else -low
        bottom = 1 if high is None or high >= 0 else -high
        alts += [f'"-" {a}' for a in _naturals(bottom, top)]
    if high is None or high >= 0:
        alts += _naturals(max(low or 0, 0), high)
    return alts


def _naturals(low: int, high: int | None) -> list[str]:
    """Alternatives for the naturals from `low` to `high` (None: unbounded), no leading 0."""
    if high is None:
        digits = len(str(low))
        open_end = f"[1-9] [0-9]{{{digits},15}}" if digits < 16 else None
        alts = _naturals(low, 10 ** digits - 1)
        return [*alts, open_end] if open_end else alts
    alts = []
    for digits in range(len(str(low)), len(str(high)) + 1):
        a = max(low, 10 ** (digits - 1) if digits > 1 else 0)
        b = min(high, 10 ** digits - 1)
        if a <= b:
            alts += _same_length(str(a), str(b))
    return alts


def _same_length(a: str, b: str) -> list[str]:
    """Alternatives for the numbers from `a` to `b`, strings of one length."""
    if len(a) == 1:
        return [f"[{a}-{b}]"]
    if a[0] == b[0]:
        return [f'"{a[0]}" {x}' for x in _same_length(a[1:], b[1:])]
    n = len(a) - 1
    alts: list[str] = []
    first, last = int(a[0]), int(b[0])
    if a[1:] != "0" * n:
        alts += [f'"{a[0]}" {x}' for x in _same_length(a[1:], "9" * n)]
        first += 1
    tail = []
    if b[1:] != "9" * n:
        tail = [f'"{b[0]}" {x}' for x in _same_length("0" * n, b[1:])]
        last -= 1
    if first <= last:
        alts.append(f"[{first}-{last}] [0-9]{{{n}}}")
    return alts + tail
