"""Ollama dialect: /, /api/version, /api/tags, /api/show, /api/ps, /api/generate, /api/chat.

The model information routes are here; /api/generate (generate.py) and /api/chat (chat.py)
stand on what they share (turn.py) and answer with one reply (reply.py).

Translates Ollama's wire format to a Generate request and the worker's output back to
Ollama's NDJSON chunks (streaming is the default) or one JSON object with `stream: false`.
Decoding, dispatch, streaming and errors are the shared request path
(gateway/api/request_path.py), and the sampling options go through the one mapping in
gateway/content/params.py. Errors are
`{"error": "..."}`; a failure after the stream started is written as a last `{"error": "..."}`
line (OLLAMA in gateway/http/wire.py).

Decisions where Ollama's semantics do not carry over:
- `template` (a Go template) is rendered here for the subset single-prompt templates use
  (gateway/api/ollama/template.py) and the result is sent raw; other templates are a 400.
  A model made by /api/create with such a TEMPLATE has it applied the same way; its SYSTEM,
  MESSAGE and PARAMETER settings apply to every request (gateway/content/created_model.py).
- `suffix`, `images` and `think` are a 400 unless the model has the capability (insert,
  vision, thinking: models/capabilities.py), the same facts /api/show reports. `images`
  (base64, as the ollama client sends a path's file) are decoded and checked by
  gateway/content/images.py; on /api/generate they go with the prompt as one user message, so
  `raw` and `template` (which bypass the chat template) are a 400 with images.
- A thinking model's reasoning is `message.thinking` (/api/chat) or `thinking`
  (/api/generate), split from the answer by gateway/content/reasoning.py; `think: false` leaves
  it out and sets the template's `enable_thinking` to false; absent, the model thinks.
- `context` (token ids of an earlier /api/generate exchange) is accepted and ignored, and the
  final chunk carries no `context`: workers stream text, not token ids, and the field is
  deprecated in Ollama. Clients that keep a conversation use /api/chat.
- Ollama has no tool_choice: tools given means "auto"; the extension `options.tool_choice`
  ("required", "none" or a function name) forces a call (gateway/content/tools/).
- keep_alive is reported by /api/ps, but a worker's configured model stays loaded; only a model
  a worker was switched to is unloaded when it runs out (gateway/core/switching.py). Load and
  unload requests are answered at once.
"""

from __future__ import annotations

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from npu_proxy.gateway.api.ollama import models as ollama_models
from npu_proxy.gateway.api.ollama.chat import ChatRequest, OllamaChatRoutes
from npu_proxy.gateway.api.ollama.generate import GenerateRequest, GenerateRoutes
from npu_proxy.gateway.api.request_path import Handler, ModelCatalog, RequestPath
from npu_proxy.gateway.http.util import dumps, wants_html

# The Ollama release whose API surface this server implements (docs/api.md "Ollama's
# version"): its native /api routes and its OpenAI compatibility including /v1/responses
# (Ollama 0.13.3; Codex CLI's Ollama provider wants >= 0.13.4 before it uses it).
# NOTE: numeric only; Open WebUI parses it as integers and some clients require >= 0.6.4.
OLLAMA_VERSION = "0.13.4"


class ShowRequest(msgspec.Struct):
    model: str = ""
    name: str = ""  # the legacy spelling
    verbose: bool | None = None


class OllamaRoutes(GenerateRoutes, OllamaChatRoutes):
    def __init__(self, requests: RequestPath, catalog: ModelCatalog,
                 browser: Handler | None = None) -> None:
        super().__init__(requests)
        self.catalog = catalog
        # What `GET /` shows a browser (the status page, gateway/pages/status.py).
        self.browser = browser

    def routes(self) -> list[Route]:
        return [
            Route("/", self.root, methods=["GET", "HEAD"]),
            Route("/api/version", self.version, methods=["GET", "HEAD"]),
            Route("/api/tags", self.tags, methods=["GET", "HEAD"]),
            self.requests.post("/api/show", ShowRequest, self.show),
            Route("/api/ps", self.ps, methods=["GET", "HEAD"]),
            self.requests.post("/api/generate", GenerateRequest, self.generate),
            self.requests.post("/api/chat", ChatRequest, self.chat),
        ]

    async def root(self, request: Request) -> Response:
        if self.browser is not None and wants_html(request):
            return await self.browser(request)
        return PlainTextResponse("Ollama is running", headers={"Vary": "Accept"})

    async def version(self, request: Request) -> Response:
        return JSONResponse({"version": OLLAMA_VERSION})

    async def tags(self, request: Request) -> Response:
        body = await ollama_models.tags(self.catalog)
        return Response(dumps(body), media_type="application/json")

    async def ps(self, request: Request) -> Response:
        body = await ollama_models.ps(self.catalog)
        return Response(dumps(body), media_type="application/json")

    async def show(self, request: Request, req: ShowRequest) -> Response:
        model = self.requests.resolve(req.model or req.name)
        body = await ollama_models.show(self.catalog, model)
        return Response(dumps(body), media_type="application/json")
