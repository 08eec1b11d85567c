"""The one request path of every API: decode, translate, dispatch, then stream or collect.

A dialect's handler (a method of its `DialectRoutes`) only translates. It takes the decoded body
and returns either a finished Response (answered without a generation: a load request, a token
count, embeddings) or a `Dispatch`: the model and Generate request to dispatch, whether to stream,
and a `Reply` that renders the worker's output as the API's stream events or as one body. A
chat's Generate request is made the one way (`RequestPath.chat`: tools prepared by
gateway/content/tools/, the request's id and deadline), and every Generate or Tokenize request
is first held to the limits (gateway/api/limits.py: messages, tools, prompt length), after
what a model made by /api/create adds to it (its system prompt, messages and parameters:
gateway/content/created_model.py). The rest is here, once:

- the body is decoded into the handler's request type (a 400 if it is not one);
- the dispatch runs under disconnect-watch: a client that goes away aborts the worker;
- a stream is framed, kept alive while silent (`stream_keepalive_seconds`), ended and typed
  the dialect's way (gateway/http/wire.py); otherwise
  the output is collected, under the same watch, and rendered as one JSON body;
- a GatewayError before the first byte is the API's error response (status, Retry-After);
  after it, the API's error event is the stream's last;
- what the request sent and the server left out (`Dispatch.ignored`) is named in the
  `X-NPU-Proxy-Ignored` header and one INFO log line (gateway/content/ignored.py).
The dialect is the one `dialect_for(scope)` picks for the request.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from npu_proxy.gateway.api.limits import Limits
from npu_proxy.gateway.content.created_model import with_messages, with_params
from npu_proxy.gateway.content.ignored import Ignored
from npu_proxy.gateway.content.images import ImageLimits, Images
from npu_proxy.gateway.content.params import OLLAMA_DEFAULTS
from npu_proxy.gateway.content.reasoning import Thinking
from npu_proxy.gateway.content.schema_check import check_regex, check_schema
from npu_proxy.gateway.content.tools import CallParser, ToolRequest, prepare_chat
from npu_proxy.gateway.core.catalog import ModelCatalog, ModelFacts, require
from npu_proxy.gateway.core.errors import GatewayError
from npu_proxy.gateway.core.generation import Generation
from npu_proxy.gateway.core.model_table import ServedModel
from npu_proxy.gateway.core.router import Router
from npu_proxy.gateway.http.util import (
    decode_body,
    dumps,
    request_id,
    request_key,
    unless_disconnected,
)
from npu_proxy.gateway.http.wire import OLLAMA, Dialect, StreamResponse, dialect_for
from npu_proxy.models.capabilities import THINKING, TOOLS
from npu_proxy.models.registry import sampling_defaults
from npu_proxy.protocol.messages import ChatMessage, Generate, SamplingParams, Tokenize

log = logging.getLogger(__name__)

B = TypeVar("B", bound=msgspec.Struct)


class Reply(Protocol):
    """How one API renders a generation: as stream events, or as one body."""

    def events(self, gen: Generation) -> AsyncIterator[dict[str, Any]]: ...

    def body(self, gen: Generation, parts: list[str]) -> dict[str, Any]:
        """The whole answer from the text pieces in the order the worker sent them."""
        ...


@dataclass
class Dispatch:
    """A request translated: what to dispatch, and how to answer with the output."""

    model: ServedModel
    msg: Generate
    stream: bool
    reply: Reply
    # Called once the generation ended, however it ended (Ollama's keep_alive counts from it).
    ended: Callable[[], None] | None = None
    # What the request sent that the server left out (gateway/content/ignored.py): a header.
    ignored: Ignored | None = None
    # A silent stream's keep-alive as an event of the API's own, for clients whose idle timer
    # only an event resets (Codex: not an SSE comment); else the dialect's (http/wire.py).
    keepalive: Callable[[], dict[str, Any]] | None = None

    def headers(self, gen: Generation) -> dict[str, str]:
        return gen.headers() | (self.ignored.headers() if self.ignored is not None else {})

    def end(self) -> None:
        if self.ended is not None:
            self.ended()


Translate = Callable[[Request, B], Awaitable[Response | Dispatch]]
Handler = Callable[[Request], Awaitable[Response]]


class RequestPath:
    def __init__(self, router: Router, catalog: ModelCatalog) -> None:
        self.router = router
        self.catalog = catalog
        self.limits = Limits(router.config)
        self.image_limits = ImageLimits.from_config(router.config)

    def images(self) -> Images:
        """A request's images: counted, decoded and checked (gateway/content/images.py)."""
        return Images(self.image_limits)

    def post(self, path: str, body: type[B], translate: Translate[B]) -> Route:
        """A route whose body is decoded into `body` and handed to `translate`."""

        async def endpoint(request: Request) -> Response:
            return await self.serve(request, body, translate)

        return Route(path, endpoint, methods=["POST"], name=translate.__name__)

    def get(self, path: str, handler: Handler) -> Route:
        """A route without a body whose errors are answered in its API's shape."""
        return self._bodiless("GET", path, handler)

    def delete(self, path: str, handler: Handler) -> Route:
        """Like `get`, for DELETE (the Responses API's stored responses)."""
        return self._bodiless("DELETE", path, handler)

    def _bodiless(self, method: str, path: str, handler: Handler) -> Route:
        async def endpoint(request: Request) -> Response:
            try:
                return await handler(request)
            except GatewayError as exc:
                return dialect_for(request.scope).error_response(exc)

        return Route(path, endpoint, methods=[method], name=handler.__name__)

    async def generate(self, request: Request, model: ServedModel, params: SamplingParams, *,
                       requested: str, messages: list[ChatMessage] | None = None,
                       prompt: str | None = None,
                       template_vars: dict[str, Any] | None = None) -> Generate:
        """A Generate request without tools (a prompt, or messages made from one), within the
        limits; `requested` is the model name the client sent."""
        messages = with_messages(messages, model) if messages is not None else None
        params = self.sampling(request, model, params)
        self.limits.check_input(messages, prompt, None)
        return self._generate(request, model, params, messages=messages, prompt=prompt,
                              template_vars=template_vars)

    def sampling(self, request: Request, model: ServedModel,
                 params: SamplingParams) -> SamplingParams:
        """The request's sampling parameters with every field it left unset filled, in this
        one order: the request > the created model's parameters (/api/create) > the model's
        own defaults (models/registry.py: an embedded model's, as Ollama's library sets
        them) > the API's defaults (Ollama's) > the worker's (workers/generation/sampling.py:
        at most DEFAULT_MAX_TOKENS; else GenAI's, the model's generation config)."""
        own = sampling_defaults(model.runs, self.router.config.model_aliases)
        return with_params(params, model, msgspec.convert(own, SamplingParams) if own else None,
                           _api_defaults(request))

    async def facts(self, model: ServedModel) -> ModelFacts:
        """The request's model facts, looked up once (gateway/core/catalog.py): the dialect
        hands them to `thinking`, `chat` and `tokenize`, which look nothing up again."""
        return await self.catalog.facts(model)

    async def chat(self, request: Request, facts: ModelFacts, messages: list[ChatMessage],
                   tools: ToolRequest | None, params: SamplingParams, *, requested: str,
                   template_vars: dict[str, Any] | None = None,
                   ) -> tuple[Generate, CallParser | None]:
        """A chat's Generate request, within the limits, and the parser that finds tool calls
        in its output."""
        model = facts.model
        messages, params = with_messages(messages, model), self.sampling(request, model, params)
        self.limits.check_input(messages, None, tools)
        if tools is not None and tools.tools:
            require(facts.capabilities, TOOLS, requested, "tools")
        prep = prepare_chat(facts, messages, tools, params)
        msg = self._generate(request, model, prep.params, messages=prep.messages, tools=prep.tools,
                             template_vars=template_vars)
        return msg, prep.parser()

    def thinking(self, facts: ModelFacts, want: bool | None, requested: str,
                 param: str | None) -> Thinking | None:
        """What the request does with the model's reasoning (gateway/content/reasoning.py): None
        for a model that does not think. `want` is the client's choice (None: the model's
        default, which shows it); asked for on a model that does not think, it is the
        capability's 400, unless `param` is None (an API whose clients ask for it anyway)."""
        caps = facts.capabilities
        if want and param is not None:
            require(caps, THINKING, requested, param)
        if caps.reasoning is None:
            return None
        return Thinking(caps.reasoning, show=want is not False)

    async def tokenize(self, request: Request, facts: ModelFacts,
                       messages: list[ChatMessage] | None, tools: ToolRequest | None, *,
                       prompt: str | None = None, want_tokens: bool = False,
                       add_special_tokens: bool = False,
                       add_generation_prompt: bool = True,
                       template_vars: dict[str, Any] | None = None) -> Tokenize:
        """A token count of a chat (or of a raw prompt), within the same limits, prepared
        exactly like `chat` so the count equals the generation's prompt tokens."""
        model = facts.model
        if messages is not None:
            messages = with_messages(messages, model)
        self.limits.check_input(messages, prompt, tools)
        if messages is not None:
            prep = prepare_chat(facts, messages, tools, SamplingParams())
            messages, tool_list = prep.messages, prep.tools
        else:
            tool_list = None
        return Tokenize(id=request_key(request), model=model.name, messages=messages,
                        prompt=prompt, tools=tool_list, log_id=request_id(request),
                        want_tokens=want_tokens, add_special_tokens=add_special_tokens,
                        add_generation_prompt=add_generation_prompt,
                        template_vars=template_vars)

    def _generate(self, request: Request, model: ServedModel, params: SamplingParams, *,
                  messages: list[ChatMessage] | None = None, prompt: str | None = None,
                  tools: list[dict[str, Any]] | None = None,
                  template_vars: dict[str, Any] | None = None) -> Generate:
        """The Generate request, with the request's id and deadline."""
        cfg = self.router.config
        limits = (cfg.max_schema_nodes, cfg.max_schema_depth, cfg.max_schema_chars)
        if params.json_schema is not None:
            check_schema(params.json_schema, *limits)
        if params.regex is not None:
            check_regex(params.regex)
        if params.tool_tags is not None:
            try:
                check_schema(params.tool_tags.schema, *limits)
            except GatewayError as exc:
                # NOTE: the client asked for no constraint (tool_choice auto): tools whose
                # schemas a worker could not compile, or too large to, leave calls
                # unconstrained (parsed as before) rather than refuse the request.
                log.info("request_id=%s tool calls left unconstrained: %s",
                         request_id(request), exc.message)
                params = msgspec.structs.replace(params, tool_tags=None)
        return Generate(id=request_key(request), model=model.name, params=params,
                        deadline=self.router.deadline(), messages=messages, prompt=prompt,
                        tools=tools, log_id=request_id(request), template_vars=template_vars)

    async def serve(self, request: Request, body: type[B], translate: Translate[B]) -> Response:
        dialect = dialect_for(request.scope)
        try:
            turn = await translate(request, await decode_body(
                request, body, max_objects=self.router.config.max_json_objects))
            if isinstance(turn, Response):
                return turn
            gen = await unless_disconnected(request, self.router.generate(turn.model, turn.msg))
        except GatewayError as exc:
            return dialect.error_response(exc)
        if turn.ignored is not None:
            turn.ignored.report(request.url.path, request_id(request))
        if turn.stream:
            every = self.router.config.stream_keepalive_seconds if dialect.keepalive else 0.0
            own = turn.keepalive
            keepalive = dialect.keepalive if own is None else lambda: dialect.frame(own())
            return StreamResponse(_stream(dialect, turn, gen), dialect.media_type,
                                  turn.headers(gen), keepalive, every)
        return await _whole(request, dialect, turn, gen)


