"""A thinking model's reasoning told apart from its answer: the one splitter every API uses.

Two output shapes are known, named by the model's chat template (`reasoning_format` in
models/capabilities.py, which also makes the `thinking` capability):
- `<think>…</think>` then the answer (Qwen3, QwQ, DeepSeek-R1 and their distills). A template
  whose generation prompt opens `<think>` itself (DeepSeek-R1) makes the output start inside
  the thinking, with only `</think>` in it.
- gpt-oss's harmony channels: `<|channel|>analysis<|message|>…<|end|>` is reasoning,
  `<|start|>assistant<|channel|>final<|message|>…<|return|>` the answer.

`ReasoningSplitter.feed` takes the output as it streams, in any pieces, and returns what is
certain so far as (thinking, answer); `finish` returns the rest. Every split of one output gives
the same result. Only a possible marker's prefix (a few characters) or a harmony header is held
back, and each character is looked at a bounded number of times: linear in the output.

NOTE: the splitting is done here, in the gateway, not with OpenVINO GenAI's ReasoningParser in
the worker: the gateway already parses streamed deltas (tool calls, gateway/content/tools/), a
reasoning parser must run before that one, and the same code then serves every worker and
every API while the gateway stays free of OpenVINO.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass
from typing import Any

from npu_proxy.models.capabilities import CHANNEL, CLOSE, OPEN, ReasoningFormat, Style
from npu_proxy.protocol.messages import Delta

MESSAGE, START = "<|message|>", "<|start|>"
ENDS = ("<|end|>", "<|return|>", "<|call|>")
# A harmony header (role, channel, recipient, constraint) longer than this is not one.
MAX_HEADER = 256


def _held(buf: str, markers: tuple[str, ...]) -> int:
    """How many characters at the end of `buf` could begin one of the markers."""
    longest = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(buf)), longest, -1):
            if buf.endswith(marker[:n]):
                longest = n
                break
    return longest


def _first(buf: str, markers: tuple[str, ...]) -> tuple[int, str]:
    """The earliest marker in `buf` and where it is; (-1, "") if none."""
    best, found = -1, ""
    for marker in markers:
        i = buf.find(marker)
        if i >= 0 and (best < 0 or i < best):
            best, found = i, marker
    return best, found


class ReasoningSplitter:
    """Streams one output into (thinking, answer) pieces; see the module's docstring."""

    def __init__(self, fmt: ReasoningFormat) -> None:
        self.fmt = fmt
        self.buf = ""
        self.thinking: list[str] = []
        self.answer: list[str] = []
        # THINK: "lead" (before the output's first character), "think_lead", "think",
        # "answer_lead", "answer"; HARMONY: "out", "header", "body".
        self.state = "lead" if fmt.style is Style.THINK else "out"
        self.lead: list[str] = []  # whitespace seen in "lead"
        # Whitespace at the end of the thinking so far: dropped if the thinking ends there.
        self.pending: list[str] = []
        self.channel = ""

    def feed(self, text: str) -> tuple[str, str]:
        self.buf += text
        if self.fmt.style is Style.THINK:
            self._think()
        else:
            self._harmony()
        return self._take()

    def finish(self) -> tuple[str, str]:
        buf, self.buf = self.buf, ""
        if self.fmt.style is Style.THINK:
            if self.state == "lead":
                (self.thinking if self.fmt.opened else self.answer).append(
                    buf if self.fmt.opened else "".join(self.lead) + buf)
            elif self.state in ("think_lead", "think") and buf.strip():
                self.thinking.extend((*self.pending, buf))
            elif self.state == "answer":
                self.answer.append(buf)
        elif self.state == "body" and self.channel == "analysis":
            self.thinking.append(buf)
        elif self.state in ("body", "out"):
            self.answer.append(buf)
        return self._take()

    def _take(self) -> tuple[str, str]:
        out = "".join(self.thinking), "".join(self.answer)
        self.thinking.clear()
        self.answer.clear()
        return out

    def _think(self) -> None:
        while self.buf:
            if self.state in ("lead", "think_lead", "answer_lead"):
                rest = self.buf.lstrip()
                if self.state == "lead":
                    self.lead.append(self.buf[:len(self.buf) - len(rest)])
                self.buf = rest
                if not rest:
                    return
                if self.state == "answer_lead":
                    self.state = "answer"
                elif rest.startswith(OPEN):
                    self.buf, self.state = rest[len(OPEN):], "think_lead"
                elif OPEN.startswith(rest):
                    return  # perhaps `<think>`: wait for more
                elif self.state == "think_lead" or self.fmt.opened:
                    self.state = "think"
                else:
                    self.buf, self.state = "".join(self.lead) + rest, "answer"
            elif self.state == "think":
                at = self.buf.find(CLOSE)
                if at >= 0:
                    if body := self.buf[:at].rstrip():
                        self.thinking.extend((*self.pending, body))
                    self.pending.clear()
                    self.buf, self.state = self.buf[at + len(CLOSE):], "answer_lead"
                    continue
                keep = _held(self.buf, (CLOSE,))
                sure = self.buf[:len(self.buf) - keep]
                body = sure.rstrip()
                if body:
                    self.thinking.extend((*self.pending, body))
                    self.pending.clear()
                self.pending.append(sure[len(body):])
                self.buf = self.buf[len(sure):]
                return
            else:
                self.answer.append(self.buf)
                self.buf = ""

    def _harmony(self) -> None:
        while self.buf:
            if self.state == "header":
                # NOTE: looked for within MAX_HEADER only, so every split decides alike.
                at = self.buf.find(MESSAGE, 0, MAX_HEADER + len(MESSAGE))
                if at < 0:
                    if len(self.buf) >= MAX_HEADER + len(MESSAGE):  # no header: plain text
                        self.state = "out"
                        continue
                    return
                header = self.buf[:at]
                self.channel = "analysis" if "analysis" in header else "final"
                self.buf, self.state = self.buf[at + len(MESSAGE):], "body"
                continue
            markers = (CHANNEL, START, *ENDS)
            at, marker = _first(self.buf, markers)
            end = at if at >= 0 else len(self.buf) - _held(self.buf, markers)
            text = self.buf[:end]
            if text:
                thinking = self.state == "body" and self.channel == "analysis"
                (self.thinking if thinking else self.answer).append(text)
            if at < 0:
                self.buf = self.buf[end:]
                return
            self.buf = self.buf[at + len(marker):]
            self.state = "header" if marker in (CHANNEL, START) else "out"


