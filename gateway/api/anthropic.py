"""Anthropic dialect: POST /v1/messages and /v1/messages/count_tokens (what Claude Code speaks).

Translates the Messages wire format to a Generate request and the worker's output back to a
message object or the named SSE events (`message_start`, `content_block_start`,
`content_block_delta` with `text_delta`/`input_json_delta`, `content_block_stop`,
`message_delta`, `message_stop`; `ping` after the start). Decoding, dispatch, streaming and
errors are the shared request path (gateway/api/request_path.py); the error shape (503 as 529), the
`error` event mid-stream and the event framing are ANTHROPIC in gateway/http/wire.py. Tools
(gateway/content/tools/) and sampling (gateway/content/params.py) are shared too.

Decisions:
- `x-api-key` or `Authorization: Bearer` are accepted (checked by gateway/http/auth.py when an
  api_key is configured); `anthropic-version`, `anthropic-beta` and `?beta=true` are ignored.
- `claude-*` model names resolve to a local model (Router.resolve: `claude_model`, else the
  default LLM), and the response echoes the name that was asked for.
- The request's `system`, `messages` (a `system` role inside them is a system turn at its
  position), content blocks and tools are translated by gateway/api/anthropic_input.py;
  `cache_control`, `metadata`, `context_management`, `output_config.effort`,
  `thinking.display` are accepted and change nothing; a `defer_loading` tool is shown to
  the model once a tool result's `tool_reference` names it (or tool_choice does); server tools are
  left out and named in the `X-NPU-Proxy-Ignored` header. `image` blocks (a base64 source,
  or a url source where the server fetches URLs) on a model with vision go with their user
  message, or with the tool message of the tool_result holding them.
- `thinking` (`{"type": "enabled", ...}`) on a thinking model gives its reasoning as a
  `thinking` block (signature "") before the text, streamed as `thinking_delta`s; without it
  the template's `enable_thinking` is false and any reasoning is left out, as Claude does.
  Asked of a model that does not think, it is ignored: Claude Code asks for it by itself.
- `output_config.format` (a JSON schema) constrains the text like OpenAI's response_format.
- A trailing assistant message is a finished turn, not a prefill to continue.
- Tool results become tool messages; `is_error` results are prefixed with "Error: ".
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from npu_proxy.gateway.api.anthropic_input import (
    InMessage,
    chat_messages,
    loaded_tools,
    output_schema,
    tool_request,
)
from npu_proxy.gateway.api.dispatch import Dispatch
from npu_proxy.gateway.api.request_path import (
    DialectRoutes,
    Generation,
    ModelFacts,
    invalid,
    new_id,
)
from npu_proxy.gateway.content.ignored import Ignored
from npu_proxy.gateway.content.params import anthropic_params
from npu_proxy.gateway.content.reasoning import Thinking, pieces, split_parts, template_vars
from npu_proxy.gateway.content.stops import StopMatcher
from npu_proxy.gateway.content.tools import CallParser, ToolCall, fragments

__all__ = ["AnthropicRoutes", "CountRequest", "InMessage", "MessagesRequest", "chat_messages",
           "model_info", "models_page"]

log = logging.getLogger(__name__)



# --- request shapes ----------------------------------------------------------------------


class CountRequest(msgspec.Struct):
    model: str = ""
    messages: list[InMessage] = []
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None


class MessagesRequest(CountRequest):
    max_tokens: int | None = None
    stream: bool | None = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stop_sequences: list[str] | None = None
    output_config: dict[str, Any] | None = None


# --- models (GET /v1/models, shared with OpenAI: gateway/http/wire.py tells them apart) -


def model_info(name: str, created: int) -> dict[str, Any]:
    when = datetime.fromtimestamp(created, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"type": "model", "id": name, "display_name": name, "created_at": when}


def models_page(names: list[str], created: int, request: Request) -> Response:
    """A page of Anthropic's model list: limit (1-1000, default 20), after_id, before_id."""
    query = request.query_params
    try:
        limit = int(query.get("limit", "20"))
        if not 1 <= limit <= 1000:
            raise ValueError
        start, end = 0, len(names)
        if "after_id" in query:
            start = names.index(query["after_id"]) + 1
        if "before_id" in query:
            end = names.index(query["before_id"])
    except ValueError:
        raise invalid("limit must be 1 to 1000, and after_id/before_id the id of a listed model",
                      param="limit") from None
    if "before_id" in query and "after_id" not in query:
        page, has_more = names[max(start, end - limit):end], end - limit > start
    else:
        page, has_more = names[start:min(end, start + limit)], start + limit < end
    return JSONResponse({"data": [model_info(n, created) for n in page], "has_more": has_more,
                         "first_id": page[0] if page else None,
                         "last_id": page[-1] if page else None})


