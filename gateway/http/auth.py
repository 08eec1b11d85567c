"""API key check for every route that does work or shows state, answered in the calling
API's own error shape (gateway/http/wire.py decides which API a request speaks).

Off unless `api_key` is configured. Clients send the key as `Authorization: Bearer` (OpenAI,
Ollama behind a proxy, Prometheus' `authorization: credentials:`) or `x-api-key`
(Anthropic); both are accepted everywhere. Only the probes stay open: liveness (`/health`),
readiness (`/health/ready`, which load balancers ask without a key, and which names no pid,
model or error) and Ollama's (`/`, `/api/version`). `/metrics`, `/health/devices` (pids,
errors) and every model and inference route want the key. CORS preflights never carry it;
gateway/http/policy.py answers them before this check.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from npu_proxy.gateway.core.errors import GatewayError
from npu_proxy.gateway.http.drain import DrainBudget, refuse
from npu_proxy.gateway.http.wire import dialect_for

OPEN_PATHS = frozenset({"/", "/api/version", "/health", "/health/ready"})


def _sent_key(scope: Scope) -> str:
    headers: dict[bytes, bytes] = dict(scope.get("headers", []))
    key = headers.get(b"x-api-key", b"").decode("latin-1")
    auth = headers.get(b"authorization", b"").decode("latin-1")
    if not key and auth.lower().startswith("bearer "):
        key = auth[7:].strip()
    return key


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str, budget: DrainBudget | None = None) -> None:
        self.app = app
        self.api_key = api_key.encode()
        self.budget = budget or DrainBudget()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if (scope["type"] != "http" or not self.api_key or path in OPEN_PATHS
                or path.startswith("/status")  # the status page checks its key: status.py
                or hmac.compare_digest(_sent_key(scope).encode(), self.api_key)):
            await self.app(scope, receive, send)
            return
        exc = GatewayError(401, "authentication", "invalid or missing API key")
        # NOTE: decided from the headers alone: the body is read and dropped, never kept.
        await refuse(dialect_for(scope).error_response(exc), scope, receive, send, self.budget)
