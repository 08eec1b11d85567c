"""Ollama's /api/chat: messages (with images and earlier tool calls) in the internal form,
tools offered (`options.tool_choice` forces a call), `truncate`."""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from npu_proxy.gateway.api.dispatch import Dispatch
from npu_proxy.gateway.api.ollama.reply import OllamaReply
from npu_proxy.gateway.api.ollama.turn import TurnRequest, TurnRoutes, logprobs_top
from npu_proxy.gateway.api.request_path import invalid, require
from npu_proxy.gateway.content.images import Images
from npu_proxy.gateway.content.tools import (
    ToolBudget,
    ToolRequest,
    history_call,
    ollama_choice,
    openai_tools,
)
from npu_proxy.models.capabilities import VISION, Capabilities
from npu_proxy.protocol.messages import ChatMessage

ROLES = ("system", "user", "assistant", "tool")


class Message(msgspec.Struct):
    role: str
    content: str | None = None
    images: list[str] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_name: str | None = None
    thinking: str | None = None


class ChatRequest(TurnRequest):
    messages: list[Message] | None = None
    tools: list[dict[str, Any]] | None = None
    # Ollama's: a history longer than the context loses its oldest messages (default), or is
    # a 400 (false). `shift` (Ollama slides the context while generating) is accepted: here
    # the reply is given room when the history is cut, and ends with "length" at the end.
    truncate: bool | None = None
    shift: bool | None = None


async def chat_messages(messages: list[Message], caps: Capabilities, requested: str,
                  images: Images) -> list[ChatMessage]:
    """The chat in the internal form; what the model cannot take (`caps`) is a 400."""
    out = []
    for i, m in enumerate(messages):
        if m.role not in ROLES:
            raise invalid(f"unknown message role '{m.role}' (use system, user, assistant or "
                          "tool)", param="messages")
        found: list[bytes] = []
        if m.images:
            require(caps, VISION, requested, "images")
            found = [await images.base64(text, f"messages[{i}].images[{j}]", "images")
                     for j, text in enumerate(m.images)]
        calls = None
        if m.tool_calls:
            calls = [history_call(c.get("id"), (c.get("function") or {}).get("name", ""),
                                  (c.get("function") or {}).get("arguments"))
                     for c in m.tool_calls]
        out.append(ChatMessage(role=m.role, content=m.content or "", name=m.tool_name,
                               tool_calls=calls, images=found))
    return out


def tool_request(req: ChatRequest, budget: ToolBudget) -> ToolRequest | None:
    """Ollama has no tool_choice: tools mean "auto", unless the `options.tool_choice`
    extension forces a call (see gateway/content/tools/)."""
    choice = (req.options or {}).get("tool_choice")
    if not req.tools:
        return None
    return ToolRequest(openai_tools(req.tools, budget), ollama_choice(choice, True))


class OllamaChatRoutes(TurnRoutes):
    async def chat(self, request: Request, req: ChatRequest) -> Response | Dispatch:
        facts, keep, params = await self._common(req)
        model = facts.model
        thinking, variables = self._thinking(facts, req)
        if not req.messages:
            return self._load(model, req.model, keep, chat=True)
        msg, parser = await self.requests.chat(request, facts,
                                           await chat_messages(req.messages, facts.capabilities,
                                                               req.model, self.requests.images()),
                                           tool_request(req, self.requests.limits.tool_budget()),
                                           params, requested=req.model,
                                           template_vars=variables)
        msg.truncate = req.truncate is not False
        return self._turn(model, req, msg, keep,
                          OllamaReply(req.model, True, parser, logprobs_top(req), thinking))

    # --- shared by generate and chat -----------------------------------------------------