class Output:
    """The worker's text through the stop matcher and the tool-call parser, in that order."""

    def __init__(self, stops: list[str], parser: CallParser | None) -> None:
        self.stop = StopMatcher(stops)
        self.parser = parser
        self.stop_sequence: str | None = None

    def feed(self, text: str) -> str:
        text = self.stop.feed(text)
        return self.parser.feed(text) if self.parser is not None and text else text

    def finish(self, gen: Generation) -> tuple[str, list[ToolCall]]:
        text = self.stop.finish()
        self.stop_sequence = self.stop.matched
        if self.parser is None:
            return text, []
        head = self.parser.feed(text) if text else ""
        rest, calls = self.parser.finish(gen.cut)
        return head + rest, calls

    def stop_reason(self, gen: Generation, calls: list[ToolCall]) -> str:
        if calls and not gen.cut:
            return "tool_use"
        if self.stop_sequence is not None:
            return "stop_sequence"
        fin = gen.finished
        if fin is not None and fin.finish_reason in ("length", "timeout"):
            return "max_tokens"
        return "end_turn"


def _usage(gen: Generation) -> dict[str, int]:
    fin = gen.finished
    # NOTE: cache counts are not measured (docs/api.md, "Usage and cached tokens"): 0.
    return {"input_tokens": fin.prompt_tokens if fin else gen.accepted.prompt_tokens,
            "output_tokens": fin.completion_tokens if fin else 0,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}


