"""Tool calls found in a model's output, streamed or whole, by one parser (`CallParser`; see
the package docstring for what counts as a call)."""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from npu_proxy.gateway.content.tools.definitions import Tool, ToolCall
from npu_proxy.gateway.content.tools.pyliteral import python_literal

TAG_OPEN = "<tool_call>"
TAG_CLOSE = "</tool_call>"
# How a call written as bare JSON begins: a trigger of its constraint (prompting.auto_tags),
# and where text stops flowing, as at TAG_OPEN.
BARE_CALL = '{"name"'
# NOTE: Qwen2.5-Coder-1.5B sometimes wrote its call as its template lists the tools,
# `<tools>{"type": "function", "function": {"name": ...}}</tools>`: the wrapper is read like
# the call tags, so that its remains do not show as text beside the call.
WRAP_OPEN = "<tools>"
WRAP_CLOSE = "</tools>"
MISTRAL = "[TOOL_CALLS]"
# A call written as a Python dict (pyliteral.py): parsed, not constrained.
PY_CALL = "{'name'"
# NOTE: Qwen2.5-Coder-1.5B under Codex CLI (its short prompt) wrote a call as an XML element,
# `<function name="exec_command" arguments='{"cmd": ...}'>` (on llama-server too, inside
# `<tools>`); Llama 3.1 writes calls of its own tools as `<function=NAME>{...}</function>`.
# Both are read (parsed, not constrained) wherever they stand, as tagged calls are.
FUNCTION_OPEN = "<function"
OPENERS = (TAG_OPEN, BARE_CALL, WRAP_OPEN, PY_CALL, FUNCTION_OPEN)
# Such a call's head, up to its arguments' JSON: the element's `name` and `arguments` (or
# `parameters`) attributes and the quote the JSON is in, or Llama's `=NAME>`.
_FUNCTION_HEAD = re.compile(
    r"""<function(?:[ \t]+name[ \t]*=[ \t]*(["'])([^"'<>\n]{1,256})\1[ \t]+"""
    r"""(?:arguments|parameters)[ \t]*=[ \t]*(["'])|=([^<>\s]{1,256})>)""")
# A head is never longer: held this far without one, a `<function` is text.
FUNCTION_HEAD_MAX = 320
_FUNCTION_END = re.compile(r"[ \t]*/?>")
_FUNCTION_CLOSE = re.compile(r"\s*</function>")
# Calls looked for as elements in one output, at most.
_FUNCTION_TRIES = 64
# A call pretty-printed after text (`{`, a line break, `"name"`): Qwen2.5-Coder-1.5B under cn
# wrote its MultiEdit call so, fenced (issue 42). Parsed, not constrained (prompting.auto_tags
# says why); the text from it on is held as from the openers above (streaming.py).
PRETTY = re.compile(r'\{[ \t]{0,16}\n[ \t]{0,16}"name"')
FENCE_INFO = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")
log = logging.getLogger(__name__)

# A call's tool and where its arguments begin, in JSON or a Python dict (single-quoted).
_NAME = re.compile(r'"(?:name|function)"\s*:\s*"((?:[^"\\]|\\.)*)"'
                   r"|'(?:name|function)'\s*:\s*'((?:[^'\\]|\\.)*)'")
_ARGUMENTS = re.compile(r"""(["'])(?:arguments|parameters)\1\s*:\s*""")
# A call between its tags, or the tools wrapper; the closing tag optional (a cut output).
_TAGGED = re.compile(r"<(tool_call|tools)>(.*?)(?:</\1>|$)", re.S)
# NOTE: strict=False: a real line break in a string is read (models write them in code they
# pass as an argument); JSON is otherwise as strict as ever.
_DECODER = json.JSONDecoder(strict=False)


def _as_call(obj: Any, tools: dict[str, Tool]) -> ToolCall | None:
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("function"), dict):
        obj = obj["function"]
    # NOTE: Qwen2.5-Coder-1.5B, offered Claude Code's tools, wrote its calls as bare
    # `{"function": "Read", "arguments": {...}}` objects: the tool's name under "function".
    name = obj.get("name", obj.get("function"))
    tool = tools.get(name) if isinstance(name, str) else None
    if tool is None:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        args = _arguments_text(args.strip())
    if not isinstance(args, dict):
        return None
    return ToolCall(name=tool.name, arguments=_whole_integers(_without_null_options(args, tool),
                                                              tool),
                    namespace=tool.namespace, kind=tool.kind)


def _arguments_text(text: str) -> Any:
    """Arguments sent as a string: JSON, or a Python dict (the same model wrote
    `"arguments": "{'filepath': ...}"`); None when neither."""
    if not text:
        return {}
    try:
        return _DECODER.decode(text)
    except (json.JSONDecodeError, RecursionError):
        literal = python_literal(text, 0)
        return literal[0] if literal is not None and literal[1] == len(text) else None


