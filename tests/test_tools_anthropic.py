"""Tool calls on all three APIs and the Anthropic Messages API, through the official clients
(`anthropic`, `openai`, `ollama`, LangChain) against the real server and SmolLM2-135M.

What a 135M model does on its own is not asserted: a forced tool_choice constrains the output
to a valid call (so the call and its arguments are guaranteed), text answers are only checked
for their shape, and temperature 0 keeps every request deterministic.
"""

from __future__ import annotations

import json
import re
from typing import Any

import anthropic
import httpx
import jsonschema
import ollama
import openai
import pytest
from ollama._utils import convert_function_to_tool

from npu_proxy.gateway.content.tools import (
    CallParser,
    Tool,
    ToolChoice,
    ToolRequest,
    call_schema,
    parse_calls,
    split_calls,
)

LLM = "smollm2:135m"
GREEDY: dict[str, Any] = {"temperature": 0}
WEATHER_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        # NOTE: lengths bounded, so any greedy decode is a short call (issue 28).
        "city": {"type": "string", "description": "The city, e.g. Paris", "maxLength": 24},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
OPENAI_TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather",
                                      "description": "Get the current weather in a city",
                                      "parameters": WEATHER_SCHEMA}},
    {"type": "function", "function": {"name": "get_time", "description": "The time in a city",
                                      "parameters": {"type": "object",
                                                     "properties": {"city": {
                                                         "type": "string", "maxLength": 24}},
                                                     "required": ["city"]}}},
]
ANTHROPIC_TOOLS: list[dict[str, Any]] = [
    {"name": t["function"]["name"], "description": t["function"]["description"],
     "input_schema": t["function"]["parameters"]} for t in OPENAI_TOOLS
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in OPENAI_TOOLS}
ASK = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def claude(base_url: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base_url, api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def oai(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0,
                         _strict_response_validation=True)


# --- the parser, without the server --------------------------------------------------------


TOOLS = [Tool("get_weather", "", WEATHER_SCHEMA)]


@pytest.mark.parametrize("text", [
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',
    ' [{"name": "get_weather", "arguments": {"city": "Paris"}}]',
    'Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
    "\n</tool_call>",
    '```json\n{"name": "get_weather", "parameters": {"city": "Paris"}}\n```',
    '[TOOL_CALLS] [{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}]',
    # Qwen2.5-Coder-1.5B's form, seen with Claude Code's tools (issue 26).
    '{"function": "get_weather", "arguments": {"city": "Paris"}}',
    # Its Python-dict form, in inline code, seen with cn's tools (issue 42).
    "`{'name': 'get_weather', 'arguments': {'city': 'Paris'}}`",
    "{'name': 'get_weather', 'arguments': {'city': 'Paris'}}",
    # Its arguments as a string holding a Python dict.
    '{"name": "get_weather", "arguments": "{\'city\': \'Paris\'}"}',
    # An XML element, as it wrote an exec_command call under Codex CLI (issue 42), and as
    # llama-server passed one on, inside the wrapper its template lists tools in.
    """<function name="get_weather" arguments='{"city": "Paris"}'>""",
    """<tools>\n<function name="get_weather" arguments='{"city": "Paris"}'>\n</function>\n"""
    "</tools>",
    # Llama 3.1's form for tools of the user's own.
    '<function=get_weather>{"city": "Paris"}</function>',
])
def test_parser_finds_the_call(text: str) -> None:
    parser = CallParser(TOOLS)
    streamed = "".join(parser.feed(ch) for ch in text)
    rest, calls = parser.finish()
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert streamed + rest in ("", "Let me look. ")
    assert parse_calls(text, TOOLS)[1][0].arguments == {"city": "Paris"}


def test_parser_finds_calls_followed_by_text() -> None:
    """Bare calls the output begins with are calls; what follows them is text."""
    text = ('{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '{"function": "get_weather", "arguments": {"city": "Rome"}}\n\nDone.')
    parser = CallParser(TOOLS)
    streamed = "".join(parser.feed(ch) for ch in text)
    rest, calls = parser.finish()
    assert [c.arguments["city"] for c in calls] == ["Paris", "Rome"]
    assert streamed + rest == "Done."


@pytest.mark.parametrize(("text", "before"), [
    ('Let me look. {"name": "get_weather", "arguments": {"city": "Paris"}}', "Let me look. "),
    # Qwen2.5-Coder-1.5B under Codex CLI wrote its call fenced (issue 42).
    ('Let me look.\n```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```\n'
     "Done.", "Let me look.\nDone."),
    # It also wrapped one as its template lists the tools: no remains of the wrapper as text.
    ('Let me look. <tools>\n{"type": "function", "function": {"name": "get_weather", '
     '"arguments": {"city": "Paris"}}}\n</tools>', "Let me look. "),
    ("Let me look. `{'name': 'get_weather', 'arguments': {'city': 'Paris'}}` Done.",
     "Let me look. Done."),
    ("""Let me look. <function name="get_weather" arguments='{"city": "Paris"}'></function>"""
     " Done.", "Let me look. Done."),
    # Pretty-printed in a fence, as it wrote a MultiEdit call under cn.
    ('Let me look.\n```json\n{\n    "name": "get_weather",\n    "arguments": {\n'
     '        "city": "Paris"\n    }\n}\n```\nDone.', "Let me look.\nDone."),
])
def test_parser_finds_a_call_after_text(text: str, before: str) -> None:
    """A bare or fenced call after text (the tool grammar's `{"name"` trigger holds one
    anywhere): the text before it flows, the fence goes with the call."""
    parser = CallParser(TOOLS)
    streamed = "".join(parser.feed(ch) for ch in text)
    assert before.startswith(streamed) and streamed.startswith("Let me look.")
    rest, calls = parser.finish()
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", {"city": "Paris"})]
    assert streamed + rest == before


@pytest.mark.parametrize("text", [
    "The weather in Paris is sunny.", '{"city": "Paris"}',
    'A record: {"name": "Alice", "age": 3}. More text.',
    "Run it:\n```bash\nls -l\n```\nThen `cat` it.\n```",
    '<tool_call>{"name": "unknown_tool", "arguments": {}}</tool_call>',
    "Qwen lists its tools in <tools></tools> tags, then <tools>{} and <tools>",
    # Python dicts that are no call: bytes, a set, unclosed, a string past its line.
    "`{'name': 'get_weather', 'arguments': {'city': b'Paris'}}`",
    "{'name': 'get_weather', 'arguments': {'city': {'Paris', 'Rome'}}}",
    "Set `{'name': 'get_weather', 'arguments': {'city': 'Paris'}` then go.",
    "{'name': 'get_weather', 'arguments': {'city': 'Par\nis'}}",
    "{'name': 'get_weather', 'arguments': {'city': 1e999}}",
    'A package.json:\n```json\n{\n  "name": "get-weather",\n  "version": "1.0.0"\n}\n```\nOK.',
    '{"name": "get_weather", "arguments": {"city": "Par',  # cut short by max_tokens
    # Elements that are no call: no such tool, arguments that are no JSON, not closed.
    """<function name="unknown_tool" arguments='{}'> then text.""",
    """<function name="get_weather" arguments='city=Paris'>""",
    """<function name="get_weather" arguments='{"city": "Paris"}' and on""",
])
def test_parser_leaves_text_alone(text: str) -> None:
    parser = CallParser(TOOLS)
    streamed = "".join(parser.feed(ch) for ch in text)
    rest, calls = parser.finish()
    assert calls == [] and streamed + rest == text


@pytest.mark.parametrize("text", [
    'A record: {"name": "Alice", "age": 3}. More text.',
    '{"city": "Paris"} and then more text.',
    '\n\n  {"city": "Paris"} and then more text.',
    "```python\nprint({'a': 1})\n```\nDone.",
    'A package.json:\n```json\n{\n  "name": "get-weather",\n  "version": "1.0.0"\n}\n```\nOK.',
    '<tool_call>{"name": "unknown_tool", "arguments": {}}</tool_call> Then text.',
    "Use `{'name': 'get_weather', 'arguments': {'city': b'Paris'}}` then go on.",
    "[1] Smith's paper, then more text.",
    "{it's an aside\nthat goes on.",
    "A <functional> style, then more text.",
    "Write a <function> element\nand more text.",
    "<function" + " name" * 80 + " and more text.",
])
def test_text_that_is_no_call_flows_before_the_end(text: str) -> None:
    """What looked like the start of a call flows as text as soon as it is known to be none
    (its value or tag closed, its fence holds no value): a stream is not held to its end."""
    parser = CallParser(TOOLS)
    streamed = "".join(parser.feed(ch) for ch in text)
    rest, calls = parser.finish()
    assert calls == [] and streamed + rest == text
    assert rest == ""


def test_a_call_after_a_value_that_is_none_is_a_call() -> None:
    text = '{"city": "Paris"} {"name": "get_weather", "arguments": {"city": "Paris"}}'
    parser = CallParser(TOOLS)
    streamed = "".join(parser.feed(ch) for ch in text)
    rest, calls = parser.finish()
    assert streamed == '{"city": "Paris"} ' and rest == ""
    assert [c.arguments for c in calls] == [{"city": "Paris"}]


def test_a_line_break_in_a_string_is_read() -> None:
    """Models put real line breaks in code they pass as an argument: JSON is read with
    strict=False (a Python dict's string past its line is still no call)."""
    text = '{"name": "get_weather", "arguments": {"city": "Pa\nris"}}'
    for split in (lambda t: parse_calls(t, TOOLS), lambda t: split_calls(t, CallParser(TOOLS))):
        rest, calls = split(text)
        assert rest == "" and [c.arguments for c in calls] == [{"city": "Pa\nris"}]


def test_forced_schema_hoists_definitions() -> None:
    params = {"type": "object", "properties": {"p": {"$ref": "#/$defs/Point"}},
              "$defs": {"Point": {"type": "object", "properties": {"x": {"type": "number"}}}}}
    req = ToolRequest([Tool("f", "", params)], ToolChoice("required", "f"))
    schema = json.loads(call_schema(req) or "")
    call = {"name": "f", "arguments": {"p": {"x": 1}}}
    jsonschema.validate(call, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "f", "arguments": {"p": {"x": "no"}}}, schema)


# --- Anthropic -------------------------------------------------------------------------------


def test_messages_create(claude: anthropic.Anthropic) -> None:
    raw = claude.messages.with_raw_response.create(
        model=LLM, max_tokens=24, system="You are terse.",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        extra_body=GREEDY)
    msg = raw.parse()
    assert msg.id.startswith("msg_") and msg.type == "message" and msg.role == "assistant"
    assert msg.model == LLM
    assert [b.type for b in msg.content] == ["text"]
    assert msg.content[0].text  # type: ignore[union-attr]
    assert msg.stop_reason in ("end_turn", "max_tokens")
    assert int(raw.headers["x-npu-proxy-token-count"]) == msg.usage.input_tokens
    assert 0 < msg.usage.output_tokens <= 24


def test_messages_stream(claude: anthropic.Anthropic) -> None:
    with claude.messages.stream(model=LLM, max_tokens=24, extra_body=GREEDY,
                                messages=[{"role": "user", "content": "Say hello."}]) as s:
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert text and final.content[0].text == text  # type: ignore[union-attr]
    assert final.stop_reason in ("end_turn", "max_tokens")
    assert final.usage.input_tokens > 0 and final.usage.output_tokens > 0


def test_count_tokens_equals_input_tokens(claude: anthropic.Anthropic) -> None:
    kwargs: dict[str, Any] = {
        "model": LLM, "system": [{"type": "text", "text": "Be brief."}],
        "tools": ANTHROPIC_TOOLS,
        "messages": [{"role": "user", "content": [{"type": "text", "text": ASK}]}],
    }
    counted = claude.messages.count_tokens(**kwargs).input_tokens
    used = claude.messages.create(max_tokens=1, extra_body=GREEDY, **kwargs).usage.input_tokens
    assert counted == used > 100  # the tools are in the prompt, so they count
    bare = claude.messages.count_tokens(model=LLM, messages=kwargs["messages"]).input_tokens
    assert bare < counted


def test_tool_round_trip(claude: anthropic.Anthropic) -> None:
    question: dict[str, Any] = {"role": "user", "content": ASK}
    first = claude.messages.create(
        model=LLM, max_tokens=64, tools=ANTHROPIC_TOOLS, messages=[question],
        tool_choice={"type": "tool", "name": "get_weather"}, extra_body=GREEDY)
    assert first.stop_reason == "tool_use"
    uses = [b for b in first.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather" and uses[0].id.startswith("toolu_")
    jsonschema.validate(uses[0].input, WEATHER_SCHEMA)
    history: list[Any] = [
        question,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                      "content": "Sunny, 22 degrees"}]},
    ]
    # NOTE: tool_choice none guarantees a text answer; what a 135M model says is not asserted.
    final = claude.messages.create(model=LLM, max_tokens=48, tools=ANTHROPIC_TOOLS,
                                   tool_choice={"type": "none"}, messages=history,
                                   extra_body=GREEDY)
    assert final.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in final.content] == ["text"] and final.content[0].text.strip()  # type: ignore[union-attr]
    alone = claude.messages.count_tokens(model=LLM, messages=[question]).input_tokens
    assert final.usage.input_tokens > alone + 20  # the call and its result are in the prompt


