"""OpenAI dialect: /v1/chat/completions, /v1/completions, /v1/models.

Translates the wire format to a Generate request and the worker's frames back to OpenAI's
JSON and SSE shapes; routing, streaming and errors below are shared with the other APIs.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from gateway.api import anthropic as anthropic_api
from gateway.api.common import (
    decode_body,
    dumps,
    new_id,
    now,
    request_id,
    unless_disconnected,
)
from gateway.api.dialects import ANTHROPIC, OPENAI, dialect_for
from gateway.api.params import json_schema_text, openai_params
from gateway.api.tools import (
    CallParser,
    ToolCall,
    Tooling,
    ToolRequest,
    fragments,
    history_call,
    openai_choice,
    openai_tools,
    split_calls,
)
from gateway.core.errors import GatewayError, invalid
from gateway.core.model_table import ServedModel
from gateway.core.router import Generation, Router
from protocol.messages import ChatMessage, Generate, SamplingParams

FINISH = {"stop": "stop", "length": "length", "abort": "stop", "timeout": "length"}


# --- request shapes ----------------------------------------------------------------------


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None
    image_url: Any = None


class Message(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class JsonSchemaSpec(msgspec.Struct):
    name: str = "response"
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct):
    type: str
    json_schema: JsonSchemaSpec | None = None


class SamplingFields(msgspec.Struct):
    model: str = ""
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logprobs: Any = None
    # Extensions some clients send (vLLM style).
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False


class ChatRequest(SamplingFields):
    messages: list[Message] = []
    max_completion_tokens: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    top_logprobs: int | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | None = None
    suffix: str | None = None
    echo: bool | None = False


# --- translation -------------------------------------------------------------------------


def _text(content: str | list[ContentPart] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.type == "text":
            parts.append(part.text or "")
        elif part.type in ("image_url", "input_image", "image"):
            raise invalid("this model does not support images", param="messages")
    return "".join(parts)


def chat_messages(messages: list[Message]) -> list[ChatMessage]:
    if not messages:
        raise invalid("messages must be a non-empty list", param="messages")
    out = []
    for m in messages:
        role = "system" if m.role == "developer" else m.role
        if role not in ("system", "user", "assistant", "tool", "function"):
            raise invalid(f"unknown message role '{m.role}'", param="messages")
        calls = None
        if role == "assistant" and m.tool_calls:
            calls = [_history_call(c) for c in m.tool_calls]
        out.append(ChatMessage(role=role, content=_text(m.content), name=m.name,
                               tool_call_id=m.tool_call_id, tool_calls=calls))
    return out


def _history_call(call: dict[str, Any]) -> dict[str, Any]:
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise invalid("each tool_calls entry needs function.name", param="messages")
    return history_call(call.get("id"), fn["name"], fn.get("arguments"))


def tool_request(req: ChatRequest) -> ToolRequest | None:
    if not req.tools:
        if req.tool_choice not in (None, "none", "auto"):
            raise invalid("tool_choice needs tools", param="tool_choice")
        return None
    tools = openai_tools(req.tools)
    return ToolRequest(tools, openai_choice(req.tool_choice, bool(tools)),
                       req.parallel_tool_calls is not False)


def tool_calls_json(calls: list[ToolCall]) -> list[dict[str, Any]]:
    return [{"id": c.id, "type": "function",
             "function": {"name": c.name, "arguments": c.arguments_json()}} for c in calls]


def _check_common(req: SamplingFields) -> None:
    if req.n not in (None, 1):
        raise invalid("only n=1 is supported", param="n")
    if req.logprobs:
        raise invalid("logprobs are not supported by this server", param="logprobs")


def _response_schema(fmt: ResponseFormat | None) -> str | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return json_schema_text(None)
    if fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema is None:
            raise invalid("response_format.json_schema.schema is required",
                          param="response_format")
        return json_schema_text(fmt.json_schema.schema)
    raise invalid(f"unknown response_format type '{fmt.type}'", param="response_format")


def _params(req: SamplingFields, max_tokens: int | None, schema: str | None) -> SamplingParams:
    return openai_params(
        max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, stop=req.stop,
        seed=req.seed, presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty, top_k=req.top_k, min_p=req.min_p,
        repetition_penalty=req.repetition_penalty, json_schema=schema,
        ignore_eos=req.ignore_eos)


def _usage(gen: Generation) -> dict[str, int]:
    fin = gen.finished
    prompt = fin.prompt_tokens if fin else gen.accepted.prompt_tokens
    completion = fin.completion_tokens if fin else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def _finish_reason(gen: Generation, calls: bool = False, named: bool = False) -> str:
    if calls:
        # NOTE: OpenAI answers a named tool_choice with "stop", "required"/"auto" with
        # "tool_calls".
        return "stop" if named else "tool_calls"
    return FINISH.get(gen.finished.finish_reason if gen.finished else "stop", "stop")


# --- routes ------------------------------------------------------------------------------


class OpenAIRoutes:
    def __init__(self, router: Router, tooling: Tooling) -> None:
        self.router = router
        self.tooling = tooling

    def routes(self) -> list[Route]:
        return [
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/models", self.list_models, methods=["GET"]),
            Route("/v1/models/{model_id:path}", self.get_model, methods=["GET"]),
        ]

    def _model_card(self, model: ServedModel) -> dict[str, Any]:
        return {"id": model.name, "object": "model", "created": self.router.started,
                "owned_by": "npu-proxy"}

    async def list_models(self, request: Request) -> Response:
        if dialect_for(request.scope) is ANTHROPIC:
            return anthropic_api.models_page(list(self.router.models), self.router.started,
                                             request)
        data = [self._model_card(m) for m in self.router.models.values()]
        return JSONResponse({"object": "list", "data": data})

    async def get_model(self, request: Request) -> Response:
        dialect = dialect_for(request.scope)
        try:
            model = self.router.resolve(request.path_params["model_id"])
        except GatewayError as exc:
            return dialect.error_response(exc)
        if dialect is ANTHROPIC:
            return JSONResponse(anthropic_api.model_info(model.name, self.router.started))
        return JSONResponse(self._model_card(model))

    async def chat(self, request: Request) -> Response:
        rid = request_id(request)
        try:
            req = await decode_body(request, ChatRequest)
            if not req.messages:
                raise invalid("'messages' is a required property and must be non-empty",
                              param="messages")
            _check_common(req)
            model = self.router.resolve(req.model, kind="llm")
            max_tokens = req.max_completion_tokens or req.max_tokens
            params = _params(req, max_tokens, _response_schema(req.response_format))
            tools = tool_request(req)
            prep = await self.tooling.prepare(model, chat_messages(req.messages), tools, params)
            msg = Generate(id=rid, model=model.name, params=params,
                           deadline=self.router.deadline(), messages=prep.messages,
                           tools=prep.tools)
            gen = await unless_disconnected(request, self.router.generate(model, msg))
        except GatewayError as exc:
            return OPENAI.error_response(exc)
        cid = new_id("chatcmpl-")
        headers = gen.headers()
        named = tools is not None and tools.named
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(
                self._chat_stream(gen, cid, req.model, include_usage, prep.parser(), named),
                media_type="text/event-stream", headers=headers)
        try:
            text = await unless_disconnected(request, _collect(gen))
        except GatewayError as exc:
            return OPENAI.error_response(exc, headers)
        text, calls = split_calls(text, prep.parser())
        message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
        if calls:
            message["content"] = text or None
            message["tool_calls"] = tool_calls_json(calls)
        body = {
            "id": cid, "object": "chat.completion", "created": now(), "model": req.model,
            "system_fingerprint": None,
            "choices": [{
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": _finish_reason(gen, bool(calls), named),
            }],
            "usage": _usage(gen),
        }
        return Response(dumps(body), media_type="application/json", headers=headers)

    async def _chat_stream(self, gen: Generation, cid: str, model: str,
                           include_usage: bool, parser: CallParser | None = None,
                           named: bool = False) -> AsyncIterator[bytes]:
        """With tools offered, text that may be a call is held back by the parser and the
        calls go out at the end: per call a first delta with id, type and name and empty
        arguments, then deltas with only the index and argument fragments."""
        created = now()

        def chunk(delta: dict[str, Any], finish: str | None) -> bytes:
            obj: dict[str, Any] = {
                "id": cid, "object": "chat.completion.chunk", "created": created,
                "model": model, "system_fingerprint": None,
                "choices": [{"index": 0, "delta": delta, "logprobs": None,
                             "finish_reason": finish}],
            }
            if include_usage:
                obj["usage"] = None
            return b"data: " + dumps(obj) + b"\n\n"

        yield chunk({"role": "assistant", "content": ""}, None)
        calls: list[ToolCall] = []
        try:
            async for delta in gen:
                text = parser.feed(delta.text) if parser is not None else delta.text
                if text:
                    yield chunk({"content": text}, None)
        except GatewayError as exc:
            yield OPENAI.error_event(exc)
            return
        if parser is not None:
            rest, calls = parser.finish()
            if rest and not (calls and rest.isspace()):
                yield chunk({"content": rest}, None)
        for index, call in enumerate(calls):
            yield chunk({"tool_calls": [{"index": index, "id": call.id, "type": "function",
                                         "function": {"name": call.name, "arguments": ""}}]},
                        None)
            for piece in fragments(call.arguments_json()):
                yield chunk({"tool_calls": [{"index": index,
                                             "function": {"arguments": piece}}]}, None)
        yield chunk({}, _finish_reason(gen, bool(calls), named))
        if include_usage:
            usage = {"id": cid, "object": "chat.completion.chunk", "created": created,
                     "model": model, "system_fingerprint": None, "choices": [],
                     "usage": _usage(gen)}
            yield b"data: " + dumps(usage) + b"\n\n"
        yield b"data: [DONE]\n\n"

    async def completions(self, request: Request) -> Response:
        rid = request_id(request)
        try:
            req = await decode_body(request, CompletionRequest)
            _check_common(req)
            if req.prompt is None:
                raise invalid("'prompt' is a required property", param="prompt")
            prompts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
            if len(prompts) != 1:
                raise invalid("exactly one prompt per request is supported", param="prompt")
            if req.suffix:
                raise invalid("this model has no fill-in-the-middle support; remove 'suffix'",
                              param="suffix")
            model = self.router.resolve(req.model, kind="llm")
            params = _params(req, req.max_tokens if req.max_tokens is not None else 16, None)
            msg = Generate(id=rid, model=model.name, params=params,
                           deadline=self.router.deadline(), prompt=prompts[0])
            gen = await unless_disconnected(request, self.router.generate(model, msg))
        except GatewayError as exc:
            return OPENAI.error_response(exc)
        cid = new_id("cmpl-")
        prefix = prompts[0] if req.echo else ""
        headers = gen.headers()
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(
                self._completion_stream(gen, cid, req.model, prefix, include_usage),
                media_type="text/event-stream", headers=headers)
        try:
            text = await unless_disconnected(request, _collect(gen))
        except GatewayError as exc:
            return OPENAI.error_response(exc, headers)
        body = {
            "id": cid, "object": "text_completion", "created": now(), "model": req.model,
            "system_fingerprint": None,
            "choices": [{"index": 0, "text": prefix + text, "logprobs": None,
                         "finish_reason": _finish_reason(gen)}],
            "usage": _usage(gen),
        }
        return Response(dumps(body), media_type="application/json", headers=headers)

    async def _completion_stream(self, gen: Generation, cid: str, model: str, prefix: str,
                                 include_usage: bool) -> AsyncIterator[bytes]:
        created = now()

        def chunk(text: str, finish: str | None) -> bytes:
            obj: dict[str, Any] = {
                "id": cid, "object": "text_completion", "created": created, "model": model,
                "system_fingerprint": None,
                "choices": [{"index": 0, "text": text, "logprobs": None,
                             "finish_reason": finish}],
            }
            if include_usage:
                obj["usage"] = None
            return b"data: " + dumps(obj) + b"\n\n"

        if prefix:
            yield chunk(prefix, None)
        try:
            async for delta in gen:
                yield chunk(delta.text, None)
        except GatewayError as exc:
            yield OPENAI.error_event(exc)
            return
        yield chunk("", _finish_reason(gen))
        if include_usage:
            usage = {"id": cid, "object": "text_completion", "created": created, "model": model,
                     "choices": [], "usage": _usage(gen)}
            yield b"data: " + dumps(usage) + b"\n\n"
        yield b"data: [DONE]\n\n"


async def _collect(gen: Generation) -> str:
    parts = [delta.text async for delta in gen]
    return "".join(parts)

