"""OpenAI text completions: POST /v1/completions (one prompt, `suffix` for insert models,
`echo`, logprobs)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgspec
from starlette.requests import Request

from npu_proxy.gateway.api.dispatch import Dispatch
from npu_proxy.gateway.api.openai.shared import (
    Reply,
    SamplingFields,
    check_common,
    finish_reason,
    sampling_params,
    usage_json,
    wants_usage,
)
from npu_proxy.gateway.api.request_path import DialectRoutes, Generation, invalid, now, require
from npu_proxy.gateway.content import logprobs as lp
from npu_proxy.models.capabilities import INSERT


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | None = None
    suffix: str | None = None
    echo: bool | None = False
    # The number of alternatives per token (0-5); absent: no logprobs.
    logprobs: int | None = None


def _completion_logprobs(req: CompletionRequest) -> int | None:
    if req.logprobs is None:
        return None
    top = lp.top_count(req.logprobs, "logprobs", lp.MAX_COMPLETION_TOP)
    if req.echo:
        raise invalid("echo with logprobs is not supported: the prompt's tokens have no "
                      "log-probabilities here", param="echo")
    return top


class CompletionReply(Reply):
    def __init__(self, model: str, include_usage: bool, prefix: str,
                 logprobs: int | None = None) -> None:
        super().__init__("cmpl-", model, include_usage)
        self.prefix = prefix  # the prompt, echoed
        self.logprobs = logprobs  # None: not asked; else the alternatives asked for

    def keepalive(self) -> dict[str, Any]:
        """A silent stream's keep-alive: a chunk of no text (as for chat, ChatReply)."""
        return self.chunk("text_completion", now(), {"index": 0, "text": "", "logprobs": None,
                                                     "finish_reason": None})

    async def events(self, gen: Generation) -> AsyncIterator[dict[str, Any]]:
        created = now()
        top = self.logprobs
        offset = 0

        def chunk(text: str, finish: str | None,
                  logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
            return self.chunk("text_completion", created,
                              {"index": 0, "text": text, "logprobs": logprobs,
                               "finish_reason": finish})

        if self.prefix:
            yield chunk(self.prefix, None)
        async for delta in gen:
            if top is not None and delta.logprobs:
                yield chunk(delta.text, None, lp.openai_completion(delta.logprobs, top, offset))
                offset += len(delta.text)
            else:
                yield chunk(delta.text, None)
        yield chunk("", finish_reason(gen))
        if self.include_usage:
            yield {**self.envelope("text_completion", created, []), "usage": usage_json(gen)}

    def body(self, gen: Generation, parts: list[str]) -> dict[str, Any]:
        logprobs = (lp.openai_completion(gen.logprobs, self.logprobs, 0)
                    if self.logprobs is not None else None)
        return self.whole("text_completion", gen, {
            "index": 0, "text": self.prefix + "".join(parts), "logprobs": logprobs,
            "finish_reason": finish_reason(gen)})


class CompletionRoutes(DialectRoutes):
    async def completions(self, request: Request, req: CompletionRequest) -> Dispatch:
        check_common(req)
        top = _completion_logprobs(req)
        if req.prompt is None:
            raise invalid("'prompt' is a required property", param="prompt")
        prompts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
        if len(prompts) != 1:
            raise invalid("exactly one prompt per request is supported", param="prompt")
        model = self.requests.resolve(req.model, kind="llm")
        if req.suffix:
            require(await self.catalog.capabilities(model), INSERT, req.model, "suffix")
        params = msgspec.structs.replace(
            sampling_params(req, req.max_tokens if req.max_tokens is not None else 16, None),
            logprobs=top is not None)
        msg = await self.requests.generate(request, model, params, requested=req.model,
                                       prompt=prompts[0])
        reply = CompletionReply(req.model, wants_usage(req), prompts[0] if req.echo else "",
                                top)
        return Dispatch(model, msg, bool(req.stream), reply, keepalive=reply.keepalive)
