"""The Starlette application: routes of every API, health, request ids."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from typing import Any

from starlette.applications import Starlette
from starlette.routing import BaseRoute, Match, Route
from starlette.routing import Router as StarletteRouter
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from npu_proxy.gateway.admin.create import BLOBS_PREFIX, CreateRoutes
from npu_proxy.gateway.admin.manage import ModelAdminRoutes
from npu_proxy.gateway.api.anthropic import AnthropicRoutes
from npu_proxy.gateway.api.audio import AudioRoutes
from npu_proxy.gateway.api.embeddings import EmbeddingRoutes
from npu_proxy.gateway.api.ollama.routes import OllamaRoutes
from npu_proxy.gateway.api.openai.routes import OpenAIRoutes
from npu_proxy.gateway.api.request_path import RequestPath
from npu_proxy.gateway.api.rerank import RerankRoutes
from npu_proxy.gateway.api.responses.routes import ResponsesRoutes
from npu_proxy.gateway.api.responses.store import ResponseStore
from npu_proxy.gateway.api.speech import SpeechRoutes
from npu_proxy.gateway.api.tokenizer import TokenizerRoutes
from npu_proxy.gateway.core.broker import Broker
from npu_proxy.gateway.core.catalog import ModelCatalog
from npu_proxy.gateway.core.health import HealthRoutes
from npu_proxy.gateway.core.metrics import Metrics
from npu_proxy.gateway.core.router import Router
from npu_proxy.gateway.http.access import MetricsMiddleware
from npu_proxy.gateway.http.auth import ApiKeyMiddleware
from npu_proxy.gateway.http.body_limit import BodyLimitMiddleware
from npu_proxy.gateway.http.drain import DrainBudget
from npu_proxy.gateway.http.policy import HttpPolicyMiddleware
from npu_proxy.gateway.http.util import accept_request_id
from npu_proxy.gateway.http.wire import api_label
from npu_proxy.gateway.pages.openapi import OpenAPIRoute
from npu_proxy.gateway.pages.status import StatusRoutes
from npu_proxy.models.upkeep import tidy
from npu_proxy.protocol.config import Config

log = logging.getLogger(__name__)


class RequestIdMiddleware:
    """Every response carries X-Request-ID: the client's own, or a new one."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = ""
        for key, value in scope.get("headers", []):
            if key == b"x-request-id":
                sent = value.decode("latin-1")
        rid = accept_request_id(sent)
        scope.setdefault("state", {})["request_id"] = rid

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                headers.append((b"x-request-id", rid.encode("latin-1")))
                message["headers"] = headers
            await send(message)

        await self.app(scope, receive, send_with_id)


class IndexedRouter(StarletteRouter):
    """Starlette's router, with each fixed path looked up in a dict before the list is tried.

    Starlette tries the routes in order, a regular expression each: 30 of them before it
    reaches /v1/embeddings, on every request. A path is indexed only
    where no route before it matches it (for any of its methods), so the route chosen is
    always the one the list would choose; anything else takes the list as before.
    """

    def __init__(self, routes: Sequence[BaseRoute], **kwargs: Any) -> None:
        super().__init__(routes=routes, **kwargs)
        self.fixed: dict[str, list[Route]] = {}
        for i, route in enumerate(routes):
            if not isinstance(route, Route) or "{" in route.path:
                continue
            probes = [{"type": "http", "path": route.path, "root_path": "", "method": method}
                      for method in route.methods or ("GET",)]
            if any(earlier.matches(probe)[0] != Match.NONE
                   for earlier in routes[:i] for probe in probes):
                continue
            self.fixed.setdefault(route.path, []).append(route)

    async def app(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not scope.get("root_path"):
            for route in self.fixed.get(scope["path"], ()):
                match, child_scope = route.matches(scope)
                if match is Match.FULL:
                    scope.setdefault("router", self)
                    scope["route"] = route
                    scope.update(child_scope)
                    await route.handle(scope, receive, send)
                    return
        await super().app(scope, receive, send)


class Gateway:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.broker = Broker(config)
        self.router = Router(config, self.broker)
        self.metrics = Metrics(config, self.broker)
        self.broker.listeners.append(self.metrics)
        self.router.observers.append(self.metrics)
        # NOTE: one catalog, so each model's files are described (hashed) once for all APIs.
        self.catalog = ModelCatalog(self.router)
        self.requests = RequestPath(self.router, self.catalog)
        self.responses = ResponseStore.from_config(config)
        self.status = StatusRoutes(config, self.broker, self.metrics)

    def routes(self) -> list[Any]:
        routes: list[Any] = [
            *HealthRoutes(self.config, self.broker, self.metrics).routes(),
            Route("/metrics", self.metrics.endpoint, methods=["GET"]),
            *OpenAIRoutes(self.requests).routes(),
            *ResponsesRoutes(self.requests, self.responses).routes(),
            *AnthropicRoutes(self.requests).routes(),
            *ModelAdminRoutes(self.router).routes(),
            *CreateRoutes(self.router).routes(),
            *OllamaRoutes(self.requests, self.catalog, browser=self.status.page).routes(),
            *self.status.routes(),
            *EmbeddingRoutes(self.requests).routes(),
            *RerankRoutes(self.requests).routes(),
            *TokenizerRoutes(self.requests).routes(),
            *AudioRoutes(self.requests).routes(),
            *SpeechRoutes(self.requests).routes(),
        ]
        routes.append(OpenAPIRoute(routes).route())
        return routes

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        await self.broker.start()
        await self.router.switcher.residency.ask_states()
        await asyncio.to_thread(tidy, self.router.table.store)
        keep_alive = asyncio.create_task(self.router.switcher.run())
        try:
            yield
        finally:
            self.status.close()
            keep_alive.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keep_alive
            await self.router.switcher.stop()
            await self.broker.stop()

    def app(self) -> ASGIApp:
        routes = self.routes()
        starlette = Starlette(routes=routes, lifespan=self.lifespan)
        starlette.router = IndexedRouter(routes, lifespan=self.lifespan)
        budget = DrainBudget.from_config(self.config)
        # NOTE: the body limit sits inside the Host, Origin and key checks, so a body is kept
        # only for a request they let through; theirs read a refused body and drop it
        # (gateway/http/drain.py), within a budget.
        inner: ASGIApp = BodyLimitMiddleware(
            starlette, self.config.max_body_bytes, exempt=(BLOBS_PREFIX,),
            max_receiving=self.config.max_receiving_bodies, budget=budget)
        inner = ApiKeyMiddleware(inner, self.config.api_key, budget)
        # NOTE: Host, Origin and body type come before the key (a preflight carries none),
        # and all of them inside the metrics and request ids, so a refusal is counted and
        # carries its X-Request-ID.
        inner = HttpPolicyMiddleware(inner, self.config)
        return RequestIdMiddleware(
            MetricsMiddleware(inner, self.metrics, starlette.routes, api_label))
