"""The live status page for browsers, its event stream and its snapshot.

- `GET /` asked for HTML (a browser navigating: its Accept names text/html) is the page;
  anything else there keeps Ollama's plain answer (gateway/api/ollama/routes.py asks
  `wants_html`).
- `GET /status/events` (text/event-stream): the snapshot as a `data:` event whenever it
  changed, looked at once a second; a comment line when nothing changed for a while, to keep
  proxies from closing the stream. It ends when the client goes away or the gateway stops
  (then with a `shutdown` event). One per open page, at most `status_max_streams` at once.
- `GET /status.json`: the same snapshot, for scripts.
- `POST /status/login`: `{"key": ...}` (JSON, as the key form's script sends it): 204 with
  the cookie below, or 401.

The snapshot: every worker (gateway/core/health.py's row, as /health/devices shows it),
tokens/s, finished generations and their median TTFT over the last 1 and 5 minutes and the
latest errors (gateway/core/recent.py), and how many pages are open.

With an API key set, all of them want it: in a header like every route (gateway/http/auth.py
leaves /status* to this module), or, since a browser's EventSource sends no headers, as the
HttpOnly SameSite=Strict cookie the login sets. The cookie holds a token derived from the key,
not the key, and only these routes accept it. Without the key, `GET /` in a browser is the
key form (401) and shows nothing of the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Send

from npu_proxy.gateway.core.broker import Broker
from npu_proxy.gateway.core.errors import GatewayError
from npu_proxy.gateway.core.health import worker_rows
from npu_proxy.gateway.core.metrics import Metrics
from npu_proxy.gateway.http.auth import _sent_key
from npu_proxy.gateway.http.util import decode_body, dumps
from npu_proxy.gateway.http.wire import dialect_for
from npu_proxy.gateway.pages.status_page import LOGIN, LOGIN_HEADERS, PAGE, PAGE_HEADERS
from npu_proxy.protocol.config import Config

log = logging.getLogger(__name__)

COOKIE = "npu_proxy_key"
PUSH_EVERY_S = 1.0
KEEPALIVE_S = 15.0
# NOTE: what the browser waits before it reconnects a stream that ended (a gateway restart).
RETRY_MS = 2000
# Volatile row fields a page does not show; left out so they do not count as a change.
ROW_FIELDS = ("name", "role", "device", "model", "state", "up", "pid", "restarts", "queue",
              "in_flight", "gateway_requests", "last_error")


class LoginRequest(msgspec.Struct):
    key: str


def cookie_token(api_key: str) -> str:
    """The cookie's value: proves the key was given, yet is no API key itself."""
    return hmac.new(api_key.encode(), b"npu-proxy status page", hashlib.sha256).hexdigest()


class EventStream(StreamingResponse):
    """A streaming response whose generator is closed (its `finally` run) however the
    response ends, also when the client's disconnect interrupts a send."""

    def __init__(self, events: AsyncIterator[bytes], headers: dict[str, str]) -> None:
        super().__init__(events, media_type="text/event-stream", headers=headers)
        self.events = events

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            aclose = getattr(self.events, "aclose", None)
            if aclose is not None:
                await aclose()


class StatusRoutes:
    def __init__(self, config: Config, broker: Broker, metrics: Metrics) -> None:
        self.config = config
        self.broker = broker
        self.metrics = metrics
        self.streams = 0
        self._closing = asyncio.Event()
        self._key = config.api_key.encode()
        self._token = cookie_token(config.api_key).encode() if config.api_key else b""

    def routes(self) -> list[Route]:
        return [
            Route("/status.json", self.json, methods=["GET"]),
            Route("/status/events", self.events, methods=["GET"]),
            Route("/status/login", self.login, methods=["POST"]),
        ]

    def close(self) -> None:
        """End every open event stream now (the gateway is stopping)."""
        self._closing.set()

    def snapshot(self) -> dict[str, Any]:
        rows = worker_rows(self.config, self.broker, self.metrics)
        return {
            "workers": [{k: row[k] for k in ROW_FIELDS} for row in rows],
            **self.metrics.recent.summary(),
            "pages": self.streams,
        }

    # --- the key -------------------------------------------------------------------------

    def _authorized(self, request: Request) -> bool:
        if not self._key:
            return True
        if hmac.compare_digest(_sent_key(request.scope).encode(), self._key):
            return True
        cookie = request.cookies.get(COOKIE, "").encode("utf-8", "replace")
        return hmac.compare_digest(cookie, self._token)

    def _refused(self, request: Request) -> Response:
        exc = GatewayError(401, "authentication", "invalid or missing API key")
        return dialect_for(request.scope).error_response(exc)

    async def login(self, request: Request) -> Response:
        # NOTE: JSON, not an HTML form: gateway/http/policy.py refuses the body types a
        # foreign page may post without a preflight.
        try:
            key = (await decode_body(request, LoginRequest)).key
        except GatewayError as exc:
            return dialect_for(request.scope).error_response(exc)
        if not self._key:
            return Response(status_code=204)
        if not hmac.compare_digest(key.encode("utf-8", "replace"), self._key):
            return self._refused(request)
        response = Response(status_code=204)
        response.set_cookie(COOKIE, self._token.decode(), path="/", httponly=True,
                            samesite="strict")
        return response

    # --- the page, its snapshot and its stream -------------------------------------------

    async def page(self, request: Request) -> Response:
        if not self._authorized(request):
            return HTMLResponse(LOGIN, status_code=401, headers=LOGIN_HEADERS)
        return HTMLResponse(PAGE, headers=PAGE_HEADERS)

    async def json(self, request: Request) -> Response:
        if not self._authorized(request):
            return self._refused(request)
        return Response(dumps(self.snapshot()), media_type="application/json",
                        headers={"Cache-Control": "no-store"})

    async def events(self, request: Request) -> Response:
        if not self._authorized(request):
            return self._refused(request)
        if self.streams >= self.config.status_max_streams:
            exc = GatewayError(503, "unavailable",
                               f"{self.streams} status pages are open (status_max_streams)",
                               retry_after=5)
            return dialect_for(request.scope).error_response(exc)
        return EventStream(self._stream(), headers={
            "Cache-Control": "no-store", "X-Content-Type-Options": "nosniff",
            # NOTE: nginx buffers a proxied response unless told not to.
            "X-Accel-Buffering": "no"})

    async def _stream(self) -> AsyncIterator[bytes]:
        self.streams += 1
        try:
            yield f"retry: {RETRY_MS}\n\n".encode()
            last = b""
            said = time.monotonic()
            while not self._closing.is_set():
                data = dumps(self.snapshot())
                now = time.monotonic()
                if data != last:
                    last, said = data, now
                    yield b"data: " + data + b"\n\n"
                elif now - said >= KEEPALIVE_S:
                    said = now
                    yield b": keep-alive\n\n"
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(PUSH_EVERY_S):
                        await self._closing.wait()
            yield b"event: shutdown\ndata: {}\n\n"
        finally:
            self.streams -= 1