def test_stream_tool_use(claude: anthropic.Anthropic) -> None:
    with claude.messages.stream(model=LLM, max_tokens=64, tools=ANTHROPIC_TOOLS,
                                tool_choice={"type": "any"}, extra_body=GREEDY,
                                messages=[{"role": "user", "content": ASK}]) as s:
        events = [e.type for e in s]
        final = s.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert "input_json" in events
    assert final.stop_reason == "tool_use"
    uses = [b for b in final.content if b.type == "tool_use"]
    assert uses and all(u.name in SCHEMAS for u in uses)
    for use in uses:
        jsonschema.validate(use.input, SCHEMAS[use.name])


def test_stop_sequence(claude: anthropic.Anthropic) -> None:
    # NOTE: "e" comes up in any English sentence; the text is cut before it, and a stop
    # sequence inside a token ("Paris" for "a") cuts that token too.
    ask: Any = [{"role": "user", "content": "Describe the city of Paris in one sentence."}]
    stopped = claude.messages.create(model=LLM, max_tokens=32, messages=ask, extra_body=GREEDY,
                                     stop_sequences=["zzz", "e"])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "e"
    assert "e" not in stopped.content[0].text  # type: ignore[union-attr]
    with claude.messages.stream(model=LLM, max_tokens=32, messages=ask, extra_body=GREEDY,
                                stop_sequences=["e"]) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == "e"
    assert "e" not in streamed
    free = claude.messages.create(model=LLM, max_tokens=4, messages=ask, extra_body=GREEDY,
                                  stop_sequences=["zzz-never"])
    assert free.stop_reason in ("max_tokens", "end_turn") and free.stop_sequence is None


