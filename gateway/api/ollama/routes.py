"""Ollama dialect: /, /api/version, /api/tags, /api/show, /api/ps, /api/generate, /api/chat.

Translates Ollama's wire format to a Generate request and the worker's output back to
Ollama's NDJSON chunks (streaming is the default) or one JSON object with `stream: false`.
Decoding, dispatch, streaming and errors are the shared request path
(gateway/api/request_path.py), and the sampling options go through the one mapping in
gateway/content/params.py. Errors are
`{"error": "..."}`; a failure after the stream started is written as a last `{"error": "..."}`
line (OLLAMA in gateway/http/wire.py).

Decisions where Ollama's semantics do not carry over:
- `template` (a Go template) is rendered here for the subset single-prompt templates use
  (gateway/api/ollama/template.py) and the result is sent raw; other templates are a 400.
  A model made by /api/create with such a TEMPLATE has it applied the same way; its SYSTEM,
  MESSAGE and PARAMETER settings apply to every request (gateway/content/created_model.py).
- `suffix`, `images` and `think` are a 400 unless the model has the capability (insert,
  vision, thinking: models/capabilities.py), the same facts /api/show reports. `images`
  (base64, as the ollama client sends a path's file) are decoded and checked by
  gateway/content/images.py; on /api/generate they go with the prompt as one user message, so
  `raw` and `template` (which bypass the chat template) are a 400 with images.
- A thinking model's reasoning is `message.thinking` (/api/chat) or `thinking`
  (/api/generate), split from the answer by gateway/content/reasoning.py; `think: false` leaves
  it out and sets the template's `enable_thinking` to false; absent, the model thinks.
- `context` (token ids of an earlier /api/generate exchange) is accepted and ignored, and the
  final chunk carries no `context`: workers stream text, not token ids, and the field is
  deprecated in Ollama. Clients that keep a conversation use /api/chat.
- Ollama has no tool_choice: tools given means "auto"; the extension `options.tool_choice`
  ("required", "none" or a function name) forces a call (gateway/content/tools/).
- keep_alive is reported by /api/ps, but a worker's configured model stays loaded; only a model
  a worker was switched to is unloaded when it runs out (gateway/core/switching.py). Load and
  unload requests are answered at once.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from npu_proxy.gateway.api.ollama import models as ollama_models
from npu_proxy.gateway.api.ollama.models import utc_now
from npu_proxy.gateway.api.ollama.template import render, supported
from npu_proxy.gateway.api.request_path import DialectRoutes, Dispatch, Handler, RequestPath
from npu_proxy.gateway.content import logprobs as lp
from npu_proxy.gateway.content.images import Images
from npu_proxy.gateway.content.params import json_schema_text, ollama_params
from npu_proxy.gateway.content.reasoning import Thinking, pieces, split_parts, template_vars
from npu_proxy.gateway.content.tools import (
    CallParser,
    ToolCall,
    ToolRequest,
    history_call,
    ollama_choice,
    openai_tools,
    split_calls,
)
from npu_proxy.gateway.core.catalog import ModelCatalog, require
from npu_proxy.gateway.core.errors import invalid
from npu_proxy.gateway.core.keep_alive import parse_keep_alive
from npu_proxy.gateway.core.model_table import ServedModel
from npu_proxy.gateway.core.router import Generation
from npu_proxy.gateway.http.util import dumps, request_id, wants_html
from npu_proxy.models.capabilities import INSERT, VISION, Capabilities
from npu_proxy.protocol.messages import ChatMessage, Finished, Generate, SamplingParams

log = logging.getLogger(__name__)

# The Ollama release whose API surface this server implements (README "Ollama's API
# level"): its native /api routes and its OpenAI compatibility including /v1/responses
# (Ollama 0.13.3; Codex CLI's Ollama provider wants >= 0.13.4 before it uses it).
# NOTE: numeric only; Open WebUI parses it as integers and some clients require >= 0.6.4.
OLLAMA_VERSION = "0.13.4"
DONE_REASON = {"stop": "stop", "length": "length", "abort": "stop", "timeout": "timeout"}
ROLES = ("system", "user", "assistant", "tool")
EFFORTS = ("low", "medium", "high")


# --- request shapes ----------------------------------------------------------------------


class Message(msgspec.Struct):
    role: str
    content: str | None = None
    images: list[str] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_name: str | None = None
    thinking: str | None = None


class _Request(msgspec.Struct):
    model: str = ""
    format: str | dict[str, Any] | None = None
    options: dict[str, Any] | None = None
    stream: bool | None = None
    keep_alive: float | str | None = None
    think: bool | str | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


class GenerateRequest(_Request):
    prompt: str | None = None
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool | None = None
    images: list[str] | None = None


class ChatRequest(_Request):
    messages: list[Message] | None = None
    tools: list[dict[str, Any]] | None = None


class ShowRequest(msgspec.Struct):
    model: str = ""
    name: str = ""  # the legacy spelling
    verbose: bool | None = None


# --- translation -------------------------------------------------------------------------


def format_schema(fmt: str | dict[str, Any] | None) -> str | None:
    """`format`: "" or absent = free text, "json" = any JSON object, an object = its schema."""
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return json_schema_text(None)
    if isinstance(fmt, dict):
        return json_schema_text(fmt)
    raise invalid(f"format must be \"json\" or a JSON schema object, not {fmt!r}",
                  param="format")


async def chat_messages(messages: list[Message], caps: Capabilities, requested: str,
                  images: Images) -> list[ChatMessage]:
    """The chat in the internal form; what the model cannot take (`caps`) is a 400."""
    out = []
    for i, m in enumerate(messages):
        if m.role not in ROLES:
            raise invalid(f"unknown message role '{m.role}' (use system, user, assistant or "
                          "tool)", param="messages")
        found: list[bytes] = []
        if m.images:
            require(caps, VISION, requested, "images")
            found = [await images.base64(text, f"messages[{i}].images[{j}]", "images")
                     for j, text in enumerate(m.images)]
        calls = None
        if m.tool_calls:
            calls = [history_call(c.get("id"), (c.get("function") or {}).get("name", ""),
                                  (c.get("function") or {}).get("arguments"))
                     for c in m.tool_calls]
        out.append(ChatMessage(role=m.role, content=m.content or "", name=m.tool_name,
                               tool_calls=calls, images=found))
    return out


def tool_request(req: ChatRequest) -> ToolRequest | None:
    """Ollama has no tool_choice: tools mean "auto", unless the `options.tool_choice`
    extension forces a call (see gateway/content/tools/)."""
    choice = (req.options or {}).get("tool_choice")
    if not req.tools:
        return None
    return ToolRequest(openai_tools(req.tools), ollama_choice(choice, True))


def tool_calls_json(calls: list[ToolCall]) -> list[dict[str, Any]]:
    return [{"id": c.id, "function": {"index": i, "name": c.name, "arguments": c.arguments}}
            for i, c in enumerate(calls)]


def _logprobs(req: GenerateRequest | ChatRequest) -> int | None:
    """None without logprobs, else the number of alternatives asked for (checked)."""
    top = lp.top_count(req.top_logprobs, "top_logprobs")
    return top if req.logprobs else None


def final_fields(fin: Finished) -> dict[str, Any]:
    """done_reason and the six figures of a last chunk, in nanoseconds measured by the worker.

    load_duration is the worker's time from receipt to hand-over (template, tokenizer, queue):
    models are loaded before any request. NOTE: durations are at least 1 ns so that clients
    dividing by them (tokens/s) never divide by zero, and total is at least the sum of parts.
    """
    t = fin.timings
    load, prompt, decode = max(t.queue_ns, 0), max(t.prompt_ns, 1), max(t.decode_ns, 1)
    return {
        "done_reason": DONE_REASON.get(fin.finish_reason, "stop"),
        "total_duration": max(t.total_ns, load + prompt + decode),
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
        body.update(final_fields(gen.finished))
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
            rest, calls = parser.finish()
            if calls or rest:
                body = chunk(name, "" if calls and rest.isspace() else rest, chat)
                if calls:
                    body["message"]["tool_calls"] = tool_calls_json(calls)
                yield body
        yield last(gen, chunk(name, "", chat))

    def body(self, gen: Generation, parts: list[str]) -> dict[str, Any]:
        thought, answer = split_parts(parts, self.thinking)
        text, calls = split_calls(answer, self.parser)
        body = chunk(self.name, text, self.chat, thought)
        if calls:
            body["message"]["tool_calls"] = tool_calls_json(calls)
        if self.logprobs is not None:
            body["logprobs"] = lp.ollama(gen.logprobs, self.logprobs)
        return last(gen, body)


# --- routes ------------------------------------------------------------------------------


class OllamaRoutes(DialectRoutes):
    def __init__(self, requests: RequestPath, catalog: ModelCatalog,
                 browser: Handler | None = None) -> None:
        super().__init__(requests)
        self.catalog = catalog
        # What `GET /` shows a browser (the status page, gateway/pages/status.py).
        self.browser = browser

    def routes(self) -> list[Route]:
        return [
            Route("/", self.root, methods=["GET", "HEAD"]),
            Route("/api/version", self.version, methods=["GET", "HEAD"]),
            Route("/api/tags", self.tags, methods=["GET", "HEAD"]),
            self.requests.post("/api/show", ShowRequest, self.show),
            Route("/api/ps", self.ps, methods=["GET", "HEAD"]),
            self.requests.post("/api/generate", GenerateRequest, self.generate),
            self.requests.post("/api/chat", ChatRequest, self.chat),
        ]

    async def root(self, request: Request) -> Response:
        if self.browser is not None and wants_html(request):
            return await self.browser(request)
        return PlainTextResponse("Ollama is running", headers={"Vary": "Accept"})

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": OLLAMA_VERSION})

    async def tags(self, request: Request) -> Response:
        body = await ollama_models.tags(self.catalog)
        return Response(dumps(body), media_type="application/json")

    async def ps(self, request: Request) -> Response:
        body = await ollama_models.ps(self.catalog)
        return Response(dumps(body), media_type="application/json")

    async def show(self, request: Request, req: ShowRequest) -> Response:
        model = self.router.resolve(req.model or req.name)
        body = await ollama_models.show(self.catalog, model)
        return Response(dumps(body), media_type="application/json")

    async def generate(self, request: Request, req: GenerateRequest) -> Response | Dispatch:
        rid = request_id(request)
        model, keep, params, caps = await self._common(req)
        if req.images:
            require(caps, VISION, req.model, "images")
        if req.raw and (req.template or req.system or req.context):
            raise invalid("raw mode does not support template, system, or context",
                          param="raw")
        if req.images and (req.raw or req.template):
            raise invalid("images need the model's chat template: raw and template are not "
                          "supported with images", param="images")
        images = self.requests.images()
        found = [await images.base64(text, f"images[{j}]", "images")
                 for j, text in enumerate(req.images or [])]
        if req.suffix:
            require(caps, INSERT, req.model, "suffix")
        thinking, variables = await self._thinking(model, req)
        if not req.prompt and not found:
            return self._load(model, req.model, keep, chat=False)
        if req.context:
            log.debug("ignoring %d context token ids", len(req.context),
                      extra={"request_id": rid})
        messages: list[ChatMessage] | None = None
        prompt: str | None = None
        record = model.created
        # NOTE: a created model's TEMPLATE is used where it renders here (single-prompt
        # templates); a chat template (.Messages, range) is left to the model's own.
        template = req.template or (record.template if record is not None and record.template
                                    and supported(record.template) else None)
        if req.raw:
            prompt = req.prompt
        elif template and not found:
            system = req.system or (record.system if record is not None else None) or ""
            prompt = render(template, system, req.prompt or "")
        else:
            messages = [ChatMessage(role="user", content=req.prompt or "", images=found)]
            if req.system:
                messages.insert(0, ChatMessage(role="system", content=req.system))
        msg = await self.requests.generate(request, model, params, requested=req.model,
                                       messages=messages, prompt=prompt,
                                       template_vars=variables)
        return self._turn(model, req, msg, keep,
                          OllamaReply(req.model, False, None, _logprobs(req), thinking))

    async def chat(self, request: Request, req: ChatRequest) -> Response | Dispatch:
        model, keep, params, caps = await self._common(req)
        thinking, variables = await self._thinking(model, req)
        if not req.messages:
            return self._load(model, req.model, keep, chat=True)
        msg, parser = await self.requests.chat(request, model,
                                           await chat_messages(req.messages, caps, req.model,
                                                               self.requests.images()),
                                           tool_request(req), params, requested=req.model,
                                           template_vars=variables)
        return self._turn(model, req, msg, keep,
                          OllamaReply(req.model, True, parser, _logprobs(req), thinking))

    # --- shared by generate and chat -----------------------------------------------------

    async def _common(self, req: GenerateRequest | ChatRequest,
                      ) -> tuple[ServedModel, float, SamplingParams, Capabilities]:
        """What /api/generate and /api/chat check and map alike: model, keep_alive, options,
        think; and the model's capabilities for the rest."""
        model = self.router.resolve(req.model, kind="llm")
        keep = parse_keep_alive(req.keep_alive)
        params = ollama_params(req.options, format_schema(req.format))
        params.logprobs = _logprobs(req) is not None
        caps = await self.catalog.capabilities(model)
        return model, keep, params, caps

    async def _thinking(self, model: ServedModel, req: GenerateRequest | ChatRequest,
                        ) -> tuple[Thinking | None, dict[str, Any] | None]:
        """`think`: true, false or an effort (low, medium, high: gpt-oss's reasoning_effort);
        absent, the model's default (a thinking model thinks). Asked of a model that does not
        think, a 400; false also switches it off in a template that can (enable_thinking)."""
        think = req.think
        if isinstance(think, str) and think not in ("", *EFFORTS):
            raise invalid(f"think must be true, false or one of {', '.join(EFFORTS)}, not "
                          f"{think!r}", param="think")
        want = None if think in (None, "") else think is not False
        thinking = await self.requests.thinking(model, want, req.model, "think")
        if thinking is None:
            return None, None
        effort = think if isinstance(think, str) and think else None
        return thinking, template_vars(want, effort)

    def _load(self, model: ServedModel, name: str, keep: float, chat: bool) -> Response:
        """An empty prompt loads the model, and with keep_alive 0 unloads it; workers load
        their model at start and keep it, so both are answered at once."""
        self.router.switcher.touch(model.name, keep)
        body = chunk(name, "", chat)
        body["done"] = True
        body["done_reason"] = "unload" if keep == 0 else "load"
        return Response(dumps(body), media_type="application/json")

    def _turn(self, model: ServedModel, req: GenerateRequest | ChatRequest, msg: Generate,
              keep: float, reply: OllamaReply) -> Dispatch:
        """keep_alive counts from the request's start, and again from its end."""
        touch = functools.partial(self.router.switcher.touch, model.name, keep)
        touch()
        return Dispatch(model, msg, req.stream is not False, reply, ended=touch)
