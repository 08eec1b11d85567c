"""The one request path of every API: decode, translate, dispatch, then stream or collect.

A dialect's handler (a method of its `DialectRoutes`) only translates. It takes the decoded body
(JSON, or a multipart form for audio) and returns either a finished Response or a `Dispatch`
(gateway/api/dispatch.py): the model and Generate request to dispatch, whether to stream, and
a `Reply` that renders the worker's output as the API's stream events or as one body. A
chat's Generate request is made the one way (`RequestPath.chat`: tools prepared by
gateway/content/tools/, the request's id and deadline), and every Generate or Tokenize request
is first held to the limits (gateway/api/limits.py: messages, tools, prompt length), after
what a model made by /api/create adds to it (its system prompt, messages and parameters:
gateway/content/created_model.py). Requests that are not generations (embeddings, rerank,
token counts, speech in and out) are dispatched by the path's methods of their name, and a
speech request's frames answered by `events`, `chunks` or `read`. The rest is here, once:

- the body is decoded into the handler's request type (a 400 if it is not one);
- every dispatch runs under disconnect-watch: a client that goes away aborts the worker;
- a stream is framed, kept alive while silent (`stream_keepalive_seconds`), ended and typed
  the dialect's way (gateway/http/wire.py); otherwise
  the output is collected, under the same watch, and rendered as one body;
- a GatewayError before the first byte is the API's error response (status, Retry-After);
  after it, the API's error event is the stream's last;
- the worker's stream is released however the response ended;
- what the request sent and the server left out (`Dispatch.ignored`) is named in the
  `X-NPU-Proxy-Ignored` header and one INFO log line (gateway/content/ignored.py).
The dialect is the one `dialect_for(scope)` picks for the request. The dialects reach the
router only through this path (tests/test_layers.py).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import msgspec
from starlette.datastructures import FormData
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from npu_proxy.gateway.api.dispatch import (
    Dispatch,
    frames_bytes,
    frames_events,
    frames_whole,
    streamed,
    whole,
)
from npu_proxy.gateway.api.limits import Limits
from npu_proxy.gateway.content.created_model import with_messages, with_params
from npu_proxy.gateway.content.images import ImageLimits, Images
from npu_proxy.gateway.content.params import OLLAMA_DEFAULTS
from npu_proxy.gateway.content.reasoning import Thinking
from npu_proxy.gateway.content.schema_check import check_regex, check_schema
from npu_proxy.gateway.content.tools import CallParser, ToolRequest, prepare_chat
from npu_proxy.gateway.core.catalog import ModelCatalog, ModelFacts, display_name, require
from npu_proxy.gateway.core.errors import GatewayError, invalid
from npu_proxy.gateway.core.generation import Embedded, Frames, Generation, Scored
from npu_proxy.gateway.core.keep_alive import parse_keep_alive
from npu_proxy.gateway.core.model_table import ServedModel
from npu_proxy.gateway.core.router import Router
from npu_proxy.gateway.http.util import decode_body, request_id, request_key, unless_disconnected
from npu_proxy.gateway.http.wire import OLLAMA, dialect_for
from npu_proxy.models.capabilities import THINKING, TOOLS
from npu_proxy.protocol.config import Config
from npu_proxy.protocol.ids import new_id, now
from npu_proxy.protocol.messages import (
    ChatMessage,
    Delta,
    Detokenize,
    Detokenized,
    Embed,
    Generate,
    Rerank,
    SamplingParams,
    TokenCount,
    Tokenize,
)
from npu_proxy.protocol.speech import Speech, SpeechChunk, Synthesize, Transcribe, Transcription

# NOTE: what a dialect names of the server's core (its errors, ids, answers, models and their
# facts) it takes from here, with the path itself: the path is a dialect's one door to
# gateway/core/ (tests/test_layers.py).
__all__ = ["DialectRoutes", "Embedded", "Frames", "GatewayError", "Generation", "ModelCatalog",
           "ModelFacts", "RequestPath", "ServedModel", "display_name", "invalid", "new_id",
           "now", "parse_keep_alive", "require"]

log = logging.getLogger(__name__)

B = TypeVar("B", bound=msgspec.Struct)
T = TypeVar("T")


Translate = Callable[[Request, B], Awaitable[Response | Dispatch]]
Handler = Callable[[Request], Awaitable[Response]]
FormHandler = Callable[[Request, FormData], Awaitable[Response]]


class RequestPath:
    def __init__(self, router: Router, catalog: ModelCatalog) -> None:
        self.router = router
        self.catalog = catalog
        self.config: Config = router.config
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

    def form(self, path: str, handler: FormHandler, name: str) -> Route:
        """A route whose body is a multipart form (audio uploads), read and closed here."""

        async def endpoint(request: Request) -> Response:
            try:
                form = await _read_form(request)
                try:
                    return await handler(request, form)
                finally:
                    await form.close()
            except GatewayError as exc:
                return dialect_for(request.scope).error_response(exc)

        return Route(path, endpoint, methods=["POST"], name=name)

    # --- the server's side of a request: every dialect reaches it here ------------------------

    def resolve(self, requested: str, kind: str | None = None) -> ServedModel:
        """The served model a request names (a 404 in the API's shape if none)."""
        return self.router.resolve(requested, kind)

    def default_llm(self) -> str:
        return self.router.default_llm()

    def deadline(self) -> float:
        """A new request's deadline (inference_timeout from now)."""
        return self.router.deadline()

    def keep(self, model: ServedModel, seconds: float) -> None:
        """Ollama's `keep_alive` (gateway/core/keep_alive.py): how long the model stays
        loaded, from now."""
        self.router.switcher.touch(model.name, seconds)

    async def embed(self, request: Request, model: ServedModel, msg: Embed) -> Embedded:
        return await unless_disconnected(request, self.router.embed(model, msg))

    async def rerank(self, request: Request, model: ServedModel, msg: Rerank) -> Scored:
        return await unless_disconnected(request, self.router.rerank(model, msg))

    async def count(self, request: Request, model: ServedModel, msg: Tokenize) -> TokenCount:
        return await unless_disconnected(request, self.router.tokenize(model, msg))

    async def detokenize(self, request: Request, model: ServedModel,
                         msg: Detokenize) -> Detokenized:
        return await unless_disconnected(request, self.router.detokenize(model, msg))

    async def transcribe(self, request: Request, model: ServedModel,
                         msg: Transcribe) -> Frames[Delta, Transcription]:
        """Speech dispatched; its frames are answered with `events`, `chunks` or `read`."""
        return await unless_disconnected(request, self.router.transcribe(model, msg))

    async def speak(self, request: Request, model: ServedModel,
                    msg: Synthesize) -> Frames[SpeechChunk, Speech]:
        return await unless_disconnected(request, self.router.speak(model, msg))

    def events(self, request: Request, frames: Frames[Any, Any],
               events: AsyncIterator[dict[str, Any]], headers: dict[str, str]) -> Response:
        """The frames as the dialect's stream of `events`; released at its end."""
        dialect = dialect_for(request.scope)
        return StreamingResponse(frames_events(dialect, frames, events),
                                 media_type=dialect.media_type, headers=headers)

    def chunks(self, request: Request, frames: Frames[Any, Any], chunks: AsyncIterator[bytes],
               media_type: str, headers: dict[str, str]) -> Response:
        """The frames as a body of raw `chunks` (streamed audio); released at its end."""
        return StreamingResponse(frames_bytes(request, frames, chunks), media_type=media_type,
                                 headers=headers)

    async def read(self, request: Request, frames: Frames[Any, Any], work: Awaitable[T]) -> T:
        """`work`, which reads the frames, under disconnect-watch; the frames released."""
        return await frames_whole(request, frames, work)

    async def generate(self, request: Request, model: ServedModel, params: SamplingParams, *,
                       requested: str, messages: list[ChatMessage] | None = None,
                       prompt: str | None = None, prompt_ids: list[int] | None = None,
                       template_vars: dict[str, Any] | None = None) -> Generate:
        """A Generate request without tools (a prompt, its token ids, or messages made from
        one), within the limits; `requested` is the model name the client sent."""
        messages = with_messages(messages, model) if messages is not None else None
        params = await self.sampling(request, model, params)
        self.limits.check_input(messages, prompt, None)
        msg = self._generate(request, model, params, messages=messages, prompt=prompt,
                             template_vars=template_vars)
        msg.prompt_ids = prompt_ids
        return msg

    async def sampling(self, request: Request, model: ServedModel,
                       params: SamplingParams) -> SamplingParams:
        """The request's sampling parameters with every field it left unset filled, in this
        one order: the request > the created model's parameters (/api/create) > the model's
        own defaults (models/registry.py: an embedded model's, as Ollama's library sets
        them) > the API's defaults: Ollama's on its API; on the others the model's files'
        (models/sampling.py: generation_config.json, llama.cpp's for a GGUF) > the worker's
        (workers/generation/sampling.py: at most DEFAULT_MAX_TOKENS, temperature 1)."""
        own = self.catalog.own_sampling(model)
        api = _api_defaults(request)
        if api is None and (files := await self.catalog.file_sampling(model)):
            api = msgspec.convert(files, SamplingParams)
        return with_params(params, model, msgspec.convert(own, SamplingParams) if own else None,
                           api)

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
        messages = with_messages(messages, model)
        params = await self.sampling(request, model, params)
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
        limits = (cfg.max_schema_nodes, cfg.max_schema_depth, cfg.max_schema_chars,
                  cfg.max_schema_enum_values)
        if params.json_schema is not None:
            check_schema(params.json_schema, *limits)
        if params.regex is not None:
            check_regex(params.regex)
        if params.tool_tags is not None:
            try:
                for tag in params.tool_tags.tags:
                    check_schema(tag.schema, *limits)
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
                request, body, max_objects=self.config.max_json_objects))
            if isinstance(turn, Response):
                return turn
            gen = await unless_disconnected(request, self.router.generate(turn.model, turn.msg))
        except GatewayError as exc:
            return dialect.error_response(exc)
        if turn.ignored is not None:
            turn.ignored.report(request.url.path, request_id(request))
        if turn.stream:
            return streamed(dialect, turn, gen, self.config.stream_keepalive_seconds)
        return await whole(request, dialect, turn, gen)


async def _read_form(request: Request) -> FormData:
    media = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media != "multipart/form-data":
        raise GatewayError(415, "unsupported_media_type",
                           f"Content-Type {media or '(none)'} is not accepted here: send "
                           "multipart/form-data with the audio as 'file'")
    try:
        return await request.form(max_files=1, max_fields=64)
    except Exception as exc:  # NOTE: Starlette raises its own and python-multipart's
        raise invalid(f"the multipart body cannot be read: {exc}") from None


def _api_defaults(request: Request) -> SamplingParams | None:
    """The sampling defaults of the request's API where GenAI's are not its own."""
    return OLLAMA_DEFAULTS if dialect_for(request.scope) is OLLAMA else None


class DialectRoutes:
    """What each API's routes stand on: the shared request path, the only way they reach a
    worker (tests/test_layers.py holds them to it), and the model catalog they describe."""

    def __init__(self, requests: RequestPath) -> None:
        self.requests = requests
        self.config = requests.config
        self.catalog = requests.catalog
