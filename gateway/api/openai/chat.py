"""OpenAI chat: POST /v1/chat/completions; `image_url` parts become `ChatMessage.images`,
tools, logprobs, response formats and regexes, a thinking model's reasoning."""

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
from npu_proxy.gateway.content.images import Images
from npu_proxy.gateway.content.params import json_schema_text
from npu_proxy.gateway.content.reasoning import Thinking, pieces, split_parts, template_vars
from npu_proxy.gateway.content.tools import (
    CallParser,
    ToolBudget,
    ToolCall,
    ToolRequest,
    fragments,
    history_call,
    openai_choice,
    openai_tools,
    split_calls,
)
from npu_proxy.models.capabilities import VISION, Capabilities
from npu_proxy.protocol.messages import ChatMessage


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None
    image_url: Any = None


class Message(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class JsonSchemaSpec(msgspec.Struct):
    name: str = "response"
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct):
    type: str
    json_schema: JsonSchemaSpec | None = None


class StructuredOutputs(msgspec.Struct):
    regex: str | None = None


class ChatRequest(SamplingFields):
    messages: list[Message] = []
    max_completion_tokens: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    # vLLM: the prompt's tokens (the chat template's included) with their log-probabilities
    # (0-20 alternatives asked; the token itself is given, no alternatives exist here).
    prompt_logprobs: int | None = None
    # vLLM's extensions: the chat template's extra variables (enable_thinking...), and
    # structured output by a regex (`structured_outputs.regex`, formerly `guided_regex`).
    chat_template_kwargs: dict[str, Any] | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_regex: str | None = None
    reasoning_effort: str | None = None


# --- translation -------------------------------------------------------------------------


async def _content(content: str | list[ContentPart] | None, caps: Capabilities,
                   requested: str, images: Images, where: str) -> tuple[str, list[bytes]]:
    """A message's text and images. Parts of a type other than text and image are skipped."""
    if content is None or isinstance(content, str):
        return content or "", []
    parts: list[str] = []
    found: list[bytes] = []
    for j, part in enumerate(content):
        if part.type == "text":
            parts.append(part.text or "")
        elif part.type in ("image_url", "input_image", "image"):
            require(caps, VISION, requested, "messages")
            found.append(await images.url(_image_url(part.image_url),
                                          f"{where}.content[{j}].image_url", "messages"))
    return "".join(parts), found


def _image_url(value: Any) -> Any:
    """`image_url` as a string or as `{url, detail}` (detail is left to the model)."""
    return value.get("url") if isinstance(value, dict) else value


async def chat_messages(messages: list[Message], caps: Capabilities, requested: str,
                        images: Images) -> list[ChatMessage]:
    """The chat in the internal form; what the model cannot take (`caps`) is a 400."""
    if not messages:
        raise invalid("messages must be a non-empty list", param="messages")
    out = []
    for i, m in enumerate(messages):
        role = "system" if m.role == "developer" else m.role
        if role not in ("system", "user", "assistant", "tool", "function"):
            raise invalid(f"unknown message role '{m.role}'", param="messages")
        calls = None
        if role == "assistant" and m.tool_calls:
            calls = [_history_call(c) for c in m.tool_calls]
        text, found = await _content(m.content, caps, requested, images, f"messages[{i}]")
        out.append(ChatMessage(role=role, content=text, name=m.name,
                               tool_call_id=m.tool_call_id, tool_calls=calls, images=found))
    return out


def _history_call(call: dict[str, Any]) -> dict[str, Any]:
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise invalid("each tool_calls entry needs function.name", param="messages")
    return history_call(call.get("id"), fn["name"], fn.get("arguments"))


def tool_request(req: ChatRequest, budget: ToolBudget) -> ToolRequest | None:
    if not req.tools:
        if req.tool_choice not in (None, "none", "auto"):
            raise invalid("tool_choice needs tools", param="tool_choice")
        return None
    tools = openai_tools(req.tools, budget)
    return ToolRequest(tools, openai_choice(req.tool_choice, bool(tools)),
                       req.parallel_tool_calls is not False)


