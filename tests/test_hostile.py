"""Hostile input never harms another request: parsers run in time linear in their input,
reused request ids never cross-wire, and every way a request ends frees its slot.

Each input below made an earlier, regex-based parser backtrack for minutes on the gateway's
event loop (issue 14). Linear code answers them in milliseconds; a backtracking one does not
finish within the suite's timeout, so these tests fail without the fix whatever the machine.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import time
import tracemalloc
import uuid
from typing import Any

import httpx
import pytest
from errors import error_message
from serverctl import Server, wait_for

from npu_proxy.gateway.api.ollama.template import render
from npu_proxy.gateway.content.json_size import MAX_DEPTH, measure
from npu_proxy.gateway.content.reasoning import ReasoningSplitter, split_text
from npu_proxy.gateway.content.stops import MAX_STOP_CHARS, MAX_STOPS, StopMatcher
from npu_proxy.gateway.content.tools import CallParser, Tool, parse_calls
from npu_proxy.gateway.content.tools.pyliteral import MAX_LITERAL
from npu_proxy.gateway.core.errors import GatewayError
from npu_proxy.models.capabilities import ReasoningFormat, Style

SIZE = 100_000
LLM = "smollm2:135m"
CONTEXT = 8192  # smollm2:135m's max_position_embeddings
HI = [{"role": "user", "content": "hi"}]
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
    "\n" * SIZE,  # white space first: looked at once, not again at every piece
    "\n" * SIZE + "[1] a note",
    # Text, then a fence that may hold a bare call (issue 42's parser hold).
    "a\n```" + " " * (10 * SIZE) + "x",  # backtracked for ~40 min (~1 s at SIZE // 5)
    "a\n```json" + " \t" * (SIZE // 2) + "\n" + " " * SIZE,
    "a" + "\n```" * (SIZE // 4),
    "a " + '{"name"' * (SIZE // 7),
    # The tools wrapper, open and never closed, or closed around nothing.
    "a <tools>" * (SIZE // 9),
    "<tools></tools>" * (SIZE // 15) + "<tool_call></tools>",
    # Calls written as Python dicts: unclosed, nested past the parser's limit, a long string.
    "a `{'name'" * (SIZE // 10),
    "{'name': " + "[" * SIZE + "]" * SIZE + "}",
    "a {'name': '" + "x" * SIZE,
    "{'name': [" + "1, " * SIZE + "]}",
    # Pretty-printed JSON's start, over and over, and never a call.
    "a {\n" * (SIZE // 4),
    "a" + '{ \t\n  "na' * (SIZE // 8),
    "a " + '{\n "name"' * (SIZE // 10),
    # Calls written as XML elements: openers with no head, heads with no JSON or unclosed
    # JSON, over and over (the elements looked for are capped), a head never ending.
    "a <function" * (SIZE // 11),
    """<function name="get_weather" arguments='""" + "[" * SIZE,
    """a <function name="get_weather" arguments='{"city": """ * (SIZE // 50),
    "<function name=\"get_weather\" arguments='{\"city\": \"" + "x" * SIZE,
    "<function=get_weather>" * (SIZE // 22),
    "<function name=\"" + "x" * SIZE,
])
def test_pathological_model_output_is_parsed(output: str) -> None:
    text, calls = parse_calls(output, TOOLS)
    assert calls == [] and text == output
    parser = CallParser(TOOLS)
    streamed = "".join(parser.feed(output[i:i + 64]) for i in range(0, len(output), 64))
    rest, calls = parser.finish()
    assert calls == [] and streamed + rest == output
    whole = CallParser(TOOLS)  # a non-streamed reply is fed at once
    head = whole.feed(output)
    assert head + whole.finish()[0] == output