def test_output_config_format(claude: anthropic.Anthropic) -> None:
    schema = {"type": "object", "properties": {"capital": {"type": "string", "maxLength": 24}},
              "required": ["capital"], "additionalProperties": False}
    msg = claude.messages.create(
        model=LLM, max_tokens=48, extra_body=GREEDY,
        output_config={"format": {"type": "json_schema", "schema": schema}},
        messages=[{"role": "user", "content": "What is the capital of France? Answer in JSON."}])
    jsonschema.validate(json.loads(msg.content[0].text), schema)  # type: ignore[union-attr]


def test_claude_code_request(base_url: str) -> None:
    """The shape Claude Code sends (recorded, max_tokens cut down to keep the test fast)."""
    body = {
        "model": "claude-sonnet-4-5-20250929",
        "max_tokens": 32,
        "stream": True,
        "temperature": 1,
        "system": [
            {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude.",
             "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "You are an interactive CLI tool that helps users with "
             "software engineering tasks.", "cache_control": {"type": "ephemeral"}},
        ],
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "<system-reminder>\nThis is a reminder.\n</system-reminder>"},
            {"type": "text", "text": "list the files here",
             "cache_control": {"type": "ephemeral"}},
        ]}],
        "tools": [
            {"name": "Bash", "description": "Executes a given bash command",
             "input_schema": {"type": "object", "properties": {
                 "command": {"type": "string", "description": "The command to execute"},
                 "timeout": {"type": "number", "description": "Optional timeout in ms"}},
                 "required": ["command"], "additionalProperties": False,
                 "$schema": "http://json-schema.org/draft-07/schema#"}},
            {"name": "Read", "description": "Reads a file from the local filesystem.",
             "input_schema": {"type": "object", "properties": {
                 "file_path": {"type": "string"}}, "required": ["file_path"],
                 "additionalProperties": False,
                 "$schema": "http://json-schema.org/draft-07/schema#"}},
        ],
        "metadata": {"user_id": "user_0123_account__session_4567"},
    }
    headers = {"anthropic-version": "2023-06-01", "x-api-key": "sk-anything",
               "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,"
                                 "fine-grained-tool-streaming-2025-05-14",
               "anthropic-dangerous-direct-browser-access": "true", "x-app": "cli",
               "user-agent": "claude-cli/2.0.0 (external, cli)"}
    with httpx.stream("POST", base_url + "/v1/messages?beta=true", json=body, headers=headers,
                      timeout=60) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        raw = resp.read().decode()
    events = []
    for block in raw.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        data = json.loads(lines["data"])
        assert data["type"] == lines["event"]
        events.append(data)
    kinds = [e["type"] for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert events[0]["message"]["model"] == body["model"]
    assert "error" not in kinds and "content_block_start" in kinds
    assert events[-2]["delta"]["stop_reason"] in ("end_turn", "max_tokens", "tool_use")
    # The small request Claude Code sends first (its quota check, on the small fast model).
    quota = httpx.post(base_url + "/v1/messages?beta=true", headers=headers, timeout=60, json={
        "model": "claude-3-5-haiku-20241022", "max_tokens": 1,
        "messages": [{"role": "user", "content": "quota"}]})
    assert quota.status_code == 200 and quota.json()["stop_reason"] == "max_tokens"
    counted = httpx.post(base_url + "/v1/messages/count_tokens?beta=true", headers=headers,
                         timeout=60, json={k: body[k] for k in ("model", "system", "messages",
                                                                 "tools")})
    assert counted.status_code == 200 and counted.json()["input_tokens"] > 100


def test_anthropic_errors(base_url: str, claude: anthropic.Anthropic) -> None:
    resp = httpx.post(base_url + "/v1/messages", timeout=30, json={
        "model": LLM, "messages": [{"role": "user", "content": "hi"}]})
    assert resp.status_code == 400
    body = resp.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as err:
        claude.messages.create(model="no-such-model:7b", max_tokens=8,
                               messages=[{"role": "user", "content": "hi"}])
    assert err.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model=LLM, max_tokens=8, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "iVBORw0KGgo="}}]}])
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model=LLM, max_tokens=8, tools=ANTHROPIC_TOOLS,  # type: ignore[arg-type]
                               tool_choice={"type": "tool", "name": "nope"},
                               messages=[{"role": "user", "content": "hi"}])


