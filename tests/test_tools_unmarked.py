"""Tool calls under tool_choice auto for a model whose chat template writes calls as bare JSON
(Llama 3.x: `{"name": ..., "parameters": {...}}`, no `<tool_call>` markers): once the model
writes `{"name"`, the rest of the call is held to one offered tool's name and schema (issue
42, point 2; SamplingParams.tool_tags with one tag per tool).

A private server serves SmolLM2-135M under a Llama-3-like template of our own. As in
test_tools_auto.py, a history of calls makes the greedy model begin one, and the schema (an
integer enum, a patterned string) is one the 135M model does not meet on its own; only what
the grammar forces is asserted.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from serverctl import Server
from toolcalls import LEVEL_SCHEMA, chat_calls

from npu_proxy.gateway.content.tools import Tool, ToolChoice, ToolRequest
from npu_proxy.gateway.content.tools.prompting import BARE_CALL, auto_tags
from npu_proxy.models.locate import locate

LLM = "smollm2:135m"
BARE = "llama-style:135m"
# The same, under a template that also names `<tool_call>` markers (as Qwen2.5's does): a
# bare call is held to the schema all the same (Qwen2.5-Coder wrote one under Codex CLI).
MARKED = "marked-style:135m"
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou can call these functions:\n"
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    'To call one, respond with {"name": function name, "parameters": dictionary of argument '
    "name and its value}.<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "set_level", "description": "Set the level",
                                      "parameters": LEVEL_SCHEMA}},
    {"type": "function", "function": {"name": "get_time", "description": "The time now",
                                      "parameters": {"type": "object", "properties": {}}}},
]
MARKED_TEMPLATE = TEMPLATE.replace("dictionary of argument name and its value}.",
                                   "dictionary of argument name and its value}, or put "
                                   "it between <tool_call> and </tool_call>.")
EARLIER = '{"name": "set_level", "parameters": {}}'
CALLING: list[dict[str, Any]] = [
    {"role": "user", "content": "Set the level to high."},
    {"role": "assistant", "content": EARLIER},
    {"role": "user", "content": "Set the level to low."},
    {"role": "assistant", "content": EARLIER},
    {"role": "user", "content": "Set the level to 5, code abc."},
]


@pytest.fixture(scope="module")
def bare(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("tools-unmarked")
    gguf = locate(Server(tmp / "probe").config, LLM).path
    srv = Server(tmp, workers=[{"name": "llm", "role": "llm", "model": BARE},
                               {"name": "marked", "role": "llm", "model": MARKED}],
                 models={BARE: {"path": str(gguf), "chat_template": TEMPLATE},
                         MARKED: {"path": str(gguf), "chat_template": MARKED_TEMPLATE}}).start()
    yield srv.url
    srv.stop()


def test_a_template_without_markers_gets_one_tag_per_tool() -> None:
    tools = [Tool("a", "", {"type": "object", "properties": {"x": {"type": "integer"}}}),
             Tool('b"q', "", {"type": "object", "properties": {}})]
    tags = auto_tags(ToolRequest(tools, ToolChoice("auto")), True, TEMPLATE)
    assert tags is not None and tags.triggers == (BARE_CALL,)
    assert [t.begin for t in tags.tags] == ['{"name": "a", "parameters": ',
                                            '{"name": "b\\"q", "parameters": ']
    assert all(t.begin.startswith(BARE_CALL) and t.end == "}" and not t.padded
               for t in tags.tags)
    assert json.loads(tags.tags[0].schema) == tools[0].parameters
    # A template that names the key "arguments", or has none, gets "arguments".
    other = auto_tags(ToolRequest(tools, ToolChoice("auto")), True, "{{ tools }}")
    assert other is not None and other.tags[0].begin == '{"name": "a", "arguments": '
    # Markers in the template: one tag between them, whatever the tool, and bare JSON too
    # (Qwen2.5-Coder wrote fenced calls under Codex CLI).
    marked = auto_tags(ToolRequest(tools, ToolChoice("auto")), True,
                       "{{ tools }}<tool_call></tool_call>")
    assert marked is not None and marked.triggers == ("<tool_call>", BARE_CALL)
    assert [(t.begin, t.end, t.padded) for t in marked.tags] == [
        ("<tool_call>", "</tool_call>", True), ('{"name": "a", "arguments": ', "}", False),
        ('{"name": "b\\"q", "arguments": ', "}", False)]
    assert auto_tags(ToolRequest(tools, ToolChoice("required")), True, TEMPLATE) is None


@pytest.mark.parametrize(("model", "stream"), [(BARE, False), (BARE, True), (MARKED, False),
                                               (MARKED, True)])
def test_a_bare_call_is_held_to_the_tool_schema(bare: str, model: str, stream: bool) -> None:
    oai = openai.OpenAI(base_url=bare + "/v1", api_key="x", max_retries=0)
    kwargs: dict[str, Any] = {"model": model, "messages": CALLING, "tools": TOOLS,
                              "temperature": 0, "max_tokens": 80}
    names, args = chat_calls(oai, kwargs, stream)
    assert names == ["set_level"]
    jsonschema.validate(json.loads(args), LEVEL_SCHEMA)


def test_on_ollama_too(bare: str) -> None:
    body = {"model": BARE, "messages": CALLING, "stream": False, "tools": TOOLS,
            "options": {"temperature": 0, "num_predict": 80}}
    reply = httpx.post(bare + "/api/chat", json=body, timeout=120).json()
    calls = reply["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["set_level"]
    jsonschema.validate(calls[0]["function"]["arguments"], LEVEL_SCHEMA)
