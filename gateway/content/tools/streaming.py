"""Tool calls found in a model's output as it streams (`CallParser`), by the rules of
parsing.py: text flows at once, what may be a call is held until it is known."""

from __future__ import annotations

import re
from typing import Literal

from npu_proxy.gateway.content.tools.brackets import Brackets
from npu_proxy.gateway.content.tools.definitions import Tool, ToolCall
from npu_proxy.gateway.content.tools.parsing import (
    FENCE_INFO,
    FUNCTION_HEAD_MAX,
    FUNCTION_OPEN,
    MISTRAL,
    OPENERS,
    PRETTY,
    TAG_CLOSE,
    TAG_OPEN,
    WRAP_CLOSE,
    WRAP_OPEN,
    decode_at,
    function_head,
    parse_calls,
    partial_call,
    tagged_calls,
    value_calls,
)

# Where a call may begin in text: the leftmost of the openers or a pretty-printed start (one
# search, which stops there).
_OPENER = re.compile("|".join([*map(re.escape, OPENERS), PRETTY.pattern]))
# The end of the text that may still become a pretty-printed call.
_PRETTY_TAIL = re.compile(r'\{[ \t]{0,16}(?:\n[ \t]{0,16}(?:"(?:n(?:a(?:me?)?)?)?)?)?$')
_TAIL_WINDOW = 48
# A Markdown fence opened at a line's start with nothing after it yet: the fence a call may
# be written in. NOTE: bounded, and looked for only in the last _FENCE_WINDOW characters:
# `[ \t]*\n?[ \t]*$` backtracked quadratically on a long run of spaces (issue 14's kind).
_FENCE_END = re.compile(r"(?:^|\n)(`{1,3}[A-Za-z0-9_-]{0,32}[ \t]{0,16}(?:\n[ \t]{0,16})?)$")
_FENCE_WINDOW = 80