# --- OpenAI ----------------------------------------------------------------------------------


def test_openai_tool_choice_required(oai: openai.OpenAI) -> None:
    resp = oai.chat.completions.create(
        model=LLM, messages=[{"role": "user", "content": ASK}], tools=OPENAI_TOOLS,  # type: ignore[arg-type]
        tool_choice="required", max_tokens=96, temperature=0)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls or []
    assert calls
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments),  # type: ignore[union-attr]
                            SCHEMAS[call.function.name])  # type: ignore[union-attr]
    named = oai.chat.completions.create(
        model=LLM, messages=[{"role": "user", "content": ASK}], tools=OPENAI_TOOLS,  # type: ignore[arg-type]
        tool_choice={"type": "function", "function": {"name": "get_time"}}, max_tokens=64,
        temperature=0)
    assert named.choices[0].finish_reason == "stop"  # a named tool_choice ends with "stop"
    (call,) = named.choices[0].message.tool_calls or []
    assert call.function.name == "get_time"  # type: ignore[union-attr]
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_time"])  # type: ignore[union-attr]


def test_openai_stream_helper(oai: openai.OpenAI) -> None:
    with oai.chat.completions.stream(
            model=LLM, messages=[{"role": "user", "content": ASK}], tools=OPENAI_TOOLS,  # type: ignore[arg-type]
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            max_tokens=64, temperature=0) as stream:
        kinds = {event.type for event in stream}
        final = stream.get_final_completion()
    assert "tool_calls.function.arguments.done" in kinds
    (call,) = final.choices[0].message.tool_calls or []
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_SCHEMA)


