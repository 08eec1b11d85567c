"""OpenAI text completions: POST /v1/completions (one prompt, `suffix` for insert models,
`echo`, logprobs)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import msgspec
from starlette.requests import Request

from npu_proxy.gateway.api.dispatch import Dispatch
from npu_proxy.gateway.api.limits import check_token_ids
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
from npu_proxy.gateway.http.util import request_id, request_key
from npu_proxy.models.capabilities import INSERT
from npu_proxy.protocol.messages import Detokenize


class CompletionRequest(SamplingFields):
    # A text, a token-id list, or either in a list of one (checked in `_one_prompt`).
    prompt: str | list[Any] | None = None
    suffix: str | None = None
    echo: bool | None = False
    # The number of alternatives per token (0-5); absent: no logprobs.
    logprobs: int | None = None
    # vLLM: the prompt's tokens with their log-probabilities (the number of alternatives,
    # 0-20; the token itself is given, no alternatives exist here).
    prompt_logprobs: int | None = None


def _ids(value: Any) -> list[int] | None:
    if isinstance(value, list) and value and all(type(t) is int for t in value):
        return value
    return None


def _one_prompt(req: CompletionRequest) -> str | list[int]:
    """The request's one prompt: a text, or the model's token ids (OpenAI's forms: a string,
    a list of integers, or either in a list of one, as lm-evaluation-harness sends them)."""
    prompt = req.prompt
    if prompt is None:
        raise invalid("'prompt' is a required property", param="prompt")
    if isinstance(prompt, str):
        return prompt
    ids = _ids(prompt)
    if ids is not None:
        return ids
    if len(prompt) == 1:
        if isinstance(prompt[0], str):
            return str(prompt[0])
        ids = _ids(prompt[0])
        if ids is not None:
            return ids
    elif all(isinstance(p, str) or _ids(p) is not None for p in prompt):
        raise invalid("exactly one prompt per request is supported", param="prompt")
    raise invalid("'prompt' must be a string, a list of token ids (integers), or one of them "
                  "in a list", param="prompt")


def _completion_logprobs(req: CompletionRequest) -> int | None:
    if req.logprobs is None:
        return None
    return lp.top_count(req.logprobs, "logprobs", lp.MAX_COMPLETION_TOP)


def _scores_prompt(req: CompletionRequest, top: int | None) -> bool:
    """Whether the prompt's logprobs are asked (echo with logprobs, vLLM's
    prompt_logprobs), checked; with them, or with echo alone, max_tokens may be 0 (the
    prompt scored or echoed, nothing generated), as OpenAI's legacy completions allow."""
    if req.prompt_logprobs is not None:
        lp.top_count(req.prompt_logprobs, "prompt_logprobs")
        if req.stream:
            raise invalid("prompt_logprobs are not available when stream is true",
                          param="prompt_logprobs")
    scored = req.prompt_logprobs is not None or bool(req.echo and top is not None)
    if req.max_tokens == 0 and not (scored or req.echo):
        raise invalid("max_tokens must be at least 1 (0 only with echo)", param="max_tokens")
    return scored or bool(req.echo and req.max_tokens == 0)


class CompletionReply(Reply):
    def __init__(self, model: str, include_usage: bool, prefix: str | None,
                 logprobs: int | None = None, prompt_logprobs: bool = False) -> None:
        super().__init__("cmpl-", model, include_usage)
        self.prefix = prefix  # the prompt, echoed (None: not echoed)
        self.logprobs = logprobs  # None: not asked; else the alternatives asked for
        self.prompt_logprobs = prompt_logprobs  # vLLM's, asked

    def keepalive(self) -> dict[str, Any]:
        """A silent stream's keep-alive: a chunk of no text (as for chat, ChatReply)."""
        return self.chunk("text_completion", now(), {"index": 0, "text": "", "logprobs": None,
                                                     "finish_reason": None})

    def _echo_logprobs(self, gen: Generation) -> dict[str, Any] | None:
        """The echoed prompt's logprobs (the prompt's tokens, first null), when asked."""
        if self.logprobs is None:
            return None
        return lp.openai_completion(gen.prompt or [], self.logprobs, 0)

    async def events(self, gen: Generation) -> AsyncIterator[dict[str, Any]]:
        created = now()
        top = self.logprobs
        prefix = self.prefix
        offset = len(prefix or "")

        def chunk(text: str, finish: str | None,
                  logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
            return self.chunk("text_completion", created,
                              {"index": 0, "text": text, "logprobs": logprobs,
                               "finish_reason": finish})

        if prefix is not None and top is None:
            if prefix:
                yield chunk(prefix, None)
            prefix = None
        async for delta in gen:
            if prefix is not None:  # NOTE: with logprobs: once the prompt's have come
                yield chunk(prefix, None, self._echo_logprobs(gen))
                prefix = None
            if top is not None and delta.logprobs:
                yield chunk(delta.text, None, lp.openai_completion(delta.logprobs, top, offset))
                offset += len(delta.text)
            else:
                yield chunk(delta.text, None)
        if prefix is not None:
            yield chunk(prefix, None, self._echo_logprobs(gen))
        yield chunk("", finish_reason(gen))
        if self.include_usage:
            yield {**self.envelope("text_completion", created, []), "usage": usage_json(gen)}

    def body(self, gen: Generation, parts: list[str]) -> dict[str, Any]:
        logprobs = None
        if self.logprobs is not None:
            echoed = (gen.prompt or []) if self.prefix is not None else []
            logprobs = lp.openai_completion(echoed + gen.logprobs, self.logprobs, 0)
        choice: dict[str, Any] = {
            "index": 0, "text": (self.prefix or "") + "".join(parts), "logprobs": logprobs,
            "finish_reason": finish_reason(gen)}
        if self.prompt_logprobs:
            choice["prompt_logprobs"] = lp.vllm_prompt(gen.prompt or [], gen.prompt_ids)
        return self.whole("text_completion", gen, choice)


class CompletionRoutes(DialectRoutes):
    async def completions(self, request: Request, req: CompletionRequest) -> Dispatch:
        check_common(req)
        top = _completion_logprobs(req)
        prompt = _one_prompt(req)
        model = self.requests.resolve(req.model, kind="llm")
        text, ids = (prompt, None) if isinstance(prompt, str) else (None, prompt)
        sent = text
        if req.suffix:
            caps = await self.catalog.capabilities(model)
            require(caps, INSERT, req.model, "suffix")
            if text is None or caps.fim is None:
                raise invalid("'suffix' needs a text prompt", param="suffix")
            sent = caps.fim.prompt(text, req.suffix)
        if ids is not None:
            await check_token_ids(self.catalog, model, ids, "prompt")
        scored = _scores_prompt(req, top)
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        params = msgspec.structs.replace(
            sampling_params(req, max_tokens or None, None), max_tokens=max_tokens,
            logprobs=top is not None, prompt_logprobs=scored)
        msg = await self.requests.generate(request, model, params, requested=req.model,
                                           prompt=sent, prompt_ids=ids)
        echoed = None
        if req.echo:
            echoed = text if ids is None else (await self.requests.detokenize(
                request, model, Detokenize(id=request_key(request), model=model.name,
                                           tokens=ids, log_id=request_id(request)))).text
        reply = CompletionReply(req.model, wants_usage(req), echoed, top,
                                req.prompt_logprobs is not None)
        return Dispatch(model, msg, bool(req.stream), reply, keepalive=reply.keepalive)
