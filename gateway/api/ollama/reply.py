"""Ollama's NDJSON reply to /api/generate and /api/chat: chunks, the last one's done_reason and
timings, tool calls, logprobs, a thinking model's reasoning."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from npu_proxy.gateway.api.ollama.models import utc_now
from npu_proxy.gateway.api.request_path import Generation
from npu_proxy.gateway.content import logprobs as lp
from npu_proxy.gateway.content.reasoning import Thinking, pieces, split_parts
from npu_proxy.gateway.content.tools import (
    CallParser,
    ToolCall,
    split_calls,
)
from npu_proxy.protocol.messages import Finished

DONE_REASON = {"stop": "stop", "length": "length", "abort": "stop", "timeout": "timeout"}


def tool_calls_json(calls: list[ToolCall]) -> list[dict[str, Any]]:
    return [{"id": c.id, "function": {"index": i, "name": c.name, "arguments": c.arguments}}
            for i, c in enumerate(calls)]


def final_fields(fin: Finished, waited: int = 0) -> dict[str, Any]:
    """done_reason and the six figures of a last chunk, in nanoseconds (the worker's measures
    and the gateway's wait for a load).

    load_duration is the time the request waited in the gateway for its model to load (a
    lazy worker's start, a first load, a model switch: `waited`, nanoseconds) plus the
    worker's time from receipt to hand-over (template, tokenizer, queue). NOTE: durations are
    at least 1 ns so that clients dividing by them (tokens/s) never divide by zero, and total
    is at least the sum of parts (it then includes the load, as Ollama's does).
    """
    t = fin.timings
    load = waited + max(t.queue_ns, 0)
    prompt, decode = max(t.prompt_ns, 1), max(t.decode_ns, 1)
    return {
        "done_reason": DONE_REASON.get(fin.finish_reason, "stop"),
        "total_duration": max(waited + t.total_ns, load + prompt + decode),
        "load_duration": load,
        "prompt_eval_count": fin.prompt_tokens,
        "prompt_eval_duration": prompt,
        "eval_count": fin.completion_tokens,
        "eval_duration": decode,
    }


def chunk(model: str, text: str, chat: bool, thinking: str = "") -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "created_at": utc_now()}
    if chat:
        body["message"] = {"role": "assistant", "content": text}
        if thinking:
            body["message"]["thinking"] = thinking
    else:
        body["response"] = text
        if thinking:
            body["thinking"] = thinking
    body["done"] = False
    return body


def last(gen: Generation, body: dict[str, Any]) -> dict[str, Any]:
    """A chunk made the final one: done, with done_reason and the figures."""
    body["done"] = True
    if gen.finished is not None:
        body.update(final_fields(gen.finished, gen.load_wait_ns))
    return body


# --- responses ---------------------------------------------------------------------------


class OllamaReply:
    """/api/generate's `response` or /api/chat's `message` chunks, or one object. With tools
    offered, text that may be a call is held back by the parser; calls go out whole in one
    done:false chunk before the last one."""

    def __init__(self, name: str, chat: bool, parser: CallParser | None,
                 logprobs: int | None = None, thinking: Thinking | None = None) -> None:
        self.name = name
        self.chat = chat
        self.parser = parser
        self.logprobs = logprobs  # None: not asked; else top_logprobs
        self.thinking = thinking

    async def events(self, gen: Generation) -> AsyncIterator[dict[str, Any]]:
        name, chat, parser, top = self.name, self.chat, self.parser, self.logprobs
        every = parser is None and self.thinking is None  # a chunk per delta, even empty
        async for delta, thought, answer in pieces(gen, self.thinking):
            text = parser.feed(answer) if parser is not None else answer
            if top is not None and delta is not None and delta.logprobs:
                # NOTE: with tools, the parser may hold text back; the tokens go out as they
                # come (they are the model's raw output).
                body = chunk(name, text, chat, thought)
                body["logprobs"] = lp.ollama(delta.logprobs, top)
                yield body
            elif text or thought or every:
                yield chunk(name, text, chat, thought)
        if parser is not None:
            rest, calls = parser.finish(gen.cut)
            if calls or rest:
                body = chunk(name, "" if calls and rest.isspace() else rest, chat)
                if calls:
                    body["message"]["tool_calls"] = tool_calls_json(calls)
                yield body
        yield last(gen, chunk(name, "", chat))

    def body(self, gen: Generation, parts: list[str]) -> dict[str, Any]:
        thought, answer = split_parts(parts, self.thinking)
        text, calls = split_calls(answer, self.parser, gen.cut)
        body = chunk(self.name, text, self.chat, thought)
        if calls:
            body["message"]["tool_calls"] = tool_calls_json(calls)
        if self.logprobs is not None:
            body["logprobs"] = lp.ollama(gen.logprobs, self.logprobs)
        return last(gen, body)
