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
not the key, and only these routes accept it. Its name carries the port (two servers on one
host do not share it: cookies ignore ports) and its token the port and an expiry, checked here
as well as by the browser (Max-Age). Failed logins are counted per client address: past
`LOGIN_FAILURES` in `LOGIN_WINDOW_S`, /status/login answers 429 with Retry-After. Without
the key, `GET /` in a browser is the key form (401) and shows nothing of the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import math
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
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
# NOTE: a day: a status page left open keeps its stream; a new login is a key away.
COOKIE_MAX_AGE_S = 24 * 3600
LOGIN_FAILURES = 10
LOGIN_WINDOW_S = 60.0
# NOTE: the failure table's size is bounded, so a client with many addresses cannot grow it.
LOGIN_TRACKED = 4096
PUSH_EVERY_S = 1.0
KEEPALIVE_S = 15.0
# NOTE: what the browser waits before it reconnects a stream that ended (a gateway restart).
RETRY_MS = 2000
# Volatile row fields a page does not show; left out so they do not count as a change.
ROW_FIELDS = ("name", "role", "device", "model", "state", "up", "pid", "restarts", "queue",
              "in_flight", "gateway_requests", "last_error")


class LoginRequest(msgspec.Struct):
    key: str


def cookie_name(port: int) -> str:
    return f"{COOKIE}_{port}"


def cookie_token(api_key: str, port: int, expires: int) -> str:
    """The cookie's value: proves the key was given (to this port, until `expires`, a Unix
    time), yet is no API key itself."""
    message = f"npu-proxy status page:{port}:{expires}".encode()
    mac = hmac.new(api_key.encode(), message, hashlib.sha256).hexdigest()
    return f"{expires}.{mac}"


class LoginFailures:
    """Failed logins per client address in a sliding window, in a bounded table."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._seen: OrderedDict[str, list[float]] = OrderedDict()

    def _recent(self, client: str) -> list[float]:
        now = self.clock()
        times = [t for t in self._seen.get(client, ()) if now - t < LOGIN_WINDOW_S]
        if times:
            self._seen[client] = times
        else:
            self._seen.pop(client, None)
        return times

    def retry_after(self, client: str) -> int:
        """Seconds until `client` may try again; 0 when it may now."""
        times = self._recent(client)
        if len(times) < LOGIN_FAILURES:
            return 0
        return max(1, math.ceil(times[-LOGIN_FAILURES] + LOGIN_WINDOW_S - self.clock()))

    def failed(self, client: str) -> None:
        times = self._recent(client)
        self._seen[client] = [*times[-LOGIN_FAILURES:], self.clock()]
        self._seen.move_to_end(client)
        while len(self._seen) > LOGIN_TRACKED:
            self._seen.popitem(last=False)


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
        self._cookie = cookie_name(config.port)
        self._failures = LoginFailures()

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
        cookie = request.cookies.get(self._cookie, "")
        expires, _, _ = cookie.partition(".")
        if not expires.isdigit() or len(expires) > 12 or int(expires) <= time.time():
            return False
        token = cookie_token(self.config.api_key, self.config.port, int(expires))
        return hmac.compare_digest(cookie.encode("utf-8", "replace"), token.encode())

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
        client = request.client.host if request.client else ""
        wait = self._failures.retry_after(client)
        if wait:
            limited = GatewayError(429, "rate_limit",
                                   f"too many failed logins; try again in {wait} s",
                                   retry_after=wait)
            return dialect_for(request.scope).error_response(limited)
        if not hmac.compare_digest(key.encode("utf-8", "replace"), self._key):
            self._failures.failed(client)
            return self._refused(request)
        response = Response(status_code=204)
        token = cookie_token(self.config.api_key, self.config.port,
                             int(time.time()) + COOKIE_MAX_AGE_S)
        response.set_cookie(self._cookie, token, max_age=COOKIE_MAX_AGE_S, path="/",
                            httponly=True, samesite="strict")
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