def tool_calls_json(calls: list[ToolCall]) -> list[dict[str, Any]]:
    return [{"id": c.id, "type": "function",
             "function": {"name": c.name, "arguments": c.arguments_json()}} for c in calls]


def _chat_logprobs(req: ChatRequest) -> int | None:
    """None without logprobs, else the number of alternatives asked for."""
    top = lp.top_count(req.top_logprobs, "top_logprobs")
    if not req.logprobs:
        if top:
            raise invalid("top_logprobs needs logprobs set to true", param="top_logprobs")
        return None
    return top


def _prompt_logprobs(req: ChatRequest) -> bool:
    """Whether vLLM's prompt_logprobs are asked (not with stream, as vLLM)."""
    if req.prompt_logprobs is None:
        return False
    lp.top_count(req.prompt_logprobs, "prompt_logprobs")
    if req.stream:
        raise invalid("prompt_logprobs are not available when stream is true",
                      param="prompt_logprobs")
    return True


def _response_schema(fmt: ResponseFormat | None) -> str | None:
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return json_schema_text(None)
    if fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema is None:
            raise invalid("response_format.json_schema.schema is required",
                          param="response_format")
        return json_schema_text(fmt.json_schema.schema)
    raise invalid(f"unknown response_format type '{fmt.type}'", param="response_format")


def _regex(req: ChatRequest) -> str | None:
    regex = req.structured_outputs.regex if req.structured_outputs is not None else None
    regex = regex if regex is not None else req.guided_regex
    if regex is not None and req.response_format is not None and \
            req.response_format.type != "text":
        raise invalid("give either a regex or a response_format, not both",
                      param="structured_outputs")
    return regex


def _enable_thinking(req: ChatRequest) -> bool | None:
    value = (req.chat_template_kwargs or {}).get("enable_thinking")
    return value if isinstance(value, bool) else None


def _reasoning(text: str) -> dict[str, str]:
    """A thinking model's reasoning: vLLM's `reasoning_content` and its newer `reasoning`."""
    return {"reasoning_content": text, "reasoning": text}


