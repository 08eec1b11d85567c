"""Tool calls under tool_choice auto, against the real server and SmolLM2-135M: the model may
answer in text, but a call it begins (its template's `<tool_call>` marker) is held to the
offered tools' schemas until the closing marker (SamplingParams.tool_tags, GenAI's triggered
structural tags).

Only what the grammar forces is asserted: that a call, once begun, names an offered tool and
has arguments that validate. A history where the assistant answered with calls makes the
greedy model begin one; the schema (an integer enum, a patterned string) is one the 135M
model does not meet on its own (measured: it wrote the schema's keywords as arguments).
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest
from toolcalls import LEVEL_SCHEMA, chat_calls

from npu_proxy.gateway.content.tools import Tool, ToolChoice, ToolRequest
from npu_proxy.gateway.content.tools.forcing import auto_call_schema

LLM = "smollm2:135m"
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "set_level", "description": "Set the level",
                                      "parameters": LEVEL_SCHEMA}},
]
EARLIER = '<tool_call>\n{"name": "set_level", "arguments": {}}\n</tool_call>'
# Two earlier turns answered by a call: the greedy model begins one for the third.
CALLING: list[dict[str, Any]] = [
    {"role": "user", "content": "Set the level to high."},
    {"role": "assistant", "content": EARLIER},
    {"role": "user", "content": "Set the level to low."},
    {"role": "assistant", "content": EARLIER},
    {"role": "user", "content": "Set the level to 5, code abc."},
]


@pytest.fixture(scope="module")
def oai(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0,
                         _strict_response_validation=True)


def test_auto_schema_is_one_call_of_any_offered_tool() -> None:
    tools = [Tool("a", "", {"type": "object", "properties": {"x": {"type": "integer"}}}),
             Tool("b", "", {"type": "object", "properties": {}})]
    schema = json.loads(auto_call_schema(ToolRequest(tools, ToolChoice("auto"))) or "")
    jsonschema.validate({"name": "a", "arguments": {"x": 1}}, schema)
    jsonschema.validate({"name": "b", "arguments": {}}, schema)
    for wrong in ({"name": "c", "arguments": {}}, {"name": "a", "arguments": {"x": "1"}},
                  [{"name": "b", "arguments": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)
    assert auto_call_schema(ToolRequest(tools, ToolChoice("none"))) is None
    assert auto_call_schema(ToolRequest(tools, ToolChoice("required"))) is None


@pytest.mark.parametrize("stream", [False, True])
def test_a_begun_call_is_held_to_the_schema(oai: openai.OpenAI, stream: bool) -> None:
    kwargs: dict[str, Any] = {"model": LLM, "messages": CALLING, "tools": TOOLS,
                              "temperature": 0, "max_tokens": 80}
    names, args = chat_calls(oai, kwargs, stream)
    assert names == ["set_level"]
    jsonschema.validate(json.loads(args), LEVEL_SCHEMA)


def test_on_ollama_too(base_url: str) -> None:
    body = {"model": LLM, "messages": CALLING, "stream": False,
            "options": {"temperature": 0, "num_predict": 80},
            "tools": TOOLS}
    reply = httpx.post(base_url + "/api/chat", json=body, timeout=120).json()
    calls = reply["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["set_level"]
    jsonschema.validate(calls[0]["function"]["arguments"], LEVEL_SCHEMA)


def test_on_anthropic_with_one_call_at_most(base_url: str) -> None:
    """`disable_parallel_tool_use`: the output ends after the one call (ToolTags.single)."""
    claude = anthropic.Anthropic(base_url=base_url, api_key="x", max_retries=0)
    reply = claude.messages.create(
        model=LLM, max_tokens=80, extra_body={"temperature": 0},
        messages=CALLING,  # type: ignore[arg-type]
        tools=[{"name": "set_level", "description": "Set the level",
                "input_schema": LEVEL_SCHEMA}],
        tool_choice={"type": "auto", "disable_parallel_tool_use": True})
    uses = [b for b in reply.content if b.type == "tool_use"]
    assert reply.stop_reason == "tool_use" and [b.name for b in uses] == ["set_level"]
    jsonschema.validate(uses[0].input, LEVEL_SCHEMA)


def test_text_stays_text(oai: openai.OpenAI) -> None:
    """Tools offered, a question the greedy model answers in words: the constraint waits for a
    marker that never comes, and forces no call."""
    reply = oai.chat.completions.create(
        model=LLM, tools=TOOLS, temperature=0, max_tokens=24,
        messages=[{"role": "user", "content": "Write a short poem about the sea."}])
    choice = reply.choices[0]
    assert choice.message.tool_calls is None
    assert choice.finish_reason in ("stop", "length") and choice.message.content


@pytest.mark.parametrize("schema", [
    # GenAI's own compiler fails the whole step on a quote in a property name (taken by it,
    # not json_grammar, because of the pattern): left unconstrained by the worker.
    {"type": "object", "properties": {'a"b': {"type": "string", "pattern": "^x+$"}}},
    # Not a schema a worker can compile (check_schema's 400 for a forced call): left
    # unconstrained by the gateway.
    {"type": "object", "properties": {"x": {"type": "strnig"}}},
    {"type": "object", "properties": {"x": {"type": "string", "pattern": "(["}}},
    {"type": "object", "properties": {"x": {"$ref": "#/$defs/missing"}}},
    # Bounds that leave no integer (a replayed Claude Code tool so killed the worker).
    {"type": "object", "properties": {"x": {"type": "integer", "exclusiveMinimum": 0,
                                            "maximum": 0}}},
])
def test_a_schema_no_worker_compiles_leaves_calls_free(oai: openai.OpenAI,
                                                       schema: dict[str, Any]) -> None:
    tools = [{"type": "function", "function": {"name": "set_level", "parameters": schema}}]
    for _ in range(2):  # the worker is still there for the next request
        reply = oai.chat.completions.create(model=LLM, messages=CALLING, tools=tools,
                                            temperature=0, max_tokens=40)
        assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
