"""OpenAI's models listing: GET /v1/models and /v1/models/{id} (in Anthropic's shape when
Anthropic's SDK asks: dialect_for)."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from npu_proxy.gateway.api import anthropic as anthropic_api
from npu_proxy.gateway.api.request_path import DialectRoutes, ServedModel
from npu_proxy.gateway.http.wire import ANTHROPIC, dialect_for


class OpenAIModelRoutes(DialectRoutes):
    async def _model_card(self, model: ServedModel) -> dict[str, Any]:
        """OpenAI's card, with vLLM's `max_model_len` (0 when unknown) and the model's
        `capabilities` as /api/show names them (extensions clients may ignore)."""
        return {"id": model.name, "object": "model", "created": self.catalog.started,
                "owned_by": "npu-proxy",
                "max_model_len": await self.catalog.context_length(model),
                "capabilities": (await self.catalog.capabilities(model)).names}

    async def list_models(self, request: Request) -> Response:
        if dialect_for(request.scope) is ANTHROPIC:
            return anthropic_api.models_page(list(self.catalog.models()), self.catalog.started,
                                             request)
        data = [await self._model_card(m) for m in self.catalog.models().values()]
        return JSONResponse({"object": "list", "data": data})

    async def get_model(self, request: Request) -> Response:
        model = self.requests.resolve(request.path_params["model_id"])
        if dialect_for(request.scope) is ANTHROPIC:
            return JSONResponse(anthropic_api.model_info(model.name, self.catalog.started))
        return JSONResponse(await self._model_card(model))