class CallParser:
    """Incremental: `feed` returns the text that is surely not part of a call, `finish` the
    rest of the text and the calls.

    Text flows at once, except a tail that could be the start of a call (a `<tool_call>` or
    `<tools>` tag, `{"name"`, `{'name'`, a pretty-printed `{` then `"name"`, with a code fence
    or backtick just before it) and output that starts as JSON or a fence (after whitespace).
    Such a start is held until it is known to be no call: its tag closed around no call, its
    value (JSON or a Python dict) closed and no call, or its fence holding no value; then it
    flows as text and the text after it is read on. A call, once seen, holds the rest to the
    end (`finish` parses it).
    """

    def __init__(self, tools: list[Tool]) -> None:
        self.tools = tools
        self._names = {t.name: t for t in tools}
        self._buf = ""
        self._mode: Literal["start", "text", "held"] = "start"
        self._value: Brackets | None = None  # the held value's scan, once its start is known
        self._at = -1  # where in the held text that value begins (as far as known)
        self._searched = 0  # how far a held tag's closing tag has been looked for
        self._called = False  # what is held began with a call: held to the end
        self._lead = 0  # white space at the start (of the output, then of the held text)

    def feed(self, text: str) -> str:
        self._buf += text
        out: list[str] = []
        while True:
            if self._mode == "start" and not self._start():
                return ""
            if self._mode == "held":
                freed = self._release()
                if freed is None:
                    return "".join(out)
                out.append(freed)
            out.append(self._flow())
            if self._mode != "held":
                return "".join(out)

    def _start(self) -> bool:
        """Whether the output's start is known: held (JSON, a tag or a fence) or text."""
        buf, lead = self._buf, self._lead
        while lead < len(buf) and buf[lead].isspace():  # NOTE: on from where it got to
            lead += 1
        self._lead = lead
        head = buf[lead:lead + len(TAG_OPEN) + 1]
        if not head or any(o.startswith(head) for o in (TAG_OPEN, WRAP_OPEN, "```")):
            return False
        if head[0] in "{[" or head.startswith((TAG_OPEN, WRAP_OPEN, "```")):
            self._hold(0, lead)
        else:
            self._mode = "text"
        return True

    def _hold(self, at: int, lead: int = 0) -> str:
        """Hold from `at` on (`lead`: white space the held text begins with); the text before
        it flows."""
        out, self._buf, self._mode = self._buf[:at], self._buf[at:], "held"
        self._value, self._at, self._searched, self._called = None, -1, 0, False
        self._lead = lead
        return out

    def _flow(self) -> str:
        """Text mode: the text up to where a call may begin (held from there on)."""
        found = _OPENER.search(self._buf)
        if found is not None:
            return self._hold(_fence_start(self._buf, found.start()))
        keep = max(next((k for k in range(len(o) - 1, 0, -1) if self._buf.endswith(o[:k])), 0)
                   for o in OPENERS)
        tail = _PRETTY_TAIL.search(self._buf, max(0, len(self._buf) - _TAIL_WINDOW))
        if tail is not None:
            keep = max(keep, len(self._buf) - tail.start())
        out = self._buf[:_fence_start(self._buf, len(self._buf) - keep)]
        self._buf = self._buf[len(out):]
        return out

    def _release(self) -> str | None:
        """The held text up to where it is known to be no call (text mode again after it),
        or None while it may still be one."""
        if self._called:
            return None
        end = self._no_call_end(self._buf)
        if end is None:
            return None
        out, self._buf, self._mode = self._buf[:end], self._buf[end:], "text"
        return out

    def _no_call_end(self, held: str) -> int | None:
        lead = self._lead
        if held.startswith((TAG_OPEN, WRAP_OPEN), lead):
            return self._tag_end(held, lead)
        if held.startswith(FUNCTION_OPEN, lead):
            return self._element_end(held, lead)
        if self._value is None:
            if self._at < 0:
                body = _body_start(held, lead)
                if body is None:
                    return None
                self._at = body
            while self._at < len(held) and held[self._at] in " \t\r\n":
                self._at += 1
            if self._at == len(held):
                return None
            if held[self._at] not in "{[":
                return max(self._at, 1)  # a fence (or [TOOL_CALLS]) before no value
            self._value = Brackets(self._at)
        end = self._value.scan(held)
        if end is None:
            return None
        if self._value.closed:
            decoded = decode_at(held[:end], self._at)
            if decoded is not None and decoded[1] == end and \
                    value_calls(decoded[0], self._names) is not None:
                self._called = True
                return None
        return end

    def _tag_end(self, held: str, lead: int) -> int | None:
        """The end of a held tag that closed around no call."""
        opened = TAG_OPEN if held.startswith(TAG_OPEN, lead) else WRAP_OPEN
        close = TAG_CLOSE if opened == TAG_OPEN else WRAP_CLOSE
        inner = lead + len(opened)
        at = held.find(close, max(inner, self._searched - len(close)))
        if at < 0:
            self._searched = len(held)
            return None
        if tagged_calls(held[inner:at], self._names) is not None:
            self._called = True
            return None
        return at + len(close)

    def _element_end(self, held: str, lead: int) -> int | None:
        """A held `<function`: a call once its head is seen (held to the end, as any call),
        text once its head can no longer come (a `>` or a line break first, or too long)."""
        if function_head(held, lead):
            self._called = True
            return None
        window = held[lead + len(FUNCTION_OPEN):lead + FUNCTION_HEAD_MAX]
        if ">" in window or "\n" in window or len(window) + len(FUNCTION_OPEN) >= \
                FUNCTION_HEAD_MAX:
            return lead + len(FUNCTION_OPEN)
        return None

    def finish(self, cut: bool = False) -> tuple[str, list[ToolCall]]:
        """The rest and the calls; `cut`: the output ended at max_tokens or the deadline,
        so a call it began and did not end comes back as a call (`partial_call`)."""
        text, self._buf = self._buf, ""
        if self._mode != "held":
            return text, []
        rest, calls = parse_calls(text, self.tools)
        if not cut:
            return rest, calls
        if not calls:
            partial = partial_call(text, self.tools)
            return ("", [partial]) if partial is not None else (rest, calls)
        # A call begun after whole ones and cut: the last of the calls, not text.
        begun = _OPENER.search(rest)
        partial = partial_call(rest[begun.start():], self.tools) if begun else None
        if begun is None or partial is None:
            return rest, calls
        return rest[:_fence_start(rest, begun.start())].rstrip(), [*calls, partial]


def _body_start(held: str, pos: int) -> int | None:
    """Where the body held from `pos` begins: past Mistral's [TOOL_CALLS], a fence's opening
    and its info string (up to 32 characters), or a backtick; None until that is known."""
    if held.startswith(MISTRAL, pos):
        pos += len(MISTRAL)
    elif len(held) - pos < len(MISTRAL) and MISTRAL.startswith(held[pos:]):
        return None
    if held.startswith("```", pos):
        end = min(len(held), pos + 3 + 32)
        pos += 3
        while pos < end and held[pos] in FENCE_INFO:
            pos += 1
        return None if pos == len(held) else pos
    return pos + 1 if held.startswith("`", pos) else pos


def _fence_start(text: str, at: int) -> int:
    """Where a call that may begin at `at` begins: at the fence opened just before it, or the
    inline backtick just before it."""
    if at and text[at - 1] == "`" and (at < 2 or text[at - 2] != "`"):
        return at - 1
    fence = _FENCE_END.search(text, max(0, at - _FENCE_WINDOW), at)
    return fence.start(1) if fence else at


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
