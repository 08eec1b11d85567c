"""OpenAI Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}.

Translates a request (`input` as a string or items, `instructions`, flat function `tools`,
`text.format`, `max_output_tokens`, `previous_response_id`) into the one chat request every
API makes (gateway/api/request_path.py `RequestPath.chat`); the answer is rendered by
gateway/api/responses/reply.py and kept, when `store` (default true), in the bounded memory
of gateway/api/responses/store.py. Errors are OpenAI's shape; the stream's named SSE events
are the RESPONSES dialect (gateway/http/wire.py).

Input items are read by gateway/api/responses/inputs.py. Tools: `function`, `custom` (free
text, one string argument for the model; calls come back as `custom_tool_call` items) and
`namespace` (its inner tools offered by their own names; calls name the namespace); hosted
tools (`web_search`, ...) are not offered and are named in the `X-NPU-Proxy-Ignored` header,
as is `reasoning.summary` (no summaries are written: `summary` is always []).
`include: ["reasoning.encrypted_content"]` gives reasoning items a blob the client replays
with `store: false` (gateway/api/responses/sealed.py). `prompt_cache_key`, `client_metadata`,
`safety_identifier`, `service_tier` and `strict` are accepted and change nothing. `background`,
`conversation` and prompt templates are refused with a 400 that says so (docs/api-fields.md).
"""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from npu_proxy.gateway.api.dispatch import Dispatch
from npu_proxy.gateway.api.request_path import DialectRoutes, GatewayError, RequestPath, invalid
from npu_proxy.gateway.api.responses.inputs import InputReader
from npu_proxy.gateway.api.responses.reply import ResponseReply
from npu_proxy.gateway.api.responses.sealed import Sealer
from npu_proxy.gateway.api.responses.store import ResponseStore
from npu_proxy.gateway.content.ignored import Ignored
from npu_proxy.gateway.content.params import json_schema_text, openai_params
from npu_proxy.gateway.content.reasoning import template_vars
from npu_proxy.gateway.content.tools import ToolRequest, responses_choice, responses_tools
from npu_proxy.protocol.messages import ChatMessage, SamplingParams

EFFORTS = (None, "none", "minimal", "low", "medium", "high", "xhigh")
SUMMARIES = (None, "auto", "concise", "detailed")


# --- request shapes ----------------------------------------------------------------------


class TextFormat(msgspec.Struct):
    type: str
    name: str = "response"
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class TextConfig(msgspec.Struct):
    format: TextFormat | None = None
    verbosity: str | None = None


class Reasoning(msgspec.Struct):
    effort: str | None = None
    summary: str | None = None


class ResponsesRequest(msgspec.Struct):
    model: str = ""
    input: str | list[dict[str, Any]] | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    reasoning: Reasoning | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    stream: bool | None = False
    truncation: str | None = None
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    include: list[str] | None = None
    # Accepted, changing nothing here (Codex sends them with every request).
    prompt_cache_key: str | None = None
    client_metadata: dict[str, Any] | None = None
    # Extensions some clients send (vLLM style).
    top_k: int | None = None
    seed: int | None = None


# --- translation -------------------------------------------------------------------------


def text_schema(text: TextConfig | None) -> str | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return json_schema_text(None)
    if fmt.type == "json_schema":
        if fmt.schema is None:
            raise invalid("text.format.schema is required for json_schema", param="text")
        return json_schema_text(fmt.schema)
    raise invalid(f"unknown text.format type '{fmt.type}'", param="text")


def reasoning(value: Reasoning | None) -> dict[str, Any]:
    """Checked and echoed. On a thinking model, effort "none" switches thinking off
    (enable_thinking), low/medium/high reach the template as reasoning_effort (gpt-oss)."""
    value = value or Reasoning()
    if value.effort not in EFFORTS:
        raise invalid(f"reasoning.effort must be one of {', '.join(map(str, EFFORTS[1:]))}",
                      param="reasoning")
    if value.summary not in SUMMARIES:
        raise invalid("reasoning.summary must be auto, concise or detailed", param="reasoning")
    return {"effort": value.effort, "summary": value.summary}


def sampling(req: ResponsesRequest) -> SamplingParams:
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise invalid("max_output_tokens must be at least 1", param="max_output_tokens")
    if req.top_logprobs:
        raise invalid("logprobs are not supported by this server", param="top_logprobs")
    return openai_params(max_tokens=req.max_output_tokens, temperature=req.temperature,
                         top_p=req.top_p, stop=None, seed=req.seed, presence_penalty=None,
                         frequency_penalty=None, top_k=req.top_k,
                         json_schema=text_schema(req.text))


def _refuse_unsupported(req: ResponsesRequest) -> None:
    if req.background:
        raise invalid("background responses are not supported by this server",
                      param="background")
    if req.conversation is not None:
        raise invalid("conversations are not supported by this server; continue a response "
                      "with previous_response_id", param="conversation")
    if req.prompt is not None:
        raise invalid("prompt templates are not supported by this server", param="prompt")
    if req.truncation not in (None, "auto", "disabled"):
        raise invalid("truncation must be auto or disabled", param="truncation")
    meta = req.metadata or {}
    if len(meta) > 16 or any(len(k) > 64 or len(v) > 512 for k, v in meta.items()):
        raise invalid("metadata takes at most 16 pairs, keys of at most 64 characters and "
                      "values of at most 512", param="metadata")


