"""The Responses API's answer: one response object, or its sequence of named events.

A response's `output` is a list of items: a thinking model's `reasoning` item first (its
reasoning as one `reasoning_text` content part, gateway/content/reasoning.py), at most one `message`
(the text, as one `output_text` part) and then one `function_call` item per call the parser
found (gateway/content/tools/; calls are held back by the parser, so they go out after the text).

A stream, every event numbered by `sequence_number` from 0:

    response.created, response.in_progress
    response.output_item.added (reasoning), response.content_part.added,
      response.reasoning_text.delta ..., response.reasoning_text.done,
      response.content_part.done, response.output_item.done
    response.output_item.added (message), response.content_part.added,
      response.output_text.delta ..., response.output_text.done,
      response.content_part.done, response.output_item.done
    per call: response.output_item.added (function_call),
      response.function_call_arguments.delta ..., response.function_call_arguments.done,
      response.output_item.done
      (a custom tool's: custom_tool_call, response.custom_tool_call_input.delta/.done)
    response.completed | response.incomplete (max_output_tokens) | response.failed

A failure after the first event (a worker lost, a deadline, a frame gap) is the stream's
`response.failed`, with `error.code` "server_error", as OpenAI ends a response that failed.
A finished response is kept in the store when the request asked for it (`store`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from npu_proxy.gateway.api.request_path import GatewayError, Generation, new_id, now
from npu_proxy.gateway.api.responses.sealed import Sealer
from npu_proxy.gateway.api.responses.store import ResponseStore
from npu_proxy.gateway.content.reasoning import Thinking, pieces, reasoning_tokens, split_parts
from npu_proxy.gateway.content.tools import (
    CallParser,
    ToolCall,
    fragments,
    history_call,
    split_calls,
)
from npu_proxy.protocol.messages import ChatMessage

Event = dict[str, Any]


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [output_text(text)]
    return {"id": item_id, "type": "message", "status": status, "role": "assistant",
                            "content": content}


def reasoning_text(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def reasoning_item(item_id: str, text: str | None, status: str,
                   sealer: Sealer | None = None) -> dict[str, Any]:
    """`summary` stays []: no summaries are written (the ignored header says so when asked);
    with a `sealer` the finished item carries the reasoning as `encrypted_content`."""
    content = [] if text is None else [reasoning_text(text)]
    item: dict[str, Any] = {"id": item_id, "type": "reasoning", "status": status, "summary": [],
                            "content": content}
    if sealer is not None:
        item["encrypted_content"] = sealer.seal(text) if text is not None else None
    return item


def call_item(item_id: str, call: ToolCall, arguments: str, status: str) -> dict[str, Any]:
    """A `function_call` item (naming its namespace when it has one), or a
    `custom_tool_call` with the free text as `input`."""
    item: dict[str, Any] = {"id": item_id, "type": "function_call", "status": status,
                            "call_id": call.id, "name": call.name}
    if call.kind == "custom":
        item.update(type="custom_tool_call", input=arguments)
    else:
        item["arguments"] = arguments
    if call.namespace is not None:
        item["namespace"] = call.namespace
    return item


def call_text(call: ToolCall) -> str:
    """What a call item carries: a function's arguments JSON, a custom tool's input text."""
    return call.custom_input() if call.kind == "custom" else call.arguments_json()


def usage(gen: Generation, reasoning: int = 0) -> dict[str, Any]:
    fin = gen.finished
    prompt = fin.prompt_tokens if fin else gen.accepted.prompt_tokens
    completion = fin.completion_tokens if fin else gen.tokens
    # NOTE: GenAI does not say how many prompt tokens its prefix cache served (docs/api.md,
    # "Usage and cached tokens"): 0, not a guess.
    return {"input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": prompt + completion}


def cut_short(gen: Generation, calls: list[ToolCall]) -> bool:
    """Stopped by max_output_tokens (or the deadline) rather than by the model: with no
    call, or a call cut off (partial); whole calls before the cut are a completed answer."""
    return gen.cut and all(c.partial is not None for c in calls)


def failure(exc: GatewayError) -> dict[str, Any]:
    code = "invalid_prompt" if exc.status == 400 else "server_error"
    return {"code": code, "message": exc.message}


class ResponseReply:
    """`echo` holds what the response object repeats of its request (model, tools, text,
    tool_choice, ...); `conversation` is the input the response answers, which the store
    keeps with the output for a continuation (`store` is None when it is not kept)."""

    def __init__(self, echo: dict[str, Any], parser: CallParser | None,
                 store: ResponseStore | None, conversation: list[ChatMessage],
                 thinking: Thinking | None = None, sealer: Sealer | None = None) -> None:
        self.id = new_id("resp_")
        self.created = now()
        self.echo = echo
        self.parser = parser
        self.store = store
        self.conversation = conversation
        self.thinking = thinking
        self.sealer = sealer
        self.seq = 0  # the next event's sequence_number

    def keepalive(self) -> dict[str, Any]:
        """A silent stream's keep-alive (a long prefill): response.in_progress again, numbered
        in turn. Codex counts only events as activity (an SSE comment does not reset its
        stream idle timeout, 300 s) and ignores a repeated in_progress; the OpenAI SDKs pass
        it through."""
        event = {"type": "response.in_progress", "response": self.envelope("in_progress", []),
                 "sequence_number": self.seq}
        self.seq += 1
        return event

    def envelope(self, status: str, output: list[dict[str, Any]],
                 gen: Generation | None = None, *, error: dict[str, Any] | None = None,
                 incomplete: bool = False, reasoning: int = 0) -> dict[str, Any]:
        return {"id": self.id, "object": "response", "created_at": self.created,
                "status": status, "error": error,
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
                **self.echo, "output": output,
                "usage": usage(gen, reasoning) if gen else None}

    def final(self, gen: Generation, output: list[dict[str, Any]], text: str,
              calls: list[ToolCall], parts: list[str]) -> dict[str, Any]:
        """The finished response object, kept in the store when asked."""
        short = cut_short(gen, calls)
        body = self.envelope("incomplete" if short else "completed", output, gen,
                             incomplete=short,
                             reasoning=reasoning_tokens(parts, gen.ends, self.thinking))
        if self.store is not None:
            said = ChatMessage(role="assistant", content=text, tool_calls=[
                history_call(c.id, c.name, c.arguments) for c in calls] or None)
            self.store.put(self.id, body, [*self.conversation, said])
        return body

    def body(self, gen: Generation, parts: list[str]) -> dict[str, Any]:
        thought, answer = split_parts(parts, self.thinking)
        text, calls = split_calls(answer, self.parser, gen.cut)
        status = "incomplete" if cut_short(gen, calls) else "completed"
        output = []
        if thought:
            output.append(reasoning_item(new_id("rs_"), thought, status, self.sealer))
        if text or not calls:
            output.append(message_item(new_id("msg_"), text, status))
        output += [call_item(new_id("fc_" if c.kind == "function" else "ctc_"), c, call_text(c),
                             "completed") for c in calls]
        return self.final(gen, output, text, calls, parts)

    async def events(self, gen: Generation) -> AsyncIterator[Event]:
        async for event in _Events(self, gen).run():
            event["sequence_number"] = self.seq
            self.seq += 1
            yield event


class _Events:
    """One stream's state: the items sent so far and the message item being written."""

    def __init__(self, reply: ResponseReply, gen: Generation) -> None:
        self.reply = reply
        self.gen = gen
        self.output: list[dict[str, Any]] = []
        self.msg_id: str | None = None  # the open message item
        self.texts: list[str] = []
        self.rs_id: str | None = None  # the open reasoning item
        self.thoughts: list[str] = []
        self.parts: list[str] = []  # the deltas' texts

    async def run(self) -> AsyncIterator[Event]:
        reply, gen, parser = self.reply, self.gen, self.reply.parser
        snapshot = reply.envelope("in_progress", [])
        yield {"type": "response.created", "response": snapshot}
        yield {"type": "response.in_progress", "response": snapshot}
        try:
            async for delta, thought, answer in pieces(gen, reply.thinking):
                if delta is not None:
                    self.parts.append(delta.text)
                for event in self.reason(thought):
                    yield event
                text = parser.feed(answer) if parser is not None else answer
                for event in self.text(text):
                    yield event
            rest, calls = parser.finish(gen.cut) if parser is not None else ("", [])
        except GatewayError as exc:
            if self.rs_id is not None:
                self.output.append(reasoning_item(self.rs_id, "".join(self.thoughts),
                                                  "incomplete"))
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
        for event in self.close_reasoning(cut_short(gen, calls)):
            yield event
        for call in calls:
            for event in self.call(call):
                yield event
        final = reply.final(gen, self.output, text.strip() if calls else text, calls,
                            self.parts)
        kind = "response.incomplete" if final["status"] == "incomplete" else \
            "response.completed"
        yield {"type": kind, "response": final}

    def _at(self, item_id: str | None = None) -> dict[str, Any]:
        return {"item_id": item_id or self.msg_id, "output_index": len(self.output),
                "content_index": 0}

    def reason(self, thought: str) -> list[Event]:
        if not thought or self.msg_id is not None:
            return []  # NOTE: reasoning after the answer began (harmony) is not shown
        events: list[Event] = []
        if self.rs_id is None:
            self.rs_id = new_id("rs_")
            events.append({"type": "response.output_item.added",
                           "output_index": len(self.output),
                           "item": reasoning_item(self.rs_id, None, "in_progress")})
            events.append({"type": "response.content_part.added", **self._at(self.rs_id),
                           "part": reasoning_text("")})
        self.thoughts.append(thought)
        events.append({"type": "response.reasoning_text.delta", **self._at(self.rs_id),
                       "delta": thought})
        return events

    def close_reasoning(self, short: bool) -> list[Event]:
        if self.rs_id is None:
            return []
        text, at = "".join(self.thoughts), self._at(self.rs_id)
        item = reasoning_item(self.rs_id, text, "incomplete" if short else "completed",
                              self.reply.sealer)
        self.rs_id = None
        events: list[Event] = [
            {"type": "response.reasoning_text.done", **at, "text": text},
            {"type": "response.content_part.done", **at, "part": reasoning_text(text)},
            {"type": "response.output_item.done", "output_index": at["output_index"],
             "item": item},
        ]
        self.output.append(item)
        return events

    def text(self, text: str, force: bool = False) -> list[Event]:
        if not text and not force:
            return []
        events: list[Event] = self.close_reasoning(False)
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
        custom = call.kind == "custom"
        item_id, index, arguments = new_id("ctc_" if custom else "fc_"), len(self.output), \
            call_text(call)
        at = {"item_id": item_id, "output_index": index}
        kind = "response.custom_tool_call_input" if custom else \
            "response.function_call_arguments"
        events: list[Event] = [{"type": "response.output_item.added", "output_index": index,
                                "item": call_item(item_id, call, "", "in_progress")}]
        events += [{"type": f"{kind}.delta", **at, "delta": piece}
                   for piece in fragments(arguments)]
        item = call_item(item_id, call, arguments, "completed")
        done: Event = {"type": f"{kind}.done", **at}
        done.update({"input": arguments} if custom else {"name": call.name,
                                                         "arguments": arguments})
        events.append(done)
        events.append({"type": "response.output_item.done", "output_index": index, "item": item})
        self.output.append(item)
        return events