@pytest.mark.parametrize("output", [
    "<think>" + " " * SIZE,
    " " * SIZE + "<thin",
    "<think>" + "</thin" * (SIZE // 6),
    "<think>" * (SIZE // 7),
    "<|channel|>" + "x" * SIZE,
    "<|channel|>" * (SIZE // 11),
    "<|start|>" + "<|" * (SIZE // 2),
])
@pytest.mark.parametrize("style", list(Style))
def test_pathological_reasoning_is_split(output: str, style: Style) -> None:
    fmt = ReasoningFormat(style)
    whole = split_text(output, fmt)
    splitter = ReasoningSplitter(fmt)
    pieces = [splitter.feed(output[i:i + 64]) for i in range(0, len(output), 64)]
    pieces.append(splitter.finish())
    assert ("".join(p[0] for p in pieces), "".join(p[1] for p in pieces)) == whole
    splitter = ReasoningSplitter(fmt)
    for c in output[:20_000]:  # one character at a time
        splitter.feed(c)
    splitter.finish()


def test_a_python_dict_call_is_bounded(caplog: pytest.LogCaptureFixture) -> None:
    """A call written as a Python dict is read with literal_eval, ~50x slower than JSON, in
    the gateway's event loop: one longer than MAX_LITERAL stays text, and the log says so."""
    long = "x" * MAX_LITERAL
    text = "{'name': 'get_weather', 'arguments': {'city': '" + long + "'}}"
    with caplog.at_level(logging.INFO):
        assert parse_calls(text, TOOLS) == (text, [])
    assert "Python dict longer than 16384 characters is left as text" in caplog.text
    (call,) = parse_calls(text.replace(long, "Paris"), TOOLS)[1]
    assert call.arguments == {"city": "Paris"}


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


# --- request ids and slots ------------------------------------------------------------------


def _chat_stream(base_url: str, question: str, rid: str) -> tuple[httpx.Headers, str, dict]:
    body = {"model": "smollm2:135m", "stream": True, "max_tokens": 16, "temperature": 0,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": question}]}
    text, usage = [], {}
    with httpx.stream("POST", base_url + "/v1/chat/completions", json=body,
                      headers={"x-request-id": rid}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                for choice in chunk["choices"]:
                    text.append(choice["delta"].get("content") or "")
        return r.headers, "".join(text), usage


def test_a_reused_request_id_never_cross_wires(base_url: str) -> None:
    """A proxy that sends one fixed X-Request-ID: each request still gets its own answer
    (the id is echoed, never used as a key)."""
    questions = ["What is the capital of France?",
                 "Name three colours of the rainbow, please, in one short sentence."]
    alone = [httpx.post(base_url + "/v1/messages/count_tokens", timeout=60, json={
        "model": "smollm2:135m", "messages": [{"role": "user", "content": q}]}).json()
        ["input_tokens"] for q in questions]
    assert alone[0] != alone[1]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda q: _chat_stream(base_url, q, "fixed-id-1"), questions))
    for (headers, text, usage), tokens in zip(results, alone, strict=True):
        assert headers["x-request-id"] == "fixed-id-1"
        assert text
        assert usage["prompt_tokens"] == tokens == int(headers["x-npu-proxy-token-count"])


def _in_flight(base_url: str, worker: str) -> int:
    rows = httpx.get(base_url + "/health/devices", timeout=10).json()["workers"]
    return int(next(w for w in rows if w["name"] == worker)["in_flight"])


def test_a_client_that_goes_away_frees_its_slot(base_url: str) -> None:
    body = {"model": "smollm2:135m", "stream": True, "max_tokens": 4000, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Tell me a very long story."}]}
    with httpx.stream("POST", base_url + "/v1/chat/completions", json=body, timeout=120) as r:
        for n, _ in enumerate(r.iter_lines()):
            if n >= 3:
                break
    deadline = time.monotonic() + 60
    while _in_flight(base_url, "llm") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _in_flight(base_url, "llm") == 0


def test_a_pathological_template_never_stalls_another_stream(base_url: str) -> None:
    """The template that once backtracked for minutes on the event loop is answered while a
    stream on another connection keeps receiving tokens."""
    body = {"model": "smollm2:135m", "stream": True, "max_tokens": 4000, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Tell me a very long story."}]}
    seen = 0
    with httpx.stream("POST", base_url + "/v1/chat/completions", json=body, timeout=120) as r:
        lines = r.iter_lines()
        for line in lines:
            seen += line.startswith("data: {")
            if seen >= 3:
                break
        bad = httpx.post(base_url + "/api/generate", timeout=60, json={
            "model": "smollm2:135m", "prompt": "hi", "stream": False,
            "options": {"num_predict": 1}, "template": "{{" + " " * 20_000})
        assert bad.status_code in (200, 400)
        for line in lines:
            seen += line.startswith("data: {")
            if seen >= 6:
                break
    assert seen >= 6


def test_a_timed_out_request_frees_its_slot(timeout_server: Server) -> None:
    url = timeout_server.url
    r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
        "model": "smollm2:135m", "max_tokens": 4000, "ignore_eos": True,
        "messages": [{"role": "user", "content": "Tell me a very long story."}]})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    deadline = time.monotonic() + 60
    while _in_flight(url, "llm") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _in_flight(url, "llm") == 0


# Each of these made OpenVINO's grammar compiler throw inside the batch step, which left the
# pipeline unusable: every request on the worker failed and it restarted.
UNCOMPILABLE = [
    {"type": 1}, {"type": "strin"}, {"anyOf": []}, {"enum": []},
    {"type": "object", "properties": {"a": {"$ref": "#/nope"}}},
    {"type": "string", "pattern": "(("}, {"type": "string", "pattern": "(?=a)b"},
    {"type": "string", "pattern": "\\bword"}, {"type": "string", "pattern": "(a)\\1"},
    {"type": "string", "pattern": "\\p{L}+"},
    # Valid for Python's re, refused by XGrammar (possessive, a bare brace, an empty branch).
    {"type": "string", "pattern": "a++"}, {"type": "string", "pattern": "x{,3}"},
    {"type": "string", "pattern": "[]a]"}, {"type": "string", "pattern": "(|a)b"},
    {"type": "string", "pattern": "a||b"}, {"type": "string", "pattern": "\\N{DIGIT ONE}"},
    # Objects and arrays no value fits, and `false` subschemas.
    {"type": "object", "minProperties": 1},
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
     "maxProperties": 0},
    {"type": "array", "items": False, "minItems": 1},
    {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "integer"}], "maxItems": 1},
    {"type": "object", "properties": {"a": False}}, {"anyOf": [False, {"type": "integer"}]},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": 5, "maximum": 1}}},
    {"type": "array", "minItems": 3, "maxItems": 1},
    {"type": "object", "properties": {"n": {"type": "integer", "exclusiveMinimum": 0,
                                            "maximum": 0}}},
    {"type": "object", "properties": {"n": {"type": "integer", "exclusiveMinimum": 0,
                                            "exclusiveMaximum": 1}}},
    {"type": "object", "properties": {"n": {"type": "number", "minimum": 2,
                                            "exclusiveMaximum": 2}}},
]


def _restarts(base_url: str) -> int:
    rows = httpx.get(base_url + "/health/devices", timeout=10).json()["workers"]
    return int(next(w for w in rows if w["name"] == "llm")["restarts"])


def test_a_schema_the_worker_cannot_compile_is_a_400_and_harms_no_one(base_url: str) -> None:
    before = _restarts(base_url)
    messages = [{"role": "user", "content": "Give me JSON."}]
    for schema in UNCOMPILABLE:
        openai = httpx.post(base_url + "/v1/chat/completions", timeout=60, json={
            "model": "smollm2:135m", "messages": messages, "max_tokens": 8,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "x", "schema": schema}}})
        assert openai.status_code == 400, (schema, openai.text)
        assert "JSON schema" in openai.json()["error"]["message"]
        ollama = httpx.post(base_url + "/api/chat", timeout=60, json={
            "model": "smollm2:135m", "messages": messages, "format": schema, "stream": False})
        assert ollama.status_code == 400 and "JSON schema" in ollama.json()["error"]
        tool = httpx.post(base_url + "/v1/chat/completions", timeout=60, json={
            "model": "smollm2:135m", "messages": messages, "max_tokens": 8,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {
                "type": "object", "properties": {"x": schema}}}}],
            "tool_choice": {"type": "function", "function": {"name": "f"}}})
        assert tool.status_code == 400, (schema, tool.text)
    # A schema it can compile is still served, by the same worker, never restarted.
    good = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1}},
            "required": ["n"]}
    r = httpx.post(base_url + "/v1/chat/completions", timeout=120, json={
        "model": "smollm2:135m", "messages": messages, "max_tokens": 30,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": good}}})
    # NOTE: only that it is served: the tiny model may run to max_tokens inside the object.
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"].startswith("{")
    assert _restarts(base_url) == before


# Near forms of the refused ones that XGrammar compiles: served, not refused.
COMPILABLE = [
    *({"type": "string", "pattern": p} for p in
      ["a+?", "a|b|", "(a|)b", "[^]a]", "[a*+{]", "\\{,3}", "a}", "(?:ab){2,}"]),
    {"type": "object", "minProperties": 1, "additionalProperties": True},
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
     "maxProperties": 1},
    {"type": "array", "prefixItems": [{"type": "integer"}], "items": False, "minItems": 1},
    {"type": "object", "$defs": {"x": False}, "properties": {"a": {"type": "integer"}}},
]


def test_schemas_that_compile_are_served_by_the_same_worker(base_url: str) -> None:
    before = _restarts(base_url)
    for schema in COMPILABLE:
        wrapped = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
        r = httpx.post(base_url + "/v1/chat/completions", timeout=120, json={
            "model": "smollm2:135m", "messages": [{"role": "user", "content": "JSON"}],
            "max_tokens": 6, "response_format": {
                "type": "json_schema", "json_schema": {"name": "x", "schema": wrapped}}})
        assert r.status_code == 200, (schema, r.text)
    assert _restarts(base_url) == before


# --- issue 27: work and memory bounded per request ------------------------------------------


def test_stop_matching_work_does_not_grow_with_the_number_of_stops() -> None:
    """The Anthropic stop matcher runs per token on the event loop: its automaton takes the
    same transitions for 1 stop as for 16 (100,000 stops once froze other streams 20 s)."""
    text = "abcdefghij" * 1000 + "STOP"
    work = []
    for stops in (["STOP"], ["STOP", *(f"never-{i}" for i in range(MAX_STOPS - 1))]):
        matcher = StopMatcher(stops)
        out = "".join(matcher.feed(text[i:i + 3]) for i in range(0, len(text), 3))
        assert out == text[:-4] and matcher.matched == "STOP"
        work.append(matcher.steps)
    assert work[0] == work[1] <= 2 * len(text)
    # Text held back while it may begin a stop, then released; the first stop to end wins.
    matcher = StopMatcher(["abcd", "bc"])
    assert matcher.feed("xa") == "x" and matcher.feed("b") == ""
    assert matcher.feed("cd") == "a" and matcher.matched == "bc"
    matcher = StopMatcher(["zz"])
    assert matcher.feed("az") == "a" and matcher.finish() == "z" and matcher.matched is None


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {"messages": HI, "max_tokens": 1}, "stop"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 1}, "stop"),
    ("/v1/messages", {"messages": HI, "max_tokens": 1}, "stop_sequences"),
    ("/api/chat", {"messages": HI, "stream": False}, "options.stop"),
])
@pytest.mark.parametrize("stops", [
    [f"s{i}" for i in range(MAX_STOPS + 1)], ["x" * (MAX_STOP_CHARS + 1)]])
