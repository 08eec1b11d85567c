"""The OpenAPI document of every route, generated from the request types the handlers decode.

Served at GET /openapi.json, as vLLM and other FastAPI-based servers do, for client
generators and fuzzers. Request bodies are the msgspec Structs each handler passes to
decode_body; responses are only described, since their shapes are the three APIs' own.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from npu_proxy.gateway.admin import create as create_api
from npu_proxy.gateway.admin import manage as models_api
from npu_proxy.gateway.api import anthropic as anthropic_api
from npu_proxy.gateway.api import audio as audio_api
from npu_proxy.gateway.api import embeddings as embed_api
from npu_proxy.gateway.api import rerank as rerank_api
from npu_proxy.gateway.api import speech as speech_api
from npu_proxy.gateway.api import tokenizer as tokenizer_api
from npu_proxy.gateway.api.ollama import chat as ollama_chat
from npu_proxy.gateway.api.ollama import generate as ollama_generate
from npu_proxy.gateway.api.ollama import routes as ollama_routes
from npu_proxy.gateway.api.openai import chat as openai_chat
from npu_proxy.gateway.api.openai import completions as openai_completions
from npu_proxy.gateway.api.responses import routes as responses_api
from npu_proxy.gateway.pages import status as status_api

# (method, path) -> the type its handler decodes the body into.
REQUEST_BODIES: dict[tuple[str, str], type[msgspec.Struct]] = {
    ("POST", "/v1/chat/completions"): openai_chat.ChatRequest,
    ("POST", "/v1/completions"): openai_completions.CompletionRequest,
    ("POST", "/v1/responses"): responses_api.ResponsesRequest,
    ("POST", "/v1/embeddings"): embed_api.OpenAIEmbeddingRequest,
    ("POST", "/v1/messages"): anthropic_api.MessagesRequest,
    ("POST", "/v1/messages/count_tokens"): anthropic_api.CountRequest,
    ("POST", "/api/chat"): ollama_chat.ChatRequest,
    ("POST", "/api/generate"): ollama_generate.GenerateRequest,
    ("POST", "/api/show"): ollama_routes.ShowRequest,
    ("POST", "/api/embed"): embed_api.OllamaEmbedRequest,
    ("POST", "/api/embeddings"): embed_api.OllamaEmbeddingsRequest,
    ("POST", "/v1/rerank"): rerank_api.RerankRequest,
    ("POST", "/rerank"): rerank_api.RerankRequest,
    ("POST", "/v2/rerank"): rerank_api.RerankRequest,
    ("POST", speech_api.PATH): speech_api.SpeechRequest,
    ("POST", "/api/pull"): models_api.PullRequest,
    ("POST", "/api/copy"): models_api.CopyRequest,
    ("DELETE", "/api/delete"): models_api.DeleteRequest,
    ("POST", "/api/create"): create_api.CreateRequest,
    ("POST", "/tokenize"): tokenizer_api.TokenizeRequest,
    ("POST", "/detokenize"): tokenizer_api.DetokenizeRequest,
    ("POST", "/v1/tokenize"): tokenizer_api.TokenizeRequest,
    ("POST", "/v1/detokenize"): tokenizer_api.DetokenizeRequest,
    ("POST", "/status/login"): status_api.LoginRequest,
}
# (method, path) -> the media type of a body that is not JSON (read as a stream of bytes).
RAW_BODIES: dict[tuple[str, str], str] = {
    ("POST", create_api.BLOBS_PREFIX + "{digest}"): "application/octet-stream",
    **{("POST", path): "multipart/form-data" for path in audio_api.PATHS},
}

# Routes whose method usually carries a body but whose handler takes none.
BODILESS: set[tuple[str, str]] = {("DELETE", "/v1/responses/{response_id}")}

_PARAM = re.compile(r"\{(\w+)(?::\w+)?\}")


def _version() -> str:
    # NOTE: imported here, when the document is first asked for: importlib.metadata (with
    # email) is 0.02 s of the gateway's imports before it binds (bench/start.py).
    from importlib import metadata

    try:
        return metadata.version("npu-proxy")
    except metadata.PackageNotFoundError:
        return "0"


def document(routes: list[BaseRoute]) -> dict[str, Any]:
    keys = list(REQUEST_BODIES)
    refs, components = msgspec.json.schema_components(
        [REQUEST_BODIES[k] for k in keys], ref_template="#/components/schemas/{name}")
    body_of = dict(zip(keys, refs, strict=True))
    paths: dict[str, dict[str, Any]] = {}
    for route in routes:
        if not isinstance(route, Route) or route.methods is None:
            continue
        path = _PARAM.sub(r"{\1}", route.path)
        # NOTE: HEAD is listed only where it is not GET's shadow (HEAD /api/blobs/...).
        methods = route.methods - {"HEAD"} if "GET" in route.methods else route.methods
        for method in sorted(methods):
            operation: dict[str, Any] = {
                "operationId": f"{method.lower()}{re.sub(r'[^A-Za-z0-9]+', '_', path)}",
                "responses": {
                    "200": {"description": "success"},
                    "default": {"description": "an error, in the shape of the route's API"},
                },
            }
            params = _PARAM.findall(route.path)
            if params:
                operation["parameters"] = [
                    {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
                    for name in params]
            body = body_of.get((method, route.path))
            if body is not None:
                operation["requestBody"] = {
                    "required": True, "content": {"application/json": {"schema": body}}}
            raw = RAW_BODIES.get((method, route.path))
            if raw is not None:
                schema = audio_api.FORM_SCHEMA if raw == "multipart/form-data" else {
                    "type": "string", "format": "binary"}
                operation["requestBody"] = {"required": True,
                                            "content": {raw: {"schema": schema}}}
            paths.setdefault(path, {})[method.lower()] = operation
    return {
        "openapi": "3.1.0",
        "info": {"title": "npu-proxy", "version": _version(),
                 "description": "OpenAI (chat, completions, responses), Ollama and Anthropic "
                                "Messages APIs on OpenVINO GenAI"},
        "paths": paths,
        "components": {"schemas": components},
    }


class OpenAPIRoute:
    """GET /openapi.json for the routes given (the document is built once)."""

    def __init__(self, routes: list[BaseRoute]) -> None:
        self._routes = routes
        self._body: bytes | None = None

    async def endpoint(self, request: Request) -> Response:
        if self._body is None:
            self._body = msgspec.json.encode(document(self._routes))
        return Response(self._body, media_type="application/json")

    def route(self) -> Route:
        return Route("/openapi.json", self.endpoint, methods=["GET"])
