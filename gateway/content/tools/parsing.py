"""Tool calls found in a model's output, streamed or whole, by one parser (`CallParser`; see
the package docstring for what counts as a call)."""

from __future__ import annotations

import json
import logging
import re
from typing import Any, Literal

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
# A call written as a Python dict (pyliteral.py): parsed, not constrained.
PY_CALL = "{'name'"
_OPENERS = (TAG_OPEN, BARE_CALL, WRAP_OPEN, PY_CALL)
# A call pretty-printed after text (`{`, a line break, `"name"`): Qwen2.5-Coder-1.5B under cn
# wrote its MultiEdit call so, fenced (issue 42). Parsed, not constrained (prompting.auto_tags
# says why); the text from it on is held as from the openers above. _PRETTY_TAIL: the end of
# the text that may still become one.
_PRETTY = re.compile(r'\{[ \t]{0,16}\n[ \t]{0,16}"name"')
_PRETTY_TAIL = re.compile(r'\{[ \t]{0,16}(?:\n[ \t]{0,16}(?:"(?:n(?:a(?:me?)?)?)?)?)?$')
_TAIL_WINDOW = 48
# A Markdown fence opened at a line's start with nothing after it yet: the fence a call may
# be written in. NOTE: bounded, and looked for only in the last _FENCE_WINDOW characters:
# `[ \t]*\n?[ \t]*$` backtracked quadratically on a long run of spaces (issue 14's kind).
_FENCE_END = re.compile(r"(?:^|\n)(`{1,3}[A-Za-z0-9_-]{0,32}[ \t]{0,16}(?:\n[ \t]{0,16})?)$")
_FENCE_WINDOW = 80
_FENCE_INFO = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")
log = logging.getLogger(__name__)

_NAME = re.compile(r'"(?:name|function)"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGUMENTS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')
# A call between its tags, or the tools wrapper; the closing tag optional (a cut output).
_TAGGED = re.compile(r"<(tool_call|tools)>(.*?)(?:</\1>|$)", re.S)


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
        try:
            args = json.loads(args) if args.strip() else {}
        except (json.JSONDecodeError, RecursionError):
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(name=tool.name, arguments=_without_null_options(args, tool),
                    namespace=tool.namespace, kind=tool.kind)


def _without_null_options(args: dict[str, Any], tool: Tool) -> dict[str, Any]:
    """The arguments without an optional one the model sent as null where the tool's schema
    does not take null (Codex refused a call whose optional integer was null: issue 42); a
    required one stays, for the client to refuse or correct."""
    nulls = [k for k, v in args.items() if v is None]
    if not nulls:
        return args
    props = tool.parameters.get("properties")
    props = props if isinstance(props, dict) else {}
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


def _unfence(text: str) -> str:
    """The inside of a Markdown code fence (```json ... ```, the closing fence optional), or
    of inline backticks.

    NOTE: scanned, not matched with a regex: `\\s*(.*?)\\s*(?:```)?\\s*$` backtracked
    quadratically on model output with long runs of spaces (issue 14).
    """
    fence = _fence(text)
    if not fence:
        return text
    body = _fenced(text).strip()
    if body.endswith(fence):
        body = body[:-len(fence)].rstrip()
    return body


def _fence(text: str) -> str:
    """The fence the text begins with: ``` (a code block), ` (inline code) or none."""
    return "```" if text.startswith("```") else "`" if text.startswith("`") else ""


def _fenced(text: str) -> str:
    """What follows a fence's opening ``` and its info string (or an inline backtick)."""
    if _fence(text) == "`":
        return text[1:]
    pos = 3
    while pos < len(text) and text[pos] in _FENCE_INFO:
        pos += 1
    return text[pos:]


def _json_calls(text: str, names: dict[str, Tool]) -> list[ToolCall] | None:
    """Calls from a text that is nothing but JSON: one value or several in a row."""
    text = text.strip()
    if text.startswith("[TOOL_CALLS]"):
        text = text[len("[TOOL_CALLS]"):].lstrip()
    calls, rest = _leading_calls(_unfence(text), names)
    return calls if calls and not rest else None


def _leading_calls(text: str, names: dict[str, Tool]) -> tuple[list[ToolCall], str]:
    """The calls the text begins with (JSON values in a row, each a call or an array of
    calls) and the rest of the text, from the first thing that is not one."""
    decoder = json.JSONDecoder()
    calls: list[ToolCall] = []
    pos = 0
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,;":
            pos += 1
        if pos >= len(text):
            return calls, ""
        try:
            value, end = decoder.raw_decode(text, pos)
        except (json.JSONDecodeError, RecursionError):
            literal = python_literal(text, pos)
            if literal is None:
                return calls, text[pos:]
            value, end = literal
        found = [_as_call(item, names) for item in
                 (value if isinstance(value, list) else [value])]
        if not found or any(call is None for call in found):
            return calls, text[pos:]
        calls += [call for call in found if call is not None]
        pos = end