def _tool_use(call: ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": call.arguments}


# --- responses ---------------------------------------------------------------------------


class MessageReply:
    """A message object, or its named events. Text goes out as it comes (one text block,
    opened at the first text); calls, held back by the parser, go out at the end as tool_use
    blocks with their input JSON in input_json_delta fragments."""

    def __init__(self, model: str, out: Output, thinking: Thinking | None = None) -> None:
        self.id = new_id("msg_")
        self.model = model
        self.out = out
        self.thinking = thinking

    async def events(self, gen: Generation) -> AsyncIterator[dict[str, Any]]:
        out = self.out
        usage = _usage(gen)
        usage["output_tokens"] = 0
        yield {"type": "message_start", "message": {
            "id": self.id, "type": "message", "role": "assistant", "model": self.model,
            "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage}}
        yield {"type": "ping"}
        index = 0
        text_open = thinking_open = False

        def thinking_events(thought: str) -> list[dict[str, Any]]:
            nonlocal thinking_open
            events = []
            if not thinking_open:
                thinking_open = True
                events.append({"type": "content_block_start", "index": index,
                               "content_block": {"type": "thinking", "thinking": "",
                                                 "signature": ""}})
            events.append({"type": "content_block_delta", "index": index,
                           "delta": {"type": "thinking_delta", "thinking": thought}})
            return events

        def text_events(text: str) -> list[dict[str, Any]]:
            nonlocal text_open, thinking_open, index
            events = []
            if thinking_open:
                thinking_open = False
                events += [{"type": "content_block_delta", "index": index,
                            "delta": {"type": "signature_delta", "signature": ""}},
                           {"type": "content_block_stop", "index": index}]
                index += 1
            if not text_open:
                text_open = True
                events.append({"type": "content_block_start", "index": index,
                               "content_block": {"type": "text", "text": ""}})
            events.append({"type": "content_block_delta", "index": index,
                           "delta": {"type": "text_delta", "text": text}})
            return events

        async for _, thought, answer in pieces(gen, self.thinking):
            if thought and not text_open:
                for event in thinking_events(thought):
                    yield event
            if text := out.feed(answer):
                for event in text_events(text):
                    yield event
        rest, calls = out.finish(gen)
        if rest and not (calls and rest.isspace()):
            for event in text_events(rest):
                yield event
        if not text_open and (thinking_open or not calls):
            for event in text_events(""):
                yield event
        if text_open:
            yield {"type": "content_block_stop", "index": index}
            index += 1
        for call in calls:
            call.id = new_id("toolu_")
            yield {"type": "content_block_start", "index": index,
                   "content_block": {"type": "tool_use", "id": call.id, "name": call.name,
                                     "input": {}}}
            for piece in fragments(call.arguments_json()):
                yield {"type": "content_block_delta", "index": index,
                       "delta": {"type": "input_json_delta", "partial_json": piece}}
            yield {"type": "content_block_stop", "index": index}
            index += 1
        yield {"type": "message_delta",
               "delta": {"stop_reason": out.stop_reason(gen, calls),
                         "stop_sequence": out.stop_sequence},
               "usage": {"output_tokens": _usage(gen)["output_tokens"]}}
        yield {"type": "message_stop"}

    def body(self, gen: Generation, parts: list[str]) -> dict[str, Any]:
        out = self.out
        thought, answer = split_parts(parts, self.thinking)
        text = out.feed(answer)
        rest, calls = out.finish(gen)
        text = (text + rest).strip() if calls else text + rest
        for call in calls:
            call.id = new_id("toolu_")
        content: list[dict[str, Any]] = []
        if thought:
            content.append({"type": "thinking", "thinking": thought, "signature": ""})
        if text or not calls:
            content.append({"type": "text", "text": text})
        content += [_tool_use(c) for c in calls]
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": out.stop_reason(gen, calls),
                "stop_sequence": out.stop_sequence, "usage": _usage(gen)}


# --- routes ------------------------------------------------------------------------------


class AnthropicRoutes(DialectRoutes):
    def routes(self) -> list[Route]:
        return [
            self.requests.post("/v1/messages", MessagesRequest, self.messages),
            self.requests.post("/v1/messages/count_tokens", CountRequest, self.count_tokens),
        ]

    def _thinking(self, facts: ModelFacts, req: CountRequest,
                  ) -> tuple[Thinking | None, dict[str, Any] | None]:
        """`thinking` enabled (or adaptive) shows the reasoning; else the template's
        enable_thinking is false. The same for count_tokens, so its count is input_tokens."""
        want = (req.thinking or {}).get("type") in ("enabled", "adaptive")
        thinking = self.requests.thinking(facts, want, req.model, None)
        return thinking, template_vars(want) if thinking is not None else None

    async def count_tokens(self, request: Request, req: CountRequest) -> Response:
        model = self.requests.resolve(req.model, kind="llm")
        # NOTE: prepared exactly like /v1/messages, so the count equals its input_tokens.
        facts = await self.requests.facts(model)
        _, variables = self._thinking(facts, req)
        msg = await self.requests.tokenize(request, facts,
                                       await chat_messages(req.system, req.messages,
                                                           facts.capabilities,
                                                           req.model, self.requests.images()),
                                       tool_request(req.tools, req.tool_choice,
                                                    self.requests.limits.tool_budget(),
                                                    loaded=loaded_tools(req.messages,
                                                                        req.tool_choice)),
                                       template_vars=variables)
        count = (await self.requests.count(request, model, msg)).count
        return JSONResponse({"input_tokens": count})

    async def messages(self, request: Request, req: MessagesRequest) -> Dispatch:
        params = anthropic_params(max_tokens=req.max_tokens, temperature=req.temperature,
                                  top_p=req.top_p, top_k=req.top_k,
                                  stop_sequences=req.stop_sequences)
        params = msgspec.structs.replace(params, json_schema=output_schema(req.output_config))
        model = self.requests.resolve(req.model, kind="llm")
        facts = await self.requests.facts(model)
        thinking, variables = self._thinking(facts, req)
        ignored = Ignored()
        messages = await chat_messages(req.system, req.messages, facts.capabilities, req.model,
                                       self.requests.images(), ignored)
        msg, parser = await self.requests.chat(request, facts, messages,
                                           tool_request(req.tools, req.tool_choice,
                                                        self.requests.limits.tool_budget(),
                                                        ignored, loaded_tools(
                                                            req.messages, req.tool_choice)),
                                           params, requested=req.model,
                                           template_vars=variables)
        reply = MessageReply(req.model, Output(params.stop, parser), thinking)
        return Dispatch(model, msg, bool(req.stream), reply, ignored=ignored)
