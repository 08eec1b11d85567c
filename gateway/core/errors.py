"""Errors the gateway raises, independent of API; each API module renders them its own way."""

from __future__ import annotations

from npu_proxy.protocol.messages import ErrorCode, Failed


class GatewayError(Exception):
    """A request that cannot be served, with the HTTP status and a stable kind.

    kind is one of: invalid_request, model_not_found, context_length_exceeded, unavailable,
    worker_lost, timeout, authentication, internal, not_found, unsupported,
    request_too_large, forbidden, unsupported_media_type.
    """

    def __init__(
        self,
        status: int,
        kind: str,
        message: str,
        param: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.message = message
        self.param = param
        self.retry_after = retry_after


class ContextOverflow(GatewayError):
    """A prompt longer than the context lets a worker take (kind context_length_exceeded): the
    exact token count when it was counted (None: refused on its length in characters, at
    least `floor` tokens), the longest prompt taken and the context. Each API words it the way
    its clients act on it (gateway/http/wire.py): OpenAI's "maximum context length" sentence,
    Anthropic's "prompt is too long: N tokens > M maximum" (Claude Code compacts on it)."""

    def __init__(self, message: str, tokens: int | None, floor: int, limit: int, context: int,
                 param: str = "messages") -> None:
        super().__init__(400, "context_length_exceeded", message, param=param)
        self.tokens = tokens
        self.floor = floor
        self.limit = limit
        self.context = context


def overflow(frame: Failed, raw: bool, message: str | None = None) -> ContextOverflow:
    """A worker's PROMPT_TOO_LONG as the gateway's error; `raw` for a raw prompt's (param
    `prompt`), else the messages'."""
    limit = frame.limit or 0
    floor = frame.prompt_tokens or frame.floor or limit + 1
    return ContextOverflow(message or frame.message, frame.prompt_tokens, floor, limit,
                           frame.context or limit + 1, param="prompt" if raw else "messages")


def invalid(message: str, param: str | None = None) -> GatewayError:
    return GatewayError(400, "invalid_request", message, param=param)


def model_not_found(model: str) -> GatewayError:
    return GatewayError(404, "model_not_found", f"model '{model}' not found", param="model")


def unavailable(message: str, retry_after: int = 2) -> GatewayError:
    return GatewayError(503, "unavailable", message, retry_after=retry_after)


def from_failed(frame: Failed) -> GatewayError:
    """Map a worker's Failed frame to a gateway error."""
    code = frame.code
    if code == ErrorCode.PROMPT_TOO_LONG:
        return GatewayError(400, "context_length_exceeded", frame.message, param="messages")
    if code in (ErrorCode.BAD_REQUEST, ErrorCode.UNSUPPORTED):
        return GatewayError(400, "invalid_request", frame.message)
    if code in (ErrorCode.QUEUE_FULL, ErrorCode.NOT_READY, ErrorCode.MODEL_NOT_LOADED):
        return unavailable(frame.message)
    if code == ErrorCode.WORKER_LOST:
        return GatewayError(503, "worker_lost", frame.message, retry_after=2)
    if code == ErrorCode.DEADLINE_EXCEEDED:
        return GatewayError(504, "timeout", frame.message)
    if code == ErrorCode.ABORTED:
        return GatewayError(499, "aborted", frame.message)
    return GatewayError(500, "internal", frame.message)