def parse_calls(text: str, tools: list[Tool]) -> tuple[str, list[ToolCall]]:
    """Split a finished output into text and calls (see the module docstring)."""
    names = {t.name: t for t in tools}
    if TAG_OPEN in text or WRAP_OPEN in text:
        rest: list[str] = []
        calls: list[ToolCall] = []
        pos = 0
        for match in _TAGGED.finditer(text):
            found = _json_calls(match.group(2), names)
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
    stripped = text.lstrip()
    if stripped[:1] in ("{", "[", "`"):
        found = _json_calls(stripped, names)
        if found:
            return "", found
    if stripped[:1] in ("{", "["):
        # NOTE: Qwen2.5-Coder-1.5B (greedy, Claude Code's tools) wrote two bare calls and
        # then a line of prose: calls it begins with stay calls, the prose stays text.
        leading, after = _leading_calls(stripped, names)
        if leading:
            return after.strip(), leading
    fence = _fence(stripped)
    if fence:
        # The same in a fence or inline code: the calls, the closing fence, then prose.
        leading, after = _leading_calls(_fenced(stripped), names)
        after = after.lstrip()
        if leading and (not after or after.startswith(fence)):
            return after[len(fence):].strip(), leading
    return text, []


class CallParser:
    """Incremental: `feed` returns the text that is surely not part of a call, `finish` the
    rest of the text and the calls.

    Output that starts as JSON (after whitespace) is held back whole; otherwise text flows at
    once, except a tail that could be the start of a `<tool_call>` or `<tools>` tag or of a
    bare call (`{"name"`, with a code fence opened just before it), and everything from such a
    start on (held text that is not a call comes back as text at `finish`).
    """

    def __init__(self, tools: list[Tool]) -> None:
        self.tools = tools
        self._buf = ""
        self._mode: Literal["start", "text", "held"] = "start"

    def feed(self, text: str) -> str:
        self._buf += text
        if self._mode == "start":
            head = self._buf.lstrip()
            if not head:
                return ""
            if head[0] in "{[" or head.startswith((TAG_OPEN, WRAP_OPEN, "```")):
                self._mode = "held"
                return ""
            if any(o.startswith(head) for o in (TAG_OPEN, WRAP_OPEN, "```")):
                return ""
            self._mode = "text"
        if self._mode == "held":
            return ""
        found = [at for at in (self._buf.find(o) for o in _OPENERS) if at >= 0]
        pretty = _PRETTY.search(self._buf)
        if pretty is not None:
            found.append(pretty.start())
        if found:
            at = _fence_start(self._buf, min(found))
            out, self._buf, self._mode = self._buf[:at], self._buf[at:], "held"
            return out
        keep = max(next((k for k in range(len(o) - 1, 0, -1) if self._buf.endswith(o[:k])), 0)
                   for o in _OPENERS)
        tail = _PRETTY_TAIL.search(self._buf, max(0, len(self._buf) - _TAIL_WINDOW))
        if tail is not None:
            keep = max(keep, len(self._buf) - tail.start())
        out = self._buf[:_fence_start(self._buf, len(self._buf) - keep)]
        self._buf = self._buf[len(out):]
        return out

    def finish(self, cut: bool = False) -> tuple[str, list[ToolCall]]:
        """The rest and the calls; `cut`: the output ended at max_tokens or the deadline,
        so a call it began and did not end comes back as a call (`partial_call`)."""
        text, self._buf = self._buf, ""
        if self._mode != "held":
            return text, []
        rest, calls = parse_calls(text, self.tools)
        if calls or not cut:
            return rest, calls
        partial = partial_call(text, self.tools)
        return ("", [partial]) if partial is not None else (rest, calls)


def _fence_start(text: str, at: int) -> int:
    """Where a call that may begin at `at` begins: at the fence opened just before it, or the
    inline backtick just before it."""
    if at and text[at - 1] == "`" and (at < 2 or text[at - 2] != "`"):
        return at - 1
    fence = _FENCE_END.search(text, max(0, at - _FENCE_WINDOW), at)
    return fence.start(1) if fence else at


def partial_call(text: str, tools: list[Tool]) -> ToolCall | None:
    """The call a cut-off output had begun: its tool (named in full, or the only one offered)
    and its arguments' text as far as it came, as OpenAI returns a call cut by max_tokens
    (finish_reason "length"), never the server's JSON wrapper as text. None when it names no
    offered tool."""
    names = {t.name: t for t in tools}
    named = _NAME.search(text)
    tool = names.get(named.group(1)) if named else (tools[0] if len(tools) == 1 else None)
    if tool is None:
        return None
    args = _ARGUMENTS.search(text, named.end() if named else 0)
    return ToolCall(name=tool.name, arguments={}, namespace=tool.namespace, kind=tool.kind,
                    partial=text[args.end():] if args else "")


def split_calls(text: str, parser: CallParser | None,
                cut: bool = False) -> tuple[str, list[ToolCall]]:
    """A whole (non-streamed) output through the same parser a stream uses."""
    if parser is None:
        return text, []
    head = parser.feed(text)
    rest, calls = parser.finish(cut)
    return (head + rest).strip() if calls else head + rest, calls


def fragments(text: str, size: int = 24) -> list[str]:
    """A call's arguments JSON cut into stream-sized pieces (clients concatenate them)."""
    return [text[i:i + size] for i in range(0, len(text), size)] or [""]
