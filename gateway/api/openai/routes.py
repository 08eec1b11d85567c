"""The OpenAI dialect's routes: chat (chat.py), text completions (completions.py), models
(models.py) on the shared request path."""

from __future__ import annotations

from starlette.routing import Route

from npu_proxy.gateway.api.openai.chat import ChatRequest, OpenAIChatRoutes
from npu_proxy.gateway.api.openai.completions import CompletionRequest, CompletionRoutes
from npu_proxy.gateway.api.openai.models import OpenAIModelRoutes


class OpenAIRoutes(OpenAIChatRoutes, CompletionRoutes, OpenAIModelRoutes):
    def routes(self) -> list[Route]:
        return [
            self.requests.post("/v1/chat/completions", ChatRequest, self.chat),
            self.requests.post("/v1/completions", CompletionRequest, self.completions),
            self.requests.get("/v1/models", self.list_models),
            self.requests.get("/v1/models/{model_id:path}", self.get_model),
        ]