def test_stop_strings_are_bounded(base_url: str, path: str, body: dict[str, Any], param: str,
                                  stops: list[str]) -> None:
    field = {"stop_sequences": {"stop_sequences": stops}, "stop": {"stop": stops},
             "options.stop": {"options": {"stop": stops}}}[param]
    r = httpx.post(base_url + path, timeout=60, json={"model": LLM, **body, **field})
    assert r.status_code == 400, r.text
    message = error_message(r)
    assert message.startswith(param) and ("limit is 16" in message or "limit is 512" in message)
    # At the limits it is served.
    ok = [f"s{i}" for i in range(MAX_STOPS - 1)] + ["x" * MAX_STOP_CHARS]
    field = {"stop_sequences": {"stop_sequences": ok}, "stop": {"stop": ok},
             "options.stop": {"options": {"stop": ok, "num_predict": 1}}}[param]
    assert httpx.post(base_url + path, timeout=60,
                      json={"model": LLM, **body, **field}).status_code == 200


def test_a_template_is_refused_before_its_text_is_built() -> None:
    """"{{ .Prompt }}" x 2,000 with a 64 KiB prompt made a 131 M character string; counted
    first, the refusal builds nothing near that (the parser's tracemalloc peak)."""
    prompt = "p" * 65_536
    tracemalloc.start()
    try:
        with pytest.raises(GatewayError) as refused:
            render("{{ .Prompt }}" * 2000, "", prompt, limit=1_000_000)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert refused.value.status == 400 and refused.value.param == "template"
    assert "max_prompt_chars" in refused.value.message
    assert peak < 2_000_000
    assert render("{{ .Prompt }}" * 15, "", prompt, limit=1_000_000) == prompt * 15