def _properties(tool: Tool) -> dict[str, Any]:
    props = tool.parameters.get("properties")
    return props if isinstance(props, dict) else {}


# The largest integer a float holds exactly: a bigger one was not written as a whole number.
_EXACT = 2 ** 53


def _whole_integers(args: dict[str, Any], tool: Tool) -> dict[str, Any]:
    """The arguments with a whole number the model wrote with a fraction (`3870000.0`) where
    the tool's schema says integer, as an integer: JSON Schema counts it one, but Codex
    refused such a call ("invalid type: floating point", issue 42). Other values stay as
    written, for the client to refuse or correct."""
    props = _properties(tool)

    def integral(key: str, value: Any) -> bool:
        schema = props.get(key)
        kind = schema.get("type") if isinstance(schema, dict) else None
        kinds = kind if isinstance(kind, list) else [kind]
        return ("integer" in kinds and "number" not in kinds and isinstance(value, float)
                and value.is_integer() and abs(value) <= _EXACT)

    mended = {k for k, v in args.items() if integral(k, v)}
    if not mended:
        return args
    log.info("tool call %s: whole numbers written with a fraction sent as integers: %s",
             tool.name, ", ".join(sorted(mended)))
    return {k: int(v) if k in mended else v for k, v in args.items()}


def _without_null_options(args: dict[str, Any], tool: Tool) -> dict[str, Any]:
    """The arguments without an optional one the model sent as null where the tool's schema
    does not take null (Codex refused a call whose optional integer was null: issue 42); a
    required one stays, for the client to refuse or correct."""
    nulls = [k for k, v in args.items() if v is None]
    if not nulls:
        return args
    props = _properties(tool)
    required = tool.parameters.get("required")
    required = set(required) if isinstance(required, list) else set()

    def takes_null(schema: Any) -> bool:
        if not isinstance(schema, dict):
            return True  # NOTE: no schema says what it takes
        kind = schema.get("type")
        kinds = kind if isinstance(kind, list) else [kind]
        untyped = kind is None and not schema.get("enum")
        return untyped or "null" in kinds or None in (schema.get("enum") or [])

    drop = {k for k in nulls if k not in required and not takes_null(props.get(k))}
    if not drop:
        return args
    log.info("tool call %s: optional arguments sent as null left out: %s", tool.name,
             ", ".join(sorted(drop)))
    return {k: v for k, v in args.items() if k not in drop}


def _fence(text: str) -> str:
    """The fence the text begins with: ``` (a code block), ` (inline code) or none."""
    return "```" if text.startswith("```") else "`" if text.startswith("`") else ""


def _fenced(text: str) -> str:
    """What follows a fence's opening ``` and its info string (or an inline backtick)."""
    if _fence(text) == "`":
        return text[1:]
    pos = 3
    while pos < len(text) and text[pos] in FENCE_INFO:
        pos += 1
    return text[pos:]


def json_calls(text: str, names: dict[str, Tool]) -> list[ToolCall] | None:
    """Calls from a text that is nothing but calls (JSON or Python dicts, one or several in a
    row, fenced or not)."""
    found = _calls_then_text(text, names)
    return found[0] if found is not None and not found[1] else None


def _calls_then_text(text: str, names: dict[str, Tool]) -> tuple[list[ToolCall], str] | None:
    """The calls the text begins with (after Mistral's [TOOL_CALLS], in a code fence or
    inline code) and the text after them, the closing fence left out; None when it begins
    with none, or its fence goes on after them."""
    text = text.strip()
    if text.startswith(MISTRAL):
        text = text[len(MISTRAL):].lstrip()
    fence = _fence(text)
    calls, after = _leading_calls(_fenced(text) if fence else text, names)
    after = after.lstrip()
    if not calls or (fence and after and not after.startswith(fence)):
        return None
    return calls, after[len(fence):].strip()


def decode_at(text: str, pos: int) -> tuple[Any, int] | None:
    """The JSON value (or Python literal, pyliteral.py) that begins at `pos`, and its end."""
    try:
        return _DECODER.raw_decode(text, pos)
    except (json.JSONDecodeError, RecursionError):
        return python_literal(text, pos)


def value_calls(value: Any, names: dict[str, Tool]) -> list[ToolCall] | None:
    """The calls a value is (a call or an array of calls), or None."""
    found = [_as_call(item, names) for item in (value if isinstance(value, list) else [value])]
    calls = [call for call in found if call is not None]
    return calls if calls and len(calls) == len(found) else None


