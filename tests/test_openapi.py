"""The OpenAPI document, and a fuzz of every inference route driven by it.

The fuzz changes one top-level field of a valid request at a time to values of the wrong
type, out of range or empty, and asserts what a client must see: never a 5xx, and every
rejection in the shape of the route's own API.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from errors import error_message
from starlette.routing import Route

from npu_proxy.gateway.app import Gateway
from npu_proxy.gateway.pages.openapi import BODILESS, RAW_BODIES, REQUEST_BODIES
from npu_proxy.protocol.config import load_config

LLM = "smollm2:135m"
EMBED = "all-minilm:l6-v2"
HI = [{"role": "user", "content": "hi"}]

# A valid request per route, kept short: one generated token where a route generates.
VALID: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"model": LLM, "messages": HI, "max_tokens": 1},
    "/v1/completions": {"model": LLM, "prompt": "hi", "max_tokens": 1},
    "/v1/embeddings": {"model": EMBED, "input": "hi"},
    "/v1/responses": {"model": LLM, "input": "hi", "max_output_tokens": 1, "store": False},
    "/v1/messages": {"model": LLM, "messages": HI, "max_tokens": 1},
    "/v1/messages/count_tokens": {"model": LLM, "messages": HI},
    "/api/chat": {"model": LLM, "messages": HI, "stream": False, "options": {"num_predict": 1}},
    "/api/generate": {"model": LLM, "prompt": "hi", "stream": False,
                      "options": {"num_predict": 1}},
    "/api/show": {"model": LLM},
    "/api/embed": {"model": EMBED, "input": "hi"},
    "/api/embeddings": {"model": EMBED, "prompt": "hi"},
}
ODD_VALUES: list[Any] = [None, -1, 1.5, "x", "\u0000", [], [None], {}, True, 10**20]


@pytest.fixture(scope="module")
def document(base_url: str) -> dict[str, Any]:
    r = httpx.get(base_url + "/openapi.json")
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    return dict(r.json())


def test_every_route_that_takes_a_body_is_documented() -> None:
    routes = [r for r in Gateway(load_config(None, env={})).routes() if isinstance(r, Route)]
    taking = {(m, r.path) for r in routes for m in (r.methods or ()) if m in ("POST", "DELETE")}
    assert taking - BODILESS == set(REQUEST_BODIES) | set(RAW_BODIES)


def test_document_lists_every_route_with_its_body(document: dict[str, Any]) -> None:
    assert document["openapi"] == "3.1.0" and document["info"]["title"] == "npu-proxy"
    paths = document["paths"]
    for method, path in REQUEST_BODIES:
        assert _body_schema(document, method, path)["type"] == "object"
    assert paths["/v1/models/{model_id}"]["get"]["parameters"][0]["name"] == "model_id"
    for method, path in RAW_BODIES:
        schema = paths[path][method.lower()]["requestBody"]["content"][
            RAW_BODIES[method, path]]["schema"]
        # NOTE: a multipart form (the audio routes) carries its file as a binary field.
        binary = schema["properties"]["file"] if schema["type"] == "object" else schema
        assert binary["format"] == "binary"
    assert "head" in paths["/api/blobs/{digest}"] and "head" not in paths["/api/tags"]
    assert {"/", "/api/tags", "/health", "/metrics", "/openapi.json"} <= set(paths)
    chat = _properties(document, "POST", "/v1/chat/completions")
    assert {"messages", "max_completion_tokens", "tools", "response_format"} <= set(chat)


def _body_schema(document: dict[str, Any], method: str, path: str) -> dict[str, Any]:
    """The component schema a route's request body refers to."""
    ref = document["paths"][path][method.lower()]["requestBody"]["content"][
        "application/json"]["schema"]["$ref"]
    return dict(document["components"]["schemas"][ref.rsplit("/", 1)[-1]])


def _properties(document: dict[str, Any], method: str, path: str) -> dict[str, Any]:
    return dict(_body_schema(document, method, path)["properties"])


# Fields whose odd values (None, {}, 10**20) leave the output unbounded: the model may write
# until its context is full, which on a loaded machine outlasts any client timeout.
LENGTH_FIELDS = {"max_tokens", "max_completion_tokens", "max_output_tokens", "options"}


def _post(client: httpx.Client, path: str, body: dict[str, Any], unbounded: bool) -> httpx.Response:
    """The route's answer to `body`. Where the output may be unbounded, the request streams
    and is read only up to its status (a refusal is read whole): leaving ends the generation,
    and errors before the first byte are the same whether or not a request streams."""
    if not unbounded or path in ("/v1/messages/count_tokens", "/api/show") or "embed" in path:
        return client.post(path, json=body)
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        if r.status_code >= 400:
            r.read()
        return r


@pytest.mark.parametrize("path", sorted(VALID))
def test_fuzz_one_field_at_a_time(base_url: str, document: dict[str, Any], path: str) -> None:
    fields = _properties(document, "POST", path)
    assert set(VALID[path]) <= set(fields)
    failures = []
    with httpx.Client(base_url=base_url, timeout=120) as client:
        assert client.post(path, json=VALID[path]).status_code == 200
        for field in sorted(fields):
            for value in ODD_VALUES:
                body = {**VALID[path], field: value}
                r = _post(client, path, body, unbounded=field in LENGTH_FIELDS)
                if r.status_code >= 500:
                    failures.append(f"{field}={value!r}: {r.status_code} {r.text[:200]}")
                elif r.status_code >= 400 and not error_message(r):
                    failures.append(f"{field}={value!r}: {r.status_code} without a message")
    assert not failures, "\n".join(failures)