def test_an_amplifying_template_is_a_400(base_url: str) -> None:
    r = httpx.post(base_url + "/api/generate", timeout=60, json={
        "model": LLM, "stream": False, "prompt": "p" * 65_536,
        "template": "{{ .Prompt }}" * 2000})
    assert r.status_code == 400 and "max_prompt_chars" in error_message(r)


def test_control_characters_from_a_client_are_escaped_in_the_log(server: Server) -> None:
    rid = "log-" + uuid.uuid4().hex
    r = httpx.get(server.url + "/api/x%0aFORGED%1b[31m", headers={"x-request-id": rid},
                  timeout=30)
    assert r.status_code == 404

    def lines() -> list[str]:
        return [line for line in server.worker_log("gateway").splitlines() if rid in line]

    found = wait_for(lines, 10)
    assert len(found) == 1 and "GET /api/x\\x0aFORGED\\x1b[31m 404" in found[0], found
    log = server.worker_log("gateway")
    assert "\x1b" not in log and not any(line.startswith("FORGED") for line in log.splitlines())


def test_detokenize_takes_at_most_the_context(base_url: str) -> None:
    r = httpx.post(base_url + "/detokenize", timeout=60,
                   json={"model": LLM, "tokens": [1] * (CONTEXT + 1)})
    assert r.status_code == 400 and f"limit is {CONTEXT}" in error_message(r)
    r = httpx.post(base_url + "/v1/detokenize", timeout=60,
                   json={"model": LLM, "tokens": [28] * CONTEXT})
    assert r.status_code == 200 and r.json()["prompt"]