WRITTEN = {
    "python": ("", "`{'name': 'get_weather', 'arguments': {'city': 'Paris', 'unit': 'celsius'}}`"),
    "pretty": ("Here:", 'Here:\n```json\n{\n  "name": "get_weather",\n  "arguments": '
                        '{"city": "Paris", "unit": "celsius"}\n}\n```'),
    "element": ("Here:", """Here: <function name="get_weather" arguments='{"city": "Paris", """
                         """"unit": "celsius"}'>"""),
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("form", sorted(WRITTEN))
def test_a_call_written_loosely_is_a_call(oai: openai.OpenAI, stream: bool, form: str) -> None:
    """Qwen2.5-Coder-1.5B under cn wrote calls as a Python dict in inline code, and
    pretty-printed in a fence after text, under Codex CLI as an XML element (issue 42): the
    client gets a call it can run, not
    the call as text. The output is forced to that form by a regex (vLLM's
    structured_outputs), tools offered under tool_choice auto."""
    text, said = WRITTEN[form]
    body: dict[str, Any] = {"model": LLM, "messages": [{"role": "user", "content": ASK}],
                            "tools": OPENAI_TOOLS, "max_tokens": 64, "temperature": 0,
                            "extra_body": {"structured_outputs": {"regex": re.escape(said)}}}
    if stream:
        with oai.chat.completions.stream(**body) as events:
            done = events.get_final_completion()
    else:
        done = oai.chat.completions.create(**body)
    choice = done.choices[0]
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_weather"  # type: ignore[union-attr]
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "celsius"}  # type: ignore[union-attr]
    assert (choice.message.content or "").strip() == text
    assert choice.finish_reason == "tool_calls"


