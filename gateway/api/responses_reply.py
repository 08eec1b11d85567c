"""The Responses API's answer: one response object, or its sequence of named events.

A response's `output` is a list of items: at most one `message` (the text, as one
`output_text` part) and then one `function_call` item per call the parser found
(gateway/api/tools.py; calls are held back by the parser, so they go out after the text).

A stream, every event numbered by `sequence_number` from 0:

    response.created, response.in_progress
    response.output_item.added (message), response.content_part.added,
      response.output_text.delta ..., response.output_text.done,
      response.content_part.done, response.output_item.done
    per call: response.output_item.added (function_call),
      response.function_call_arguments.delta ..., response.function_call_arguments.done,
      response.output_item.done
    response.completed | response.incomplete (max_output_tokens) | response.failed

A failure after the first event (a worker lost, a deadline, a frame gap) is the stream's
`response.failed`, with `error.code` "server_error", as OpenAI ends a response that failed.
A finished response is kept in the store when the request asked for it (`store`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from gateway.api.common import new_id, now
from gateway.api.response_store import ResponseStore
from gateway.api.tools import CallParser, ToolCall, fragments, history_call, split_calls
from gateway.core.errors import GatewayError
from gateway.core.router import Generation
from protocol.messages import ChatMessage

Event = dict[str, Any]


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [output_text(text)]
    return {"id": item_id, "type": "message", "status": status, "role": "assistant",
            "content": content}


def call_item(item_id: str, call: ToolCall, arguments: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "status": status, "call_id": call.id,
            "name": call.name, "arguments": arguments}


def usage(gen: Generation) -> dict[str, Any]:
    fin = gen.finished
    prompt = fin.prompt_tokens if fin else gen.accepted.prompt_tokens
    completion = fin.completion_tokens if fin else gen.tokens
    # NOTE: no prompt cache is reported by the workers, and no model thinks yet (the hook
    # for that is gateway/api/responses.py `reasoning`): both details are 0.
    return {"input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion}


def cut_short(gen: Generation, calls: list[ToolCall]) -> bool:
    """Stopped by max_output_tokens (or the deadline) rather than by the model."""
    fin = gen.finished
    return not calls and fin is not None and fin.finish_reason in ("length", "timeout")


def failure(exc: GatewayError) -> dict[str, Any]:
    code = "invalid_prompt" if exc.status == 400 else "server_error"
    return {"code": code, "message": exc.message}


class ResponseReply:
    """`echo` holds what the response object repeats of its request (model, tools, text,
    tool_choice, ...); `conversation` is the input the response answers, which the store
    keeps with the output for a continuation (`store` is None when it is not kept)."""

    def __init__(self, echo: dict[str, Any], parser: CallParser | None,
                 store: ResponseStore | None, conversation: list[ChatMessage]) -> None:
        self.id = new_id("resp_")
        self.created = now()
        self.echo = echo
        self.parser = parser
        self.store = store
        self.conversation = conversation

    def envelope(self, status: str, output: list[dict[str, Any]],
                 gen: Generation | None = None, *, error: dict[str, Any] | None = None,
                 incomplete: bool = False) -> dict[str, Any]:
        return {"id": self.id, "object": "response", "created_at": self.created,
                "status": status, "error": error,
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                **self.echo, "output": output, "usage": usage(gen) if gen else None}

    def final(self, gen: Generation, output: list[dict[str, Any]], text: str,
              calls: list[ToolCall]) -> dict[str, Any]:
        """The finished response object, kept in the store when asked."""
        short = cut_short(gen, calls)
        body = self.envelope("incomplete" if short else "completed", output, gen,
                             incomplete=short)
        if self.store is not None:
            said = ChatMessage(role="assistant", content=text, tool_calls=[
                history_call(c.id, c.name, c.arguments) for c in calls] or None)
            self.store.put(self.id, body, [*self.conversation, said])
        return body

    def body(self, gen: Generation, parts: list[str]) -> dict[str, Any]:
        text, calls = split_calls("".join(parts), self.parser)
        status = "incomplete" if cut_short(gen, calls) else "completed"
        output = []
        if text or not calls:
            output.append(message_item(new_id("msg_"), text, status))
        output += [call_item(new_id("fc_"), c, c.arguments_json(), "completed") for c in calls]
        return self.final(gen, output, text, calls)

    async def events(self, gen: Generation) -> AsyncIterator[Event]:
        seq = 0
        async for event in _Events(self, gen).run():
            event["sequence_number"] = seq
            seq += 1
            yield event


class _Events:
    """One stream's state: the items sent so far and the message item being written."""

    def __init__(self, reply: ResponseReply, gen: Generation) -> None:
        self.reply = reply
        self.gen = gen
        self.output: list[dict[str, Any]] = []
        self.msg_id: str | None = None  # the open message item
        self.texts: list[str] = []

    async def run(self) -> AsyncIterator[Event]:
        reply, gen, parser = self.reply, self.gen, self.reply.parser
        snapshot = reply.envelope("in_progress", [])
        yield {"type": "response.created", "response": snapshot}
        yield {"type": "response.in_progress", "response": snapshot}
        try:
            async for delta in gen:
                text = parser.feed(delta.text) if parser is not None else delta.text
                for event in self.text(text):
                    yield event
            rest, calls = parser.finish() if parser is not None else ("", [])
        except GatewayError as exc:
            if self.msg_id is not None:
                self.output.append(message_item(self.msg_id, "".join(self.texts),
                                                "incomplete"))
            yield {"type": "response.failed",
                   "response": reply.envelope("failed", self.output, error=failure(exc))}
            return
        if rest and not (calls and rest.isspace()):
            for event in self.text(rest):
                yield event
        if self.msg_id is None and not calls:
            for event in self.text("", force=True):
                yield event
        text = "".join(self.texts)
        if self.msg_id is not None:
            for event in self.close_message(cut_short(gen, calls)):
                yield event
        for call in calls:
            for event in self.call(call):
                yield event
        final = reply.final(gen, self.output, text.strip() if calls else text, calls)
        kind = "response.incomplete" if final["status"] == "incomplete" else \
            "response.completed"
        yield {"type": kind, "response": final}

    def _at(self) -> dict[str, Any]:
        return {"item_id": self.msg_id, "output_index": len(self.output), "content_index": 0}

    def text(self, text: str, force: bool = False) -> list[Event]:
        if not text and not force:
            return []
        events: list[Event] = []
        if self.msg_id is None:
            self.msg_id = new_id("msg_")
            events.append({"type": "response.output_item.added",
                           "output_index": len(self.output),
                           "item": message_item(self.msg_id, None, "in_progress")})
            events.append({"type": "response.content_part.added", **self._at(),
                           "part": output_text("")})
        if text:
            self.texts.append(text)
            events.append({"type": "response.output_text.delta", **self._at(), "delta": text,
                           "logprobs": []})
        return events

    def close_message(self, short: bool) -> list[Event]:
        text = "".join(self.texts)
        item = message_item(str(self.msg_id), text, "incomplete" if short else "completed")
        events: list[Event] = [
            {"type": "response.output_text.done", **self._at(), "text": text, "logprobs": []},
            {"type": "response.content_part.done", **self._at(), "part": output_text(text)},
            {"type": "response.output_item.done", "output_index": len(self.output),
             "item": item},
        ]
        self.output.append(item)
        return events

    def call(self, call: ToolCall) -> list[Event]:
        item_id, index, arguments = new_id("fc_"), len(self.output), call.arguments_json()
        at = {"item_id": item_id, "output_index": index}
        events: list[Event] = [{"type": "response.output_item.added", "output_index": index,
                                "item": call_item(item_id, call, "", "in_progress")}]
        events += [{"type": "response.function_call_arguments.delta", **at, "delta": piece}
                   for piece in fragments(arguments)]
        item = call_item(item_id, call, arguments, "completed")
        events.append({"type": "response.function_call_arguments.done", **at,
                       "name": call.name, "arguments": arguments})
        events.append({"type": "response.output_item.done", "output_index": index, "item": item})
        self.output.append(item)
        return events
