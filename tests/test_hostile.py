"""Parsers of client text and model output run in time linear in their input.

Each input below made an earlier, regex-based parser backtrack for minutes on the gateway's
event loop (issue 14). Linear code answers them in milliseconds; a backtracking one does not
finish within the suite's timeout, so these tests fail without the fix whatever the machine.
"""

from __future__ import annotations

import httpx
import pytest

from gateway.api.ollama_template import render
from gateway.api.tools import CallParser, Tool, parse_calls
from gateway.core.errors import GatewayError

SIZE = 100_000
TOOLS = [Tool("get_weather", "", {"type": "object", "properties": {"city": {"type": "string"}}})]


@pytest.mark.parametrize("template", [
    "{{" + " " * SIZE,
    "{{-" + " " * SIZE + "x",
    "{{ " + " " * SIZE + " -",
    "{{ .Prompt }}" + "{{" * (SIZE // 2),
    "{{" + "-" * SIZE,
])
def test_pathological_templates_are_answered(template: str) -> None:
    try:
        out = render(template, "sys", "hi")
    except GatewayError as exc:
        assert exc.status == 400 and exc.param == "template"
    else:
        assert isinstance(out, str)


def test_unclosed_action_is_text_and_trims_still_work() -> None:
    assert render("a {{ .Prompt }} {{ b", "", "p") == "a p {{ b"
    assert render("x  {{- .Prompt -}}  y", "", "p") == "xpy"
    with pytest.raises(GatewayError):  # "-." is no trim marker (Go: a number)
        render("{{-.Prompt}}", "", "p")


@pytest.mark.parametrize("output", [
    "```" + " " * SIZE,
    "```json" + " " * SIZE + "x",
    "```" + " " * SIZE + "```" + " " * SIZE,
    "<tool_call>" + " " * SIZE,
    "<tool_call>" * (SIZE // 11),
    "[" * SIZE,
    "{" + " " * SIZE,
])
def test_pathological_model_output_is_parsed(output: str) -> None:
    text, calls = parse_calls(output, TOOLS)
    assert calls == [] and text == output
    parser = CallParser(TOOLS)
    streamed = "".join(parser.feed(output[i:i + 64]) for i in range(0, len(output), 64))
    rest, calls = parser.finish()
    assert calls == [] and streamed + rest == output


def test_fenced_call_is_still_found() -> None:
    fenced = '```json\n  {"name": "get_weather", "arguments": {"city": "Paris"}}  \n```  '
    _, calls = parse_calls(fenced, TOOLS)
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", {"city": "Paris"})]


DEEP = b"[" * 5000 + b"]" * 5000
MESSAGES = b'"messages": [{"role": "user", "content": "hi"}]'
TOOLS_DEEP = b'"tools": [{"type": "function", "name": "f", "input_schema": {"a": ' + DEEP + \
    b'}, "function": {"name": "f", "parameters": {"a": ' + DEEP + b"}}}]"


@pytest.mark.parametrize(("path", "fields"), [
    ("/v1/chat/completions", MESSAGES + b", " + TOOLS_DEEP),
    ("/api/chat", MESSAGES + b", " + TOOLS_DEEP),
    ("/v1/messages", b'"max_tokens": 5, ' + MESSAGES + b", " + TOOLS_DEEP),
    ("/v1/embeddings", b'"input": ' + DEEP),
    ("/api/embed", b'"input": ' + DEEP),
])
def test_deeply_nested_body_is_a_400(base_url: str, path: str, fields: bytes) -> None:
    """msgspec gives up on JSON nested ~1,000 deep with a RecursionError: a 400, not a 500."""
    body = b'{"model": "smollm2:135m", ' + fields + b"}"
    r = httpx.post(base_url + path, content=body,
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    assert "nests" in r.text
