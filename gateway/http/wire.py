"""Which API a request speaks, decided in one place, and what is alike for all its routes.

`dialect_for(scope)`: `/v1/messages*` is Anthropic's, `/v1/responses*` OpenAI's Responses API
(OpenAI's error body, but named SSE events), every other `/v1/*` OpenAI's, as are vLLM's
`/tokenize` and `/detokenize`, and the rest (`/api/*`, `/`) Ollama's. `/v1/models*` belongs to
both OpenAI and Anthropic; Anthropic's SDKs send `anthropic-version` on every request and
OpenAI's never do, so that header decides.
The auth middleware, /v1/models and the shared request path (gateway/api/request_path.py)
all ask it.

A `Dialect` holds what every route of its API shares: the error body (`{"error": {...}}`,
`{"type": "error", ...}` or `{"error": "..."}`) and status, Retry-After, and how a stream is
framed (SSE `data:` lines, SSE named events, NDJSON), kept alive while it is silent
(`StreamResponse`: an SSE comment, Anthropic's `ping` event, nothing for NDJSON) and ended.
The translation of requests and responses is each API's own module: openai.py, responses.py,
anthropic.py, ollama.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Scope, Send

from npu_proxy.gateway.core.errors import ContextOverflow, GatewayError
from npu_proxy.gateway.http.util import dumps

SSE = "text/event-stream"
NDJSON = "application/x-ndjson"


@dataclass(frozen=True)
class Dialect:
    name: str  # "openai", "responses", "anthropic" or "ollama"
    media_type: str  # of a streamed response
    frame: Callable[[dict[str, Any]], bytes]  # one event of a stream
    end: bytes  # what closes a stream that completed
    error_body: Callable[[GatewayError], dict[str, Any]]
    status: Callable[[GatewayError], int]
    # What a silent stream sends to stay open (b"": nothing), which the API's clients skip.
    keepalive: bytes = b""

    def error_response(self, exc: GatewayError,
                       headers: dict[str, str] | None = None) -> Response:
        """A failure before the first byte: the API's error body with its status."""
        headers = dict(headers or {})
        if exc.retry_after is not None:
            headers["Retry-After"] = str(exc.retry_after)
        return JSONResponse(self.error_body(exc), status_code=self.status(exc), headers=headers)

    def error_event(self, exc: GatewayError) -> bytes:
        """A failure after the first byte: the status is sent, so the error is the last event."""
        return self.frame(self.error_body(exc))


# --- framing -----------------------------------------------------------------------------


def sse_data(obj: dict[str, Any]) -> bytes:
    return b"data: " + dumps(obj) + b"\n\n"


def sse_event(obj: dict[str, Any]) -> bytes:
    # NOTE: Anthropic names each event after its data's `type` (message_start, ..., error).
    return b"event: " + str(obj["type"]).encode() + b"\ndata: " + dumps(obj) + b"\n\n"


def sse_named(obj: dict[str, Any]) -> bytes:
    # NOTE: the Responses API names each event after its data's `type` too; an error body
    # (`{"error": {...}}`, no type) goes out as an `error` event, which the OpenAI SDK raises.
    kind = obj.get("type", "error")
    return b"event: " + str(kind).encode() + b"\ndata: " + dumps(obj) + b"\n\n"


def ndjson_line(obj: dict[str, Any]) -> bytes:
    return dumps(obj) + b"\n"


# NOTE: a line starting with ":" is a comment every SSE parser drops (WHATWG event-stream
# interpretation; openai-python's and openai-node's decoders, EventSource); llama.cpp's
# server and vLLM's `--sse-keep-alive-interval` send the same while a prompt is prefilled.
SSE_COMMENT = b": keep-alive\n\n"


class StreamResponse(StreamingResponse):
    """A streamed answer: its chunks as they come, and `keepalive` whenever `every` seconds
    pass with nothing sent (a long prefill; `every` 0: never).

    NOTE: the keep-alive is sent by a timer task of its own that sleeps while chunks flow, so
    a chunk costs nothing for it. Drawing the chunks through a task and a queue with a
    timeout around each wait (so a wait could time out without cancelling the stream) cost
    ~20 % of the gateway's CPU per streamed token (bench/gateway_cpu.py).
    """

    def __init__(self, chunks: AsyncIterator[bytes], media_type: str,
                 headers: dict[str, str], keepalive: bytes | Callable[[], bytes] = b"",
                 every: float = 0.0) -> None:
        super().__init__(chunks, media_type=media_type, headers=headers)
        # NOTE: a callable makes each keep-alive anew (a Responses event, numbered in turn).
        self.keepalive = keepalive if every > 0 else b""
        self.every = every
        self.sent_at = 0.0
        self.lock = asyncio.Lock()

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        loop = asyncio.get_running_loop()
        chunks = self.body_iterator
        ticker: asyncio.Task[None] | None = None
        if self.keepalive:
            self.sent_at = loop.time()
            ticker = asyncio.create_task(self._tick(send))
        try:
            async for chunk in chunks:
                message = {"type": "http.response.body", "body": chunk, "more_body": True}
                if not self.keepalive:
                    await send(message)
                    continue
                async with self.lock:
                    await send(message)
                self.sent_at = loop.time()
        finally:
            if ticker is not None:
                ticker.cancel()
            # NOTE: a client gone mid-stream: the generation's own cleanup (in the iterator's
            # close) sends the worker its abort.
            close = getattr(chunks, "aclose", None)
            if close is not None:
                await close()
        async with self.lock:
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _tick(self, send: Send) -> None:
        loop = asyncio.get_running_loop()
        keepalive = self.keepalive
        try:
            while True:
                wait = self.sent_at + self.every - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                elif self.lock.locked():
                    await asyncio.sleep(self.every)  # NOTE: a send in progress: a slow client
                else:
                    body = keepalive() if callable(keepalive) else keepalive
                    async with self.lock:
                        await send({"type": "http.response.body", "body": body,
                                    "more_body": True})
                    self.sent_at = loop.time()
        except Exception:
            return  # NOTE: the client went away; the stream's own next send says so