def split_text(text: str, fmt: ReasoningFormat) -> tuple[str, str]:
    """A whole output as (thinking, answer)."""
    splitter = ReasoningSplitter(fmt)
    thinking, answer = splitter.feed(text)
    more_thinking, more_answer = splitter.finish()
    return thinking + more_thinking, answer + more_answer


@dataclass(frozen=True)
class Thinking:
    """What one request does with a thinking model's reasoning."""

    fmt: ReasoningFormat
    show: bool  # give the reasoning to the client (else it is dropped)

    def splitter(self) -> ReasoningSplitter:
        return ReasoningSplitter(self.fmt)


def template_vars(think: bool | None, effort: str | None = None,
                  extra: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The chat template's extra variables: the client's own (`chat_template_kwargs`), then
    `enable_thinking` (Qwen3's switch) and `reasoning_effort` (gpt-oss) when asked for."""
    out = dict(extra or {})
    if think is not None:
        out["enable_thinking"] = think
    if effort:
        out["reasoning_effort"] = effort
    return out or None


async def pieces(deltas: AsyncIterable[Delta], thinking: Thinking | None,
                 ) -> AsyncIterator[tuple[Delta | None, str, str]]:
    """The worker's deltas as (delta, thinking, answer), the reasoning taken out first (and
    dropped unless shown); after the last delta, (None, thinking, answer) with what the
    splitter held back. Without thinking, each delta's text is all answer."""
    if thinking is None:
        async for delta in deltas:
            yield delta, "", delta.text
        return
    splitter = thinking.splitter()
    async for delta in deltas:
        thought, text = splitter.feed(delta.text)
        yield delta, thought if thinking.show else "", text
    thought, text = splitter.finish()
    yield None, thought if thinking.show else "", text


def split_parts(parts: list[str], thinking: Thinking | None) -> tuple[str, str]:
    """A collected output as (thinking, answer), like `pieces`."""
    text = "".join(parts)
    if thinking is None:
        return "", text
    thought, answer = split_text(text, thinking.fmt)
    return thought if thinking.show else "", answer


def reasoning_tokens(parts: list[str], ends: list[int], thinking: Thinking | None) -> int:
    """How many of the output's tokens came before its answer began: the reasoning (and its
    markers). `parts` are the deltas' texts, `ends` the token count at the end of each
    (Generation.ends); 0 for a model that does not think."""
    if thinking is None:
        return 0
    splitter, before = thinking.splitter(), 0
    for text, end in zip(parts, ends, strict=False):
        if splitter.feed(text)[1]:
            return before
        before = end
    if splitter.finish()[1]:  # the answer's start was held back in the last delta
        return ends[-2] if len(ends) > 1 else 0
    return before
