"""A request's model facts are looked up once (issue 45): an OpenAI chat with tools,
translated by the gateway's own routes in this process (no worker: the Dispatch it makes is
not sent), asks the catalog for the model's capabilities once, and the Anthropic, Responses
and Ollama chats likewise."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
from starlette.requests import Request

from npu_proxy.gateway.api.anthropic import AnthropicRoutes, MessagesRequest
from npu_proxy.gateway.api.dispatch import Dispatch
from npu_proxy.gateway.api.ollama.chat import ChatRequest as OllamaChat
from npu_proxy.gateway.api.ollama.routes import OllamaRoutes
from npu_proxy.gateway.api.openai.chat import ChatRequest
from npu_proxy.gateway.api.openai.routes import OpenAIRoutes
from npu_proxy.gateway.api.responses.routes import ResponsesRequest, ResponsesRoutes
from npu_proxy.gateway.app import Gateway
from npu_proxy.gateway.core.catalog import ModelCatalog
from npu_proxy.protocol.config import load_config

LLM = "smollm2:135m"
TOOL = {"type": "function", "function": {"name": "read", "description": "Read a file",
                                         "parameters": {"type": "object", "properties": {
                                             "path": {"type": "string"}},
                                             "required": ["path"]}}}
ANTHROPIC_TOOL = {"name": "read", "description": "Read a file", "input_schema": {
    "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}
RESPONSES_TOOL = {"type": "function", "name": "read", "description": "Read a file",
                  "parameters": TOOL["function"]["parameters"]}  # type: ignore[index]
HI = [{"role": "user", "content": "Read a.txt"}]


@pytest.fixture
def gateway(tmp_path: Path) -> Gateway:
    config = tmp_path / "npu-proxy.toml"
    config.write_text(f'runtime_dir = "{tmp_path / "rt"}"\nmodel_cache = "{tmp_path / "c"}"\n')
    return Gateway(load_config(config, env={}))


@pytest.fixture
def lookups(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Each capabilities lookup, by model name."""
    seen: list[str] = []
    real = ModelCatalog.capabilities

    async def counted(self: ModelCatalog, model: Any) -> Any:
        seen.append(model.name)
        return await real(self, model)

    monkeypatch.setattr(ModelCatalog, "capabilities", counted)
    return seen


def _request(path: str) -> Request:
    return Request({"type": "http", "method": "POST", "path": path, "headers": [],
                    "query_string": b""})


def _translate(call: Callable[[Request, Any], Awaitable[Any]], path: str, kind: type,
               body: dict[str, Any]) -> Any:
    """The route's translation of `body`, decoded as the server decodes it."""
    return asyncio.run(call(_request(path), msgspec.json.decode(json.dumps(body), type=kind)))


@pytest.mark.parametrize("api", ["openai", "anthropic", "responses", "ollama"])
def test_a_chat_with_tools_looks_its_model_up_once(gateway: Gateway, lookups: list[str],
                                                   api: str) -> None:
    requests = gateway.requests
    if api == "openai":
        made = _translate(OpenAIRoutes(requests).chat, "/v1/chat/completions", ChatRequest,
                          {"model": LLM, "messages": HI, "tools": [TOOL]})
    elif api == "anthropic":
        made = _translate(AnthropicRoutes(requests).messages, "/v1/messages", MessagesRequest,
                          {"model": LLM, "messages": HI, "max_tokens": 8,
                           "tools": [ANTHROPIC_TOOL]})
    elif api == "responses":
        made = _translate(ResponsesRoutes(requests, gateway.responses).create,
                          "/v1/responses", ResponsesRequest,
                          {"model": LLM, "input": "Read a.txt", "tools": [RESPONSES_TOOL]})
    else:
        made = _translate(OllamaRoutes(requests, gateway.catalog).chat, "/api/chat",
                          OllamaChat, {"model": LLM, "messages": HI, "tools": [TOOL]})
    assert isinstance(made, Dispatch)
    assert made.msg.tools or made.msg.messages[0].role == "system"  # the tools were placed
    assert lookups == [LLM]


# --- sampling parameters: one merge order -----------------------------------------------------


def _params(gateway: Gateway, api: str, extra: dict[str, Any]) -> Any:
    requests = gateway.requests
    if api == "ollama":
        made = _translate(OllamaRoutes(requests, gateway.catalog).chat, "/api/chat",
                          OllamaChat, {"model": LLM, "messages": HI, **extra})
    else:
        made = _translate(OpenAIRoutes(requests).chat, "/v1/chat/completions", ChatRequest,
                          {"model": LLM, "messages": HI, **extra})
    return made.msg.params


def test_the_models_own_defaults_come_before_the_apis(gateway: Gateway) -> None:
    """request > created model > the model's own (SmolLM2's temperature 0.2, top_p 0.9, as
    Ollama's library sets them) > the API's (Ollama's temperature 0.8, top_k 40, top_p 0.9;
    on the others the GGUF's, llama.cpp's top_k 40, min_p 0.05): Ollama's 0.8 used to win
    over the model's own 0.2 (the worker applied it last)."""
    ollama = _params(gateway, "ollama", {})
    assert (ollama.temperature, ollama.top_p, ollama.top_k, ollama.min_p) == (0.2, 0.9, 40, None)
    openai = _params(gateway, "openai", {})
    assert (openai.temperature, openai.top_p, openai.top_k, openai.min_p) == (0.2, 0.9, 40, 0.05)
    asked = _params(gateway, "ollama", {"options": {"temperature": 0.5,
                                                    "frequency_penalty": 0.3}})
    assert (asked.temperature, asked.frequency_penalty) == (0.5, 0.3)
    asked = _params(gateway, "openai", {"temperature": 0, "frequency_penalty": 0.3})
    assert (asked.temperature, asked.frequency_penalty) == (0, 0.3)