def test_openai_tool_call_delta_shapes(base_url: str) -> None:
    body = {"model": LLM, "messages": [{"role": "user", "content": ASK}], "tools": OPENAI_TOOLS,
            "tool_choice": "required", "parallel_tool_calls": False, "stream": True,
            "max_tokens": 64, "temperature": 0}
    with httpx.stream("POST", base_url + "/v1/chat/completions", json=body, timeout=60) as r:
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(ln) for ln in lines[:-1]]
    deltas = [c["choices"][0]["delta"].get("tool_calls") for c in chunks]
    tool_deltas = [d[0] for d in deltas if d]
    first, rest = tool_deltas[0], tool_deltas[1:]
    assert first["index"] == 0 and first["id"].startswith("call_")
    assert first["type"] == "function" and first["function"]["arguments"] == ""
    assert rest and all(set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
                        for d in rest)
    arguments = json.loads("".join(d["function"]["arguments"] for d in rest))
    jsonschema.validate(arguments, SCHEMAS[first["function"]["name"]])
    assert chunks[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None,
                                        "finish_reason": "tool_calls"}


def test_openai_tool_history(oai: openai.OpenAI) -> None:
    """An assistant turn with tool_calls (content null) and the tool's answer go back in."""
    messages: Any = [
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather",
                          "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 22 degrees"},
    ]
    resp = oai.chat.completions.create(model=LLM, messages=messages, tools=OPENAI_TOOLS,  # type: ignore[arg-type]
                                       tool_choice="none", max_tokens=32, temperature=0)
    assert resp.choices[0].message.content and resp.choices[0].message.tool_calls is None
    assert resp.choices[0].finish_reason in ("stop", "length")


# --- Ollama ----------------------------------------------------------------------------------


def get_weather(city: str, unit: str) -> str:
    """Get the current weather in a city.

    Args:
      city: The city, e.g. Paris
      unit: celsius or fahrenheit
    """
    return f"Sunny, 22 degrees {unit} in {city}"


def _ollama_schema() -> dict[str, Any]:
    return convert_function_to_tool(get_weather).model_dump(exclude_none=True)["function"][
        "parameters"]


