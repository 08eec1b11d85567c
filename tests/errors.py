"""One check of each API's error shape, for tests that send bad input to several APIs."""

from __future__ import annotations

import httpx

from npu_proxy.gateway.http.wire import OPENAI_ROOT_PATHS

# Anthropic's documented error types (https://docs.anthropic.com/en/api/errors).
ANTHROPIC_TYPES = {"invalid_request_error", "authentication_error", "permission_error",
                   "not_found_error", "request_too_large", "rate_limit_error", "api_error",
                   "overloaded_error"}


def error_message(r: httpx.Response) -> str:
    """The message of a refused request, after checking the body is its API's error shape:
    Anthropic's `{"type": "error", "error": {"type", "message"}}`, OpenAI's
    `{"error": {"message", "type", "param", "code"}}` (also on /tokenize and
    /detokenize), Ollama's `{"error": "..."}`."""
    body = r.json()
    path = r.request.url.path
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
        assert body["error"]["type"] in ANTHROPIC_TYPES
        assert r.status_code != 400 or body["error"]["type"] == "invalid_request_error"
        return str(body["error"]["message"])
    if path.startswith("/v1/") or path in OPENAI_ROOT_PATHS:
        assert set(body["error"]) == {"message", "type", "param", "code"}
        return str(body["error"]["message"])
    assert set(body) == {"error"} and isinstance(body["error"], str)
    return str(body["error"])
