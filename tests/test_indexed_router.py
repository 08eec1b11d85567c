"""The gateway's router finds fixed paths in a dict, and must choose as Starlette's list does."""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Match, Route
from starlette.testclient import TestClient

from npu_proxy.gateway.app import Gateway, IndexedRouter
from npu_proxy.protocol.config import Config


def _answer(name: str) -> Route:
    async def endpoint(request: Request) -> PlainTextResponse:
        return PlainTextResponse(f"{name} {request.scope['route'].path}")
    return endpoint  # type: ignore[return-value]


def test_the_route_chosen_is_the_one_the_list_would_choose() -> None:
    routes = [
        Route("/items/{name}", _answer("param"), methods=["GET"]),
        Route("/items/special", _answer("fixed"), methods=["GET", "POST"]),
        Route("/c", _answer("get-c"), methods=["GET"]),
        Route("/c", _answer("post-c"), methods=["POST"]),
        Route("/d", _answer("d"), methods=["POST"]),
    ]
    app = Starlette(routes=routes)
    app.router = IndexedRouter(routes)
    # NOTE: /items/special comes after a route that matches it, and the second /c after
    # one whose path matches (another method): neither may be found in the dict.
    assert sorted(app.router.fixed) == ["/c", "/d"]
    with TestClient(app) as client:
        # A GET of /items/special is the parameter route's, as in the list.
        assert client.get("/items/special").text == "param /items/{name}"
        assert client.post("/items/special").text == "fixed /items/special"
        assert client.get("/c").text == "get-c /c"
        assert client.post("/c").text == "post-c /c"
        assert client.post("/d").text == "d /d"
        assert client.get("/d").status_code == 405
        assert client.get("/nowhere").status_code == 404


def test_every_fixed_path_of_the_gateway_is_found_where_the_list_finds_it() -> None:
    gateway = Gateway(Config())
    app = gateway.app()
    while not isinstance(getattr(app, "router", None), IndexedRouter):
        app = app.app  # type: ignore[attr-defined]
    router = app.router  # type: ignore[attr-defined]
    assert {"/v1/chat/completions", "/v1/embeddings", "/api/chat", "/api/embed",
            "/v1/messages", "/health"} <= set(router.fixed)
    for path, candidates in router.fixed.items():
        for method in {m for route in candidates for m in route.methods or ()}:
            scope = {"type": "http", "path": path, "root_path": "", "method": method}
            listed = next(r for r in router.routes if r.matches(scope)[0] is Match.FULL)
            fast = next(r for r in candidates if r.matches(scope)[0] is Match.FULL)
            assert fast is listed, (path, method)