def test_ollama_forced_tool_call(base_url: str) -> None:
    client = ollama.Client(host=base_url)
    opts = {"temperature": 0, "num_predict": 64, "tool_choice": "required"}
    resp = client.chat(model=LLM, messages=[{"role": "user", "content": ASK}],
                       tools=[get_weather], options=opts)
    (call,) = resp.message.tool_calls or []
    assert call.function.name == "get_weather" and isinstance(call.function.arguments, dict)
    jsonschema.validate(dict(call.function.arguments), _ollama_schema())
    chunks = list(client.chat(model=LLM, messages=[{"role": "user", "content": ASK}],
                              tools=[get_weather], options=opts, stream=True))
    with_calls = [c for c in chunks if c.message.tool_calls]
    assert len(with_calls) == 1 and not with_calls[0].done and chunks[-1].done
    assert with_calls[0].message.tool_calls[0].function.arguments == call.function.arguments  # type: ignore[index]


def test_ollama_tools_auto(base_url: str) -> None:
    """Without tool_choice the model decides (SmolLM2-135M answers in text); whatever it
    does comes back in a valid shape, and a call it makes has arguments that validate.

    NOTE: not asserted to repeat across requests: at temperature 0 the greedy text still
    changed with how much of the prompt the worker's prefix cache held.
    """
    client = ollama.Client(host=base_url)
    answer = client.chat(model=LLM, messages=[{"role": "user", "content": ASK}],
                         tools=[get_weather], options={"temperature": 0, "num_predict": 48})
    assert answer.done and answer.message.role == "assistant"
    for call in answer.message.tool_calls or []:
        assert call.function.name == "get_weather"
        jsonschema.validate(dict(call.function.arguments), _ollama_schema())
    if not answer.message.tool_calls:
        assert answer.message.content
    none = client.chat(model=LLM, messages=[{"role": "user", "content": ASK}],
                       tools=[get_weather], options={"temperature": 0, "num_predict": 8,
                                                    "tool_choice": "none"})
    assert not none.message.tool_calls and none.message.content


# --- LangChain -------------------------------------------------------------------------------


def test_langchain_chat_openai_bind_tools(base_url: str) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=LLM, base_url=base_url + "/v1", api_key="x",  # type: ignore[arg-type]
                     temperature=0, max_tokens=64, max_retries=0)  # type: ignore[call-arg]
    msg = llm.bind_tools([get_weather], tool_choice="get_weather").invoke(ASK)
    (call,) = msg.tool_calls  # type: ignore[attr-defined]
    assert call["name"] == "get_weather" and call["id"]
    jsonschema.validate(call["args"], _ollama_schema())


def test_langchain_chat_ollama_bind_tools(base_url: str) -> None:
    from langchain_ollama import ChatOllama

    llm = ChatOllama(model=LLM, base_url=base_url, temperature=0)
    # NOTE: ChatOllama ignores tool_choice (Ollama has none); the server's options extension
    # forces the call.
    bound = llm.bind_tools([get_weather], options={"temperature": 0, "num_predict": 64,
                                                   "tool_choice": "get_weather"})
    msg = bound.invoke(ASK)
    (call,) = msg.tool_calls  # type: ignore[attr-defined]
    assert call["name"] == "get_weather"
    jsonschema.validate(call["args"], _ollama_schema())


# --- models, as Anthropic's SDK lists them -----------------------------------------------


def test_anthropic_sdk_lists_and_retrieves_models(claude: anthropic.Anthropic,
                                                  oai: openai.OpenAI) -> None:
    openai_ids = [m.id for m in oai.models.list()]
    listed = list(claude.models.list())
    assert [m.id for m in listed] == openai_ids
    assert {"smollm2:135m", "all-minilm:l6-v2"} <= set(openai_ids)
    assert all(m.type == "model" and m.display_name == m.id for m in listed)
    assert listed[0].created_at.tzinfo is not None
    # NOTE: pages of one, followed through has_more/last_id by the SDK's own paging.
    first = claude.models.list(limit=1)
    assert len(first.data) == 1 and first.has_more is True
    assert [m.id for m in claude.models.list(limit=1)] == openai_ids
    model = claude.models.retrieve("smollm2:135m")
    assert model.id == "smollm2:135m" and model.type == "model"
    with pytest.raises(anthropic.NotFoundError) as info:
        claude.models.retrieve("no-such-model")
    assert info.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError):
        claude.models.list(limit=0)