def http_status(exc: GatewayError) -> int:
    return exc.status


# --- OpenAI ------------------------------------------------------------------------------

_OPENAI_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                 403: "permission_error", 404: "invalid_request_error",
                 413: "invalid_request_error", 415: "invalid_request_error",
                 429: "rate_limit_error", 503: "server_error", 504: "timeout"}


def openai_error(exc: GatewayError) -> dict[str, Any]:
    code = exc.kind if exc.kind != "invalid_request" else None
    if exc.kind == "authentication":
        code = "invalid_api_key"
    message = exc.message
    if isinstance(exc, ContextOverflow):
        message = _openai_overflow(exc, exc.param or "messages")
    return {"error": {"message": message, "type": _OPENAI_TYPES.get(exc.status, "server_error"),
                      "param": exc.param, "code": code}}


def _openai_overflow(exc: ContextOverflow, field: str) -> str:
    """OpenAI's sentence, which clients (LiteLLM, LangChain's trimmers) recognise."""
    size = f"{exc.tokens}" if exc.tokens is not None else f"at least {exc.floor}"
    return (f"This model's maximum context length is {exc.context} tokens. However, your "
            f"{field} resulted in {size} tokens (at most {exc.limit} leave room for a reply). "
            f"Please reduce the length of the {field}.")


def responses_error(exc: GatewayError) -> dict[str, Any]:
    if isinstance(exc, ContextOverflow):
        exc.param = "input"  # NOTE: the Responses API's input items, whatever they became
    return openai_error(exc)


OPENAI = Dialect("openai", SSE, sse_data, b"data: [DONE]\n\n", openai_error, http_status,
                 SSE_COMMENT)
# NOTE: a Responses stream ends with its response.completed (or .incomplete, .failed) event,
# no [DONE] line.
RESPONSES = Dialect("responses", SSE, sse_named, b"", responses_error, http_status,
                    SSE_COMMENT)


# --- Anthropic ---------------------------------------------------------------------------

_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                    403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                    429: "rate_limit_error", 529: "overloaded_error"}


def anthropic_status(exc: GatewayError) -> int:
    # NOTE: "no worker can take it now" is Anthropic's overloaded (529); clients retry it.
    return 529 if exc.status == 503 else exc.status


def anthropic_error(exc: GatewayError) -> dict[str, Any]:
    kind = _ANTHROPIC_TYPES.get(anthropic_status(exc),
                                "api_error" if exc.status >= 500 else "invalid_request_error")
    message = exc.message
    if isinstance(exc, ContextOverflow):
        # NOTE: Anthropic's exact form; Claude Code reads both numbers from it to compact
        # (its pattern allows words before the first, so an uncounted prompt says "at least").
        size = f"{exc.tokens}" if exc.tokens is not None else f"at least {exc.floor}"
        message = f"prompt is too long: {size} tokens > {exc.limit} maximum"
    return {"type": "error", "error": {"type": kind, "message": message}}


# NOTE: Anthropic's streams carry `ping` events anywhere after message_start, which its SDKs
# skip; every stream here sends message_start before the worker's first token.
ANTHROPIC = Dialect("anthropic", SSE, sse_event, b"", anthropic_error, anthropic_status,
                    sse_event({"type": "ping"}))


# --- Ollama ------------------------------------------------------------------------------


def ollama_error(exc: GatewayError) -> dict[str, Any]:
    return {"error": exc.message}


# NOTE: no keep-alive: real Ollama sends nothing before the first token, and ollama-python
# (0.6) passes every line to json.loads, so a blank line would end its stream with an error.
OLLAMA = Dialect("ollama", NDJSON, ndjson_line, b"", ollama_error, http_status)


# --- the one decision --------------------------------------------------------------------


# vLLM's routes outside /v1/, answered in OpenAI's shape as vLLM does.
OPENAI_ROOT_PATHS = frozenset({"/tokenize", "/detokenize", "/tokenizer_info", "/rerank",
                               "/v2/rerank"})


def dialect_for(scope: Scope) -> Dialect:
    path: str = scope.get("path", "")
    if path.startswith("/v1/messages"):
        return ANTHROPIC
    if path.startswith("/v1/responses"):
        return RESPONSES
    if path in OPENAI_ROOT_PATHS:
        return OPENAI
    if path.startswith("/v1/"):
        if path.startswith("/v1/models") and any(
                key == b"anthropic-version" for key, _ in scope.get("headers", ())):
            return ANTHROPIC
        return OPENAI
    return OLLAMA


# The server's own routes, which speak no client API: the `other` of the metrics' api label.
SERVER_PATHS = ("/health", "/metrics", "/status", "/openapi.json")


def api_label(scope: Scope) -> str:
    """The `api` label of a request's metrics: the API `dialect_for` says it speaks, or
    "other" for the server's own routes (health, metrics, the status page)."""
    path: str = scope.get("path", "")
    if path.startswith(SERVER_PATHS):
        return "other"
    return dialect_for(scope).name
