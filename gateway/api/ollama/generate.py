"""Ollama's /api/generate: a prompt (raw, through a `template`, or as one user message with
its images), `suffix` for insert models, `context` accepted and ignored."""

from __future__ import annotations

import logging

from starlette.requests import Request
from starlette.responses import Response

from npu_proxy.gateway.api.dispatch import Dispatch
from npu_proxy.gateway.api.ollama.reply import OllamaReply
from npu_proxy.gateway.api.ollama.template import render, supported
from npu_proxy.gateway.api.ollama.turn import TurnRequest, TurnRoutes, logprobs_top
from npu_proxy.gateway.api.request_path import invalid, require
from npu_proxy.gateway.http.util import request_id
from npu_proxy.models.capabilities import INSERT, VISION
from npu_proxy.protocol.messages import ChatMessage

log = logging.getLogger(__name__)


class GenerateRequest(TurnRequest):
    prompt: str | None = None
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool | None = None
    images: list[str] | None = None


class GenerateRoutes(TurnRoutes):
    async def generate(self, request: Request, req: GenerateRequest) -> Response | Dispatch:
        rid = request_id(request)
        facts, keep, params = await self._common(req)
        model, caps = facts.model, facts.capabilities
        if req.images:
            require(caps, VISION, req.model, "images")
        if req.raw and (req.template or req.system or req.context):
            raise invalid("raw mode does not support template, system, or context",
                          param="raw")
        if req.images and (req.raw or req.template):
            raise invalid("images need the model's chat template: raw and template are not "
                          "supported with images", param="images")
        images = self.requests.images()
        found = [await images.base64(text, f"images[{j}]", "images")
                 for j, text in enumerate(req.images or [])]
        if req.suffix:
            require(caps, INSERT, req.model, "suffix")
            if req.raw or req.images:
                raise invalid("suffix needs the model's own fill-in-the-middle prompt: raw "
                              "and images are not supported with it", param="suffix")
        thinking, variables = self._thinking(facts, req)
        if not req.prompt and not found and not req.suffix:
            return self._load(model, req.model, keep, chat=False)
        if req.context:
            log.debug("ignoring %d context token ids", len(req.context),
                      extra={"request_id": rid})
        messages: list[ChatMessage] | None = None
        prompt: str | None = None
        record = model.created
        # NOTE: a created model's TEMPLATE is used where it renders here (single-prompt
        # templates); a chat template (.Messages, range) is left to the model's own.
        template = req.template or (record.template if record is not None and record.template
                                    and supported(record.template) else None)
        if req.raw:
            prompt = req.prompt
        elif req.suffix and caps.fim is not None:
            # NOTE: as Ollama's templates for these models: the form alone, no system prompt.
            prompt = caps.fim.prompt(req.prompt or "", req.suffix)
        elif template and not found:
            system = req.system or (record.system if record is not None else None) or ""
            prompt = render(template, system, req.prompt or "",
                            limit=self.config.max_prompt_chars)
        else:
            messages = [ChatMessage(role="user", content=req.prompt or "", images=found)]
            if req.system:
                messages.insert(0, ChatMessage(role="system", content=req.system))
        msg = await self.requests.generate(request, model, params, requested=req.model,
                                       messages=messages, prompt=prompt,
                                       template_vars=variables)
        return self._turn(model, req, msg, keep,
                          OllamaReply(req.model, False, None, logprobs_top(req), thinking))
