"""What /api/generate and /api/chat check and map alike: the request fields they share,
`format`, options, `think`, keep_alive, and the answers to load and unload requests."""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.responses import Response

from npu_proxy.gateway.api.dispatch import Dispatch
from npu_proxy.gateway.api.ollama.reply import OllamaReply, chunk
from npu_proxy.gateway.api.request_path import (
    DialectRoutes,
    ModelFacts,
    ServedModel,
    invalid,
    parse_keep_alive,
)
from npu_proxy.gateway.content import logprobs as lp
from npu_proxy.gateway.content.params import json_schema_text, ollama_params
from npu_proxy.gateway.content.reasoning import Thinking, template_vars
from npu_proxy.gateway.http.util import dumps
from npu_proxy.protocol.messages import Generate, SamplingParams

EFFORTS = ("low", "medium", "high")


class TurnRequest(msgspec.Struct):
    model: str = ""
    format: str | dict[str, Any] | None = None
    options: dict[str, Any] | None = None
    stream: bool | None = None
    keep_alive: float | str | None = None
    think: bool | str | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


def format_schema(fmt: str | dict[str, Any] | None) -> str | None:
    """`format`: "" or absent = free text, "json" = any JSON object, an object = its schema."""
    if fmt is None or fmt == "":
        return None
    if fmt == "json":
        return json_schema_text(None)
    if isinstance(fmt, dict):
        return json_schema_text(fmt)
    raise invalid(f"format must be \"json\" or a JSON schema object, not {fmt!r}",
                  param="format")


def logprobs_top(req: TurnRequest) -> int | None:
    """None without logprobs, else the number of alternatives asked for (checked)."""
    top = lp.top_count(req.top_logprobs, "top_logprobs")
    return top if req.logprobs else None


class TurnRoutes(DialectRoutes):
    async def _common(self, req: TurnRequest,
                      ) -> tuple[ModelFacts, float, SamplingParams]:
        """What /api/generate and /api/chat check and map alike: model, keep_alive, options,
        think; and the model's capabilities for the rest."""
        model = self.requests.resolve(req.model, kind="llm")
        keep = parse_keep_alive(req.keep_alive)
        params = msgspec.structs.replace(ollama_params(req.options, format_schema(req.format)),
                                         logprobs=logprobs_top(req) is not None)
        return await self.requests.facts(model), keep, params

    def _thinking(self, facts: ModelFacts, req: TurnRequest,
                  ) -> tuple[Thinking | None, dict[str, Any] | None]:
        """`think`: true, false or an effort (low, medium, high: gpt-oss's reasoning_effort);
        absent, the model's default (a thinking model thinks). Asked of a model that does not
        think, a 400; false also switches it off in a template that can (enable_thinking)."""
        think = req.think
        if isinstance(think, str) and think not in ("", *EFFORTS):
            raise invalid(f"think must be true, false or one of {', '.join(EFFORTS)}, not "
                          f"{think!r}", param="think")
        want = None if think in (None, "") else think is not False
        thinking = self.requests.thinking(facts, want, req.model, "think")
        if thinking is None:
            return None, None
        effort = think if isinstance(think, str) and think else None
        return thinking, template_vars(want, effort)

    def _load(self, model: ServedModel, name: str, keep: float, chat: bool) -> Response:
        """An empty prompt loads the model, and with keep_alive 0 unloads it; workers load
        their model at start and keep it, so both are answered at once."""
        self.requests.keep(model, keep)
        body = chunk(name, "", chat)
        body["done"] = True
        body["done_reason"] = "unload" if keep == 0 else "load"
        return Response(dumps(body), media_type="application/json")

    def _turn(self, model: ServedModel, req: TurnRequest, msg: Generate,
              keep: float, reply: OllamaReply) -> Dispatch:
        """keep_alive counts from the request's start, and again from its end."""
        self.requests.keep(model, keep)
        return Dispatch(model, msg, req.stream is not False, reply,
                        ended=lambda: self.requests.keep(model, keep))