def _tool_echo(raw: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    out = []
    for i, item in enumerate(raw or []):
        if item.get("type") != "function":
            out.append(item)  # NOTE: namespace, custom and hosted tools are echoed as sent
            continue
        strict = item.get("strict", True)
        if not isinstance(strict, bool):
            raise invalid(f"tools[{i}].strict must be a boolean", param="tools")
        out.append({"type": "function", "name": item.get("name"),
                    "description": item.get("description"),
                    "parameters": item.get("parameters"), "strict": strict})
    return out


def _choice_echo(value: str | dict[str, Any] | None) -> str | dict[str, Any]:
    if isinstance(value, dict):
        return {"type": value.get("type"), "name": value.get("name")}
    return value or "auto"


def _text_echo(text: TextConfig | None) -> dict[str, Any]:
    fmt = text.format if text is not None else None
    verbosity = text.verbosity if text is not None else None
    if verbosity not in (None, "low", "medium", "high"):
        raise invalid("text.verbosity must be low, medium or high", param="text")
    echo: dict[str, Any] = {"format": {"type": fmt.type if fmt else "text"},
                            "verbosity": verbosity or "medium"}
    if fmt is not None and fmt.type == "json_schema":
        echo["format"] = {"type": fmt.type, "name": fmt.name, "schema": fmt.schema,
                          "strict": fmt.strict, "description": fmt.description}
    return echo


# --- routes ------------------------------------------------------------------------------


class ResponsesRoutes(DialectRoutes):
    def __init__(self, requests: RequestPath, store: ResponseStore) -> None:
        super().__init__(requests)
        self.store = store
        # NOTE: one secret per gateway run: reasoning handed out before a restart is not
        # read back (ignored visibly), which costs the model its earlier thoughts, no more.
        self.sealer = Sealer()

    def routes(self) -> list[Route]:
        return [
            self.requests.post("/v1/responses", ResponsesRequest, self.create),
            self.requests.get("/v1/responses/{response_id}", self.retrieve),
            self.requests.delete("/v1/responses/{response_id}", self.delete),
        ]

    def _not_found(self, response_id: str) -> GatewayError:
        return GatewayError(404, "not_found", f"Response with id '{response_id}' not found.")

    async def retrieve(self, request: Request) -> Response:
        response_id = request.path_params["response_id"]
        found = self.store.get(response_id)
        if found is None:
            raise self._not_found(response_id)
        return Response(found.body_json, media_type="application/json")

    async def delete(self, request: Request) -> Response:
        response_id = request.path_params["response_id"]
        if not self.store.delete(response_id):
            raise self._not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    async def create(self, request: Request, req: ResponsesRequest) -> Dispatch:
        _refuse_unsupported(req)
        items = req.input if isinstance(req.input, list) else []
        self.requests.limits.check_items(len(items), len(req.tools or []))
        history: list[ChatMessage] = []
        if req.previous_response_id is not None:
            prior = self.store.get(req.previous_response_id)
            if prior is None:
                raise GatewayError(404, "previous_response_not_found",
                                   f"Previous response with id '{req.previous_response_id}' "
                                   "not found.", param="previous_response_id")
            history = list(prior.history)
        model = self.requests.resolve(req.model, kind="llm")
        facts = await self.requests.facts(model)
        ignored = Ignored()
        reader = InputReader(facts.capabilities, req.model, self.requests.images(),
                             self.sealer, ignored)
        conversation = history + await reader.messages(req.input)
        if not conversation:
            raise invalid("input is required (a string or a non-empty list of items)",
                          param="input")
        params = sampling(req)
        tools = responses_tools(req.tools, self.requests.limits.tool_budget(), ignored)
        choice = responses_choice(req.tool_choice, bool(tools))
        if not tools and choice.mode == "required":
            raise invalid("tool_choice requires a call but no tools were given",
                          param="tool_choice")
        request_tools = ToolRequest(tools, choice, req.parallel_tool_calls is not False) \
            if tools else None
        if req.reasoning is not None and req.reasoning.summary is not None:
            ignored.add("reasoning.summary")
        sealed = "reasoning.encrypted_content" in (req.include or [])
        store = req.store is not False and self.store.enabled
        echo = {
            "model": req.model, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": reasoning(req.reasoning), "store": store,
            "temperature": req.temperature, "top_p": req.top_p,
            "text": _text_echo(req.text), "tool_choice": _choice_echo(req.tool_choice),
            "tools": _tool_echo(req.tools), "truncation": req.truncation or "disabled",
            "user": req.user, "metadata": req.metadata or {}, "background": False,
        }
        system = [ChatMessage(role="system", content=req.instructions)] \
            if req.instructions else []
        effort = req.reasoning.effort if req.reasoning is not None else None
        # NOTE: clients send reasoning.effort to any model; it is never a 400 here.
        want = False if effort == "none" else None
        thinking = self.requests.thinking(facts, want, req.model, None)
        variables = template_vars(want, effort if effort in ("low", "medium", "high") else None
                                  ) if thinking is not None else None
        msg, parser = await self.requests.chat(request, facts, system + conversation,
                                           request_tools, params, requested=req.model,
                                           template_vars=variables)
        msg.truncate = req.truncation == "auto"  # oldest input items go first (worker)
        reply = ResponseReply(echo, parser, self.store if store else None, conversation,
                              thinking, self.sealer if sealed else None)
        return Dispatch(model, msg, bool(req.stream), reply, ignored=ignored,
                        keepalive=reply.keepalive)
