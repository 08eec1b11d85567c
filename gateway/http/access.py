"""Every HTTP request counted and timed by its route template, and logged in one line (the
access log). The counters live in gateway/core/metrics.py, with the workers' own."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from npu_proxy.gateway.core.metrics import Metrics

log = logging.getLogger(__name__)

# Paths probed by load balancers and Prometheus: counted, but logged at DEBUG only.
QUIET_PATHS = ("/health", "/health/ready", "/health/devices", "/metrics")


class MetricsMiddleware:
    """Counts and times every HTTP request by its route template, and logs one line for it.

    The route template (not the raw path) keeps label values bounded; paths that match no
    route are counted as "unmatched".
    """

    def __init__(self, app: ASGIApp, metrics: Metrics, routes: list[BaseRoute],
                 api_of: Callable[[Scope], str]) -> None:
        self.app = app
        self.metrics = metrics
        self.routes = routes
        # The `api` label: the request's API as the error shapes decide it (http/wire.py).
        self.api_of = api_of

    def _endpoint(self, scope: Scope) -> str:
        # NOTE: Starlette's router records the route it matched in the scope; matching the
        # path again is only needed for requests answered before routing (401, 404).
        route = scope.get("route")
        if route is not None:
            return str(getattr(route, "path", "unmatched"))
        partial = None
        for route in self.routes:
            match, _ = route.matches(scope)
            if match == Match.FULL:
                return str(getattr(route, "path", "unmatched"))
            if match == Match.PARTIAL and partial is None:
                partial = str(getattr(route, "path", "unmatched"))
        return partial or "unmatched"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        status = 500
        headers: dict[bytes, bytes] = {}

        async def send_watched(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                headers.update((k.lower(), v) for k, v in message.get("headers", []))
            await send(message)

        try:
            await self.app(scope, receive, send_watched)
        finally:
            self._observe(scope, status, headers, time.monotonic() - started)

    def _observe(self, scope: Scope, status: int, headers: dict[bytes, bytes],
                 elapsed: float) -> None:
        path = str(scope.get("path", ""))
        endpoint = self._endpoint(scope)
        api = "other" if endpoint == "unmatched" else self.api_of(scope)
        self.metrics.requests.labels(endpoint, api, str(status)).inc()
        self.metrics.request_duration.labels(endpoint, api).observe(elapsed)
        state = scope.get("state", {})
        rid = str(state.get("request_id", ""))
        key = str(state.get("key", ""))
        route = self.metrics.route_of(key) if key else None
        worker, device = route or (
            headers.get(b"x-npu-proxy-worker", b"").decode("latin-1"),
            headers.get(b"x-npu-proxy-device", b"").decode("latin-1"))
        if status >= 500:
            self.metrics.recent.error(worker, f"{scope.get('method', '')} {path} answered {status}")
        level = logging.DEBUG if path in QUIET_PATHS else logging.INFO
        log.log(level, "%s %s %d %.3fs", scope.get("method", ""), path, status, elapsed,
                extra={"request_id": rid or None, "worker": worker or None,
                       "device": device or None})