def _leading_calls(text: str, names: dict[str, Tool]) -> tuple[list[ToolCall], str]:
    """The calls the text begins with (values in a row, each a call or an array of calls)
    and the rest of the text, from the first thing that is not one."""
    calls: list[ToolCall] = []
    pos = 0
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,;":
            pos += 1
        if pos >= len(text):
            return calls, ""
        decoded = decode_at(text, pos)
        found = value_calls(decoded[0], names) if decoded is not None else None
        if decoded is None or found is None:
            return calls, text[pos:]
        calls += found
        pos = decoded[1]


def function_head(text: str, pos: int) -> bool:
    """Whether a call written as an XML element (FUNCTION_OPEN) begins at `pos`."""
    return _FUNCTION_HEAD.match(text, pos) is not None


def _function_call(text: str, pos: int, names: dict[str, Tool]) -> tuple[ToolCall, int] | None:
    """The call written as an XML element at `pos`, and its end (its `</function>` too,
    where one follows); None when there is none."""
    head = _FUNCTION_HEAD.match(text, pos)
    if head is None:
        return None
    at = head.end()
    while at < len(text) and text[at] in " \t\r\n":
        at += 1
    decoded = decode_at(text, at)
    if decoded is None:
        return None
    args, end = decoded
    quote = head.group(3)
    if quote:  # the attribute's closing quote, then the element's `>`
        closed = _FUNCTION_END.match(text, end + 1) if text.startswith(quote, end) else None
        if closed is None:
            return None
        end = closed.end()
    close = _FUNCTION_CLOSE.match(text, end)
    call = _as_call({"name": head.group(2) or head.group(4), "arguments": args}, names)
    return (call, close.end() if close else end) if call is not None else None


def _function_calls(text: str, names: dict[str, Tool]) -> tuple[str, list[ToolCall]]:
    """The calls written as XML elements in the text, and the text around them."""
    rest: list[str] = []
    calls: list[ToolCall] = []
    pos, at = 0, text.find(FUNCTION_OPEN)
    for _ in range(_FUNCTION_TRIES):
        if at < 0:
            break
        found = _function_call(text, at, names)
        if found is None:
            at = text.find(FUNCTION_OPEN, at + 1)
            continue
        rest.append(text[pos:at])
        calls.append(found[0])
        pos = found[1]
        at = text.find(FUNCTION_OPEN, pos)
    rest.append(text[pos:])
    return "".join(rest), calls


def tagged_calls(inner: str, names: dict[str, Tool]) -> list[ToolCall] | None:
    """The calls a tag holds: JSON, or elements and nothing else."""
    found = json_calls(inner, names)
    if found is not None or FUNCTION_OPEN not in inner:
        return found
    rest, calls = _function_calls(inner, names)
    return calls if calls and not rest.strip() else None


def parse_calls(text: str, tools: list[Tool]) -> tuple[str, list[ToolCall]]:
    """Split a finished output into text and calls (see the package docstring): calls in
    tags, or calls it begins with (fenced or not) and text after them, or calls written as
    XML elements."""
    names = {t.name: t for t in tools}
    if TAG_OPEN in text or WRAP_OPEN in text:
        rest: list[str] = []
        calls: list[ToolCall] = []
        pos = 0
        for match in _TAGGED.finditer(text):
            found = tagged_calls(match.group(2), names)
            rest.append(text[pos:match.start()])
            if found is None:
                rest.append(match.group(0))
            else:
                calls += found
            pos = match.end()
        rest.append(text[pos:])
        if calls:
            return "".join(rest).strip(), calls
        return text, []
    # NOTE: Qwen2.5-Coder-1.5B (greedy, Claude Code's tools) wrote two bare calls and then a
    # line of prose: calls it begins with stay calls, the prose stays text.
    leading = _calls_then_text(text, names)
    if leading is not None:
        return leading[1], leading[0]
    if FUNCTION_OPEN in text:
        said, calls = _function_calls(text, names)
        if calls:
            return said.strip(), calls
    return text, []


def partial_call(text: str, tools: list[Tool]) -> ToolCall | None:
    """The call a cut-off output had begun: its tool (named in full, or the only one offered)
    and its arguments' text as far as it came, as OpenAI returns a call cut by max_tokens
    (finish_reason "length"), never the server's JSON wrapper as text. None when it names no
    offered tool."""
    names = {t.name: t for t in tools}
    named = _NAME.search(text)
    name = (named.group(1) or named.group(2)) if named else None
    tool = names.get(name) if name is not None else (tools[0] if len(tools) == 1 else None)
    if tool is None:
        return None
    args = _ARGUMENTS.search(text, named.end() if named else 0)
    return ToolCall(name=tool.name, arguments={}, namespace=tool.namespace, kind=tool.kind,
                    partial=text[args.end():] if args else "")


