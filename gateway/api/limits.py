"""The limits every request is held to, answered before anything reaches a worker.

All are settings of protocol/config.py, and each refusal is in the caller's API's own error
shape and status (`dialect_for(scope)`, gateway/api/dialects.py):

- the body's size (`max_body_bytes`): `BodyLimitMiddleware`, outside every route, answers a
  larger body with 413, found by its Content-Length up front or, for a body sent without one
  (chunked), by counting its chunks; it never keeps more than the limit. Blob uploads
  (gateway/api/model_create.py) stream to disk instead, under `max_blob_bytes`;
- what one generation asks for: messages (`max_messages`), tools (`max_tools`), characters of
  prompt text (`max_prompt_chars`), and output tokens beyond the model's context: `Limits`,
  asked by the one request path (gateway/api/flow.py) for every chat, generate and token
  count, so no dialect checks them itself. Each is a 400 naming the limit and its setting.

Embeddings keep their own two (`max_embed_items`, `max_embed_chars`) in
gateway/api/embeddings.py, since their inputs are not a conversation.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.api.dialects import dialect_for
from gateway.core.errors import GatewayError, invalid
from gateway.core.router import CLAUDE_PREFIX
from protocol.config import Config
from protocol.messages import ChatMessage, SamplingParams

if TYPE_CHECKING:
    from gateway.api.ollama_models import ModelCatalog
    from gateway.api.tools import ToolRequest
    from gateway.core.model_table import ServedModel

# What each API calls the output limit (OpenAI's max_completion_tokens lands on max_tokens).
OUTPUT_PARAM = {"openai": "max_tokens", "responses": "max_output_tokens",
                "anthropic": "max_tokens", "ollama": "num_predict"}


# --- the body ----------------------------------------------------------------------------


def _content_length(scope: Scope) -> int | None:
    for key, value in scope.get("headers", ()):
        if key == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _drain(receive: Receive) -> bool:
    """Read the rest of a refused body, keeping none of it; False if the client went away."""
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return False
        if not message.get("more_body", False):
            return True


class BodyLimitMiddleware:
    """Refuses a request body over `max_bytes` with 413; passes the others on unchanged.

    A body within the limit is read here and handed to the app as the same messages (the
    app reads the whole body anyway); the client's later messages (its disconnect) follow.

    NOTE: a refused body is still read to its end (and dropped) before the 413 is sent.
    Hypercorn keeps queueing a body's chunks for the app, and nothing takes them once the app
    has answered. Tried with 50 MB uploads: answered without reading, a chunked upload ended
    in a client write timeout (the client, still writing, never read the 413) 16 times in
    20; answered part-way, every 413 arrived but Hypercorn's reader of about one connection
    in four stayed blocked for the server's life. Read to the end, every 413 arrives, nothing
    is left behind and the connection stays usable. A client that sends without end is read
    without end, keeping nothing, as it could hold a connection open anyway.
    """

    def __init__(self, app: ASGIApp, max_bytes: int, exempt: tuple[str, ...] = ()) -> None:
        self.app = app
        self.max_bytes = max_bytes
        # Path prefixes whose routes stream their body and hold it to a limit of their own.
        self.exempt = exempt

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or str(scope.get("path", "")).startswith(self.exempt):
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            if await _drain(receive):
                await self._refuse(scope, receive, send, f"is {declared} bytes")
            return
        messages: deque[Message] = deque()
        size = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break  # a disconnect: the app sees it where it would have
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                messages.clear()
                if await _drain(receive):
                    await self._refuse(scope, receive, send, f"is over {self.max_bytes} bytes")
                return
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            if messages:
                return messages.popleft()
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, size: str) -> None:
        mib = self.max_bytes / (1024 * 1024)
        exc = GatewayError(413, "request_too_large",
                           f"the request body {size}; the limit is {self.max_bytes} bytes "
                           f"({mib:g} MiB, max_body_bytes)")
        await dialect_for(scope).error_response(exc)(scope, receive, send)


# --- a generation ------------------------------------------------------------------------


def prompt_chars(messages: list[ChatMessage] | None, prompt: str | None) -> int:
    """Characters of text the tokenizer would get from the client: every message's content
    (the system prompt is one) and the raw prompt; tool definitions and the arguments of
    earlier calls are bounded by `max_tools` and `max_body_bytes` instead."""
    return sum(len(m.content) for m in messages or ()) + len(prompt or "")


class Limits:
    """The checks of one generation or token count, before it is prepared and dispatched."""

    def __init__(self, config: Config, catalog: ModelCatalog) -> None:
        self.config = config
        self.catalog = catalog

    def check_items(self, items: int, tools: int) -> None:
        """The Responses API's input items and tools, counted as sent, before they are
        translated (several items may make one message, some none): the same two limits."""
        if items > self.config.max_messages:
            raise invalid(f"the request has {items} input items; the limit is "
                          f"{self.config.max_messages} (max_messages)", param="input")
        if tools > self.config.max_tools:
            raise invalid(f"the request offers {tools} tools; the limit is "
                          f"{self.config.max_tools} (max_tools)", param="tools")

    def check_input(self, messages: list[ChatMessage] | None, prompt: str | None,
                    tools: ToolRequest | None) -> None:
        """Counts and prompt length: a 400 naming the limit and its setting."""
        limit = self.config.max_messages
        if messages is not None and len(messages) > limit:
            raise invalid(f"the request has {len(messages)} messages; the limit is {limit} "
                          "(max_messages)", param="messages")
        limit = self.config.max_tools
        if tools is not None and len(tools.tools) > limit:
            raise invalid(f"the request offers {len(tools.tools)} tools; the limit is {limit} "
                          "(max_tools)", param="tools")
        limit = self.config.max_prompt_chars
        chars = prompt_chars(messages, prompt)
        if chars > limit:
            # NOTE: "prompt is too long" is how Anthropic words it (Claude Code offers to
            # compact on it), and OpenAI clients trim history on context_length_exceeded.
            raise GatewayError(400, "context_length_exceeded",
                               f"prompt is too long: {chars} characters; the limit is {limit} "
                               "characters (max_prompt_chars)",
                               param="prompt" if prompt is not None else "messages")

    async def check_output(self, request: Request, model: ServedModel, params: SamplingParams,
                           requested: str) -> None:
        """More output tokens than the model's whole context can never be produced: a 400,
        when the context length is known (see ModelCatalog.context_length).

        NOTE: not for `claude-*` names. Claude Code sizes max_tokens for the Claude model it
        names (32,000 or 64,000), not for the local model that name stands for, and cannot be
        told otherwise; as before, the worker stops at the end of the context instead.
        """
        wanted = params.max_tokens
        if wanted is None or requested.strip().lower().startswith(CLAUDE_PREFIX):
            return
        context = await self.catalog.context_length(model)
        if context and wanted > context:
            name = OUTPUT_PARAM.get(dialect_for(request.scope).name, "max_tokens")
            raise invalid(f"{name} is {wanted}, more than the context of model '{model.name}' "
                          f"({context} tokens, prompt included); ask for at most {context}",
                          param=name)
