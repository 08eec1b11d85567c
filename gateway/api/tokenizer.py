"""POST /tokenize and /detokenize (also under /v1/), as vLLM serves them.

`/tokenize` takes `{model, prompt}` or a chat `{model, messages, tools,
add_generation_prompt}` and answers `{count, max_model_len, tokens, token_strs}` with the
worker's own tokenizer: a chat is prepared exactly like /v1/chat/completions (template,
tools), so `count` equals that chat's `prompt_tokens`. `add_special_tokens` defaults to what a
generation does here (no tokens added beyond the template's), so a prompt's count equals
/v1/completions' `prompt_tokens` too. `/detokenize` takes `{model, tokens}` and answers
`{prompt}`, special tokens included. `chat_template_kwargs` (vLLM's) are the chat template's
extra variables, as on /v1/chat/completions. llama.cpp's spellings are accepted as well (`content`,
`add_special`) and `/detokenize` also answers its `content`. Errors are OpenAI's shape
(gateway/http/wire.py).
"""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from npu_proxy.gateway.api.limits import check_token_ids
from npu_proxy.gateway.api.openai import chat as openai_chat
from npu_proxy.gateway.api.request_path import DialectRoutes, ServedModel, invalid
from npu_proxy.gateway.http.util import request_id, request_key
from npu_proxy.protocol.messages import Detokenize


class TokenizeRequest(msgspec.Struct):
    model: str = ""
    prompt: str | None = None
    messages: list[openai_chat.Message] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    add_generation_prompt: bool = True
    # Extra variables for the chat template (vLLM's), e.g. {"enable_thinking": false}.
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool | None = None
    return_token_strs: bool | None = False
    # llama.cpp's names for `prompt` and `add_special_tokens`.
    content: str | None = None
    add_special: bool | None = None


class DetokenizeRequest(msgspec.Struct):
    model: str = ""
    tokens: list[int] = []


class TokenizerRoutes(DialectRoutes):
    def routes(self) -> list[Route]:
        routes = []
        for prefix in ("", "/v1"):
            routes.append(self.requests.post(prefix + "/tokenize", TokenizeRequest, self.tokenize))
            routes.append(self.requests.post(prefix + "/detokenize", DetokenizeRequest,
                                         self.detokenize))
        routes.append(self.requests.get("/tokenizer_info", self.tokenizer_info))
        return routes

    def _model(self, name: str) -> ServedModel:
        """The model named, else (llama.cpp clients name none) the default LLM."""
        return self.requests.resolve(name or self.requests.default_llm(), kind="llm")

    async def tokenize(self, request: Request, req: TokenizeRequest) -> Response:
        prompt = req.prompt if req.prompt is not None else req.content
        if (prompt is None) == (req.messages is None):
            raise invalid("give either 'prompt' or 'messages'", param="prompt")
        model = self._model(req.model)
        special = req.add_special_tokens if req.add_special_tokens is not None \
            else bool(req.add_special)
        messages = tools = None
        facts = await self.requests.facts(model)
        if req.messages is not None:
            messages = await openai_chat.chat_messages(req.messages, facts.capabilities,
                                                      req.model or model.name,
                                                      self.requests.images())
            tools = openai_chat.tool_request(openai_chat.ChatRequest(
                tools=req.tools, tool_choice=req.tool_choice), self.requests.limits.tool_budget())
        msg = await self.requests.tokenize(request, facts, messages, tools, prompt=prompt,
                                       want_tokens=True, add_special_tokens=special,
                                       add_generation_prompt=req.add_generation_prompt,
                                       template_vars=req.chat_template_kwargs or None)
        count = await self.requests.count(request, model, msg)
        return JSONResponse({
            "count": count.count,
            "max_model_len": facts.context_length,
            "tokens": count.tokens or [],
            "token_strs": count.pieces if req.return_token_strs else None,
        })

    async def detokenize(self, request: Request, req: DetokenizeRequest) -> Response:
        model = self._model(req.model)
        await check_token_ids(self.catalog, model, req.tokens, "tokens")
        msg = Detokenize(id=request_key(request), model=model.name, tokens=req.tokens,
                         log_id=request_id(request))
        text = (await self.requests.detokenize(request, model, msg)).text
        return JSONResponse({"prompt": text, "content": text})

    async def tokenizer_info(self, request: Request) -> Response:
        """vLLM's GET /tokenizer_info for the model named in `?model=` (else the default
        LLM): its special tokens, chat template and context, what lm-evaluation-harness's
        `remote` tokenizer reads before it tokenizes through /tokenize and /detokenize."""
        model = self._model(request.query_params.get("model", ""))
        facts = await self.requests.facts(model)
        msg = Detokenize(id=request_key(request), model=model.name, tokens=[],
                         log_id=request_id(request), specials=True)
        specials = (await self.requests.detokenize(request, model, msg)).specials
        return JSONResponse({
            "tokenizer_class": "OpenVINOTokenizer", "model": model.name,
            "eos_token": specials.get("eos_token"), "bos_token": specials.get("bos_token"),
            "pad_token": specials.get("pad_token"),
            "chat_template": facts.chat_template or None,
            "model_max_length": facts.context_length or None})