def _nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/api/chat", "/v1/messages",
                                  "/v1/responses", "/tokenize"])
def test_tool_parameters_nested_deep_are_a_400(base_url: str, path: str) -> None:
    """Nested 600 deep: msgspec decodes it, json.dumps then recursed out (a 500)."""
    params = _nested(300)  # two levels per object: 600 deep
    fn = {"name": "f", "description": "d", "parameters": params}
    tools: Any = ([{"name": "f", "input_schema": params}] if path == "/v1/messages" else
                  [{"type": "function", **fn}] if path == "/v1/responses" else
                  [{"type": "function", "function": fn}])
    body = {"model": LLM, "max_tokens": 1, "stream": False, "tools": tools,
            "input": "hi", "messages": HI}
    r = httpx.post(base_url + path, timeout=60, json=body)
    assert r.status_code == 400, r.text
    assert f"nests deeper than {MAX_DEPTH} levels" in error_message(r)


@pytest.mark.parametrize("value", [
    {"b": [1e15, -1.5e-300, 2**63 - 1, -(2**63), True, None, 0.1]},
    {"s": 'quote " back \\ nl \n tab \t é \x01 \u2028', "": [[], {}, [{}]]},
    "plain", 1e308, [],
])
def test_tool_text_is_measured_at_least_as_long_as_it_is_built(value: Any) -> None:
    assert measure(value, "x") >= len(json.dumps(value, ensure_ascii=False))


@pytest.mark.parametrize("option", [
    {"temperature": "nan"}, {"temperature": "inf"}, {"temperature": -0.5},
    {"min_p": -0.1}, {"min_p": 2}, {"min_p": "nan"}, {"repeat_penalty": 0},
    {"repeat_penalty": -1}, {"repeat_penalty": "inf"}, {"top_p": 1.5},
    {"presence_penalty": 3}, {"frequency_penalty": "-inf"},
])
def test_ollama_numeric_options_are_checked(base_url: str, option: dict[str, Any]) -> None:
    # NOTE: Ollama's options convert laxly (integers as floats): "nan" and "inf" are floats.
    r = httpx.post(base_url + "/api/generate", timeout=60, json={
        "model": LLM, "prompt": "hi", "stream": False, "options": {"num_predict": 1, **option}})
    assert r.status_code == 400, r.text
    name = next(iter(option))
    assert error_message(r).startswith(f"{name} must be a number from")


def test_sampling_numbers_at_their_bounds_are_served(base_url: str) -> None:
    r = httpx.post(base_url + "/api/generate", timeout=60, json={
        "model": LLM, "prompt": "hi", "stream": False,
        "options": {"num_predict": 1, "temperature": 0, "min_p": 0, "repeat_penalty": 1.1,
                    "presence_penalty": -2, "frequency_penalty": 2, "top_p": 1}})
    assert r.status_code == 200, r.text
    r = httpx.post(base_url + "/v1/chat/completions", timeout=60, json={
        "model": LLM, "messages": HI, "max_tokens": 1, "min_p": 5})
    assert r.status_code == 400 and error_message(r).startswith("min_p must be a number")