def _api_defaults(request: Request) -> SamplingParams | None:
    """The sampling defaults of the request's API where GenAI's are not its own."""
    return OLLAMA_DEFAULTS if dialect_for(request.scope) is OLLAMA else None


class DialectRoutes:
    """What each API's routes stand on: the shared request path and the router below it."""

    def __init__(self, requests: RequestPath) -> None:
        self.requests = requests
        self.router = requests.router
        self.catalog = requests.catalog


async def _stream(dialect: Dialect, turn: Dispatch, gen: Generation) -> AsyncIterator[bytes]:
    # NOTE: events whose frames were already there when they were made go out in one body
    # chunk with those after them (several SSE events or NDJSON lines in one write, as
    # clients parse any chunking): a stream that fell behind its worker catches up in one
    # write and one pass through the ASGI send chain, where each write cost ~0.1 ms of the
    # gateway's CPU (bench/gateway_cpu.py). A lone event is never held back: the chunk goes
    # out as soon as the next event would have to wait. A silent stream's keep-alive is the
    # response's (http/wire.py StreamResponse).
    held: list[bytes] = []
    try:
        async for event in turn.reply.events(gen):
            held.append(dialect.frame(event))
            if not gen.ready():
                yield b"".join(held) if len(held) > 1 else held[0]
                held.clear()
    except GatewayError as exc:
        held.append(dialect.error_event(exc))
        yield b"".join(held)
        return
    finally:
        turn.end()
    if dialect.end:
        held.append(dialect.end)
    if held:
        yield b"".join(held)


async def _whole(request: Request, dialect: Dialect, turn: Dispatch, gen: Generation) -> Response:
    headers = turn.headers(gen)
    try:
        parts = await unless_disconnected(request, _collect(gen))
    except GatewayError as exc:
        return dialect.error_response(exc, headers)
    finally:
        turn.end()
    return Response(dumps(turn.reply.body(gen, parts)), media_type="application/json",
                    headers=headers)


async def _collect(gen: Generation) -> list[str]:
    return [delta.text async for delta in gen]