class ChatReply(Reply):
    """With tools offered, text that may be a call is held back by the parser and the calls
    go out at the end: per call a first delta with id, type and name and empty arguments, then
    deltas with only the index and argument fragments."""

    def __init__(self, model: str, include_usage: bool, parser: CallParser | None,
                 named: bool, logprobs: int | None = None,
                 thinking: Thinking | None = None, prompt_logprobs: bool = False) -> None:
        super().__init__("chatcmpl-", model, include_usage)
        self.parser = parser
        self.named = named
        self.logprobs = logprobs  # None: not asked; else top_logprobs
        self.thinking = thinking
        self.prompt_logprobs = prompt_logprobs  # vLLM's, asked

    def keepalive(self) -> dict[str, Any]:
        """A silent stream's keep-alive (a long prefill, a call held back until it parses):
        a chunk whose delta adds nothing. Qwen Code's stream idle timer (240 s) counts only a
        chunk its SDK parsed (it skips SSE comments); OpenCode, Continue and the SDKs take it
        as the empty delta it is (tests/fixtures/keepalive.json)."""
        return self.chunk("chat.completion.chunk", now(), {
            "index": 0, "delta": {"content": ""}, "logprobs": None, "finish_reason": None})

    async def events(self, gen: Generation) -> AsyncIterator[dict[str, Any]]:
        created = now()
        parser = self.parser

        top = self.logprobs

        def chunk(delta: dict[str, Any], finish: str | None,
                  logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
            return self.chunk("chat.completion.chunk", created,
                              {"index": 0, "delta": delta, "logprobs": logprobs,
                               "finish_reason": finish})

        yield chunk({"role": "assistant", "content": ""}, None)
        calls: list[ToolCall] = []
        async for delta, thought, answer in pieces(gen, self.thinking):
            if thought:
                yield chunk(_reasoning(thought), None)
            text = parser.feed(answer) if parser is not None else answer
            if top is not None and delta is not None and delta.logprobs:
                # NOTE: with tools, the parser may hold text back; the tokens go out as they
                # come (they are the model's raw output).
                yield chunk({"content": text}, None, lp.openai_chat(delta.logprobs, top))
            elif text:
                yield chunk({"content": text}, None)
        if parser is not None:
            rest, calls = parser.finish(gen.cut)
            if rest and not (calls and rest.isspace()):
                yield chunk({"content": rest}, None)
        for index, call in enumerate(calls):
            yield chunk({"tool_calls": [{"index": index, "id": call.id, "type": "function",
                                         "function": {"name": call.name, "arguments": ""}}]},
                        None)
            for piece in fragments(call.arguments_json()):
                yield chunk({"tool_calls": [{"index": index,
                                             "function": {"arguments": piece}}]}, None)
        yield chunk({}, finish_reason(gen, bool(calls), self.named))
        if self.include_usage:
            yield {**self.envelope("chat.completion.chunk", created, []), "usage": usage_json(gen)}

    def body(self, gen: Generation, parts: list[str]) -> dict[str, Any]:
        thought, answer = split_parts(parts, self.thinking)
        text, calls = split_calls(answer, self.parser, gen.cut)
        message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
        if thought:
            message.update(_reasoning(thought))
        if calls:
            message["content"] = text or None
            message["tool_calls"] = tool_calls_json(calls)
        body = self.whole("chat.completion", gen, {
            "index": 0,
            "message": message,
            "logprobs": (lp.openai_chat(gen.logprobs, self.logprobs)
                         if self.logprobs is not None else None),
            "finish_reason": finish_reason(gen, bool(calls), self.named),
        })
        if self.prompt_logprobs:  # NOTE: vLLM puts them beside the choices
            body["prompt_logprobs"] = lp.vllm_prompt(gen.prompt or [], gen.prompt_ids)
        return body


class OpenAIChatRoutes(DialectRoutes):
    async def chat(self, request: Request, req: ChatRequest) -> Dispatch:
        if not req.messages:
            raise invalid("'messages' is a required property and must be non-empty",
                          param="messages")
        self.requests.limits.check_counts(len(req.messages), len(req.tools or ()))
        check_common(req)
        top = _chat_logprobs(req)
        model = self.requests.resolve(req.model, kind="llm")
        max_tokens = req.max_tokens
        if req.max_completion_tokens is not None:  # NOTE: OpenAI's newer name wins; 0 is a value
            if req.max_completion_tokens < 1:
                raise invalid("max_completion_tokens must be at least 1",
                              param="max_completion_tokens")
            max_tokens = req.max_completion_tokens
        scored = _prompt_logprobs(req)
        params = msgspec.structs.replace(
            sampling_params(req, max_tokens, _response_schema(req.response_format)),
            logprobs=top is not None, regex=_regex(req), prompt_logprobs=scored)
        tools = tool_request(req, self.requests.limits.tool_budget())
        facts = await self.requests.facts(model)
        messages = await chat_messages(req.messages, facts.capabilities, req.model,
                                       self.requests.images())
        thinking = self.requests.thinking(facts, _enable_thinking(req), req.model,
                                          "chat_template_kwargs")
        effort = req.reasoning_effort if thinking is not None else None
        msg, parser = await self.requests.chat(request, facts, messages, tools, params,
                                           requested=req.model,
                                           template_vars=template_vars(None, effort,
                                                                       req.chat_template_kwargs))
        reply = ChatReply(req.model, wants_usage(req), parser,
                          tools is not None and tools.named, top, thinking, scored)
        return Dispatch(model, msg, bool(req.stream), reply, keepalive=reply.keepalive)
