"""A tool call cut off by max_tokens comes back as a tool call (issue 42), as OpenAI returns
it: the tool, its arguments as far as they came and finish_reason "length" (Anthropic:
stop_reason "max_tokens"; Responses: status "incomplete"; Ollama: done_reason "length"), never
the server's JSON wrapper of a forced call as text. The call is forced (tool_choice required,
a named tool, Anthropic's any, Ollama's options.tool_choice), so the grammar, not the model,
decides its start; 5 tokens end it inside."""

from __future__ import annotations

import json

import anthropic
import httpx
import ollama
import openai

from npu_proxy.gateway.content.tools import Tool
from npu_proxy.gateway.content.tools.parsing import partial_call
from npu_proxy.gateway.content.tools.streaming import CallParser

LLM = "smollm2:135m"
PARAMS = {"type": "object", "properties": {"path": {"type": "string"},
                                           "content": {"type": "string"}},
          "required": ["path", "content"]}
TOOL = {"type": "function", "function": {"name": "write_file", "parameters": PARAMS}}
ASK = [{"role": "user", "content": "Write hello to a.txt"}]


def test_openai_chat_returns_the_cut_call(base_url: str) -> None:
    oai = openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=300)
    for stream in (False, True):
        kwargs = {"model": LLM, "messages": ASK, "tools": [TOOL], "max_tokens": 5,
                  "tool_choice": "required", "temperature": 0}
        if stream:
            chunks = list(oai.chat.completions.create(stream=True, **kwargs))  # type: ignore[call-overload]
            calls = [c.choices[0].delta.tool_calls for c in chunks
                     if c.choices and c.choices[0].delta.tool_calls]
            assert calls and calls[0][0].function.name == "write_file"
            assert chunks[-1].choices[0].finish_reason == "length"
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            done = oai.chat.completions.create(**kwargs)  # type: ignore[call-overload]
            choice = done.choices[0]
            assert choice.finish_reason == "length"
            assert choice.message.tool_calls and \
                choice.message.tool_calls[0].function.name == "write_file"
            text = choice.message.content or ""
        assert "{" not in text and "[" not in text


def test_responses_anthropic_and_ollama_return_the_cut_call(base_url: str) -> None:
    oai = openai.OpenAI(base_url=base_url + "/v1", api_key="x", max_retries=0, timeout=300)
    made = oai.responses.create(model=LLM, input="Write hello to a.txt", max_output_tokens=16,
                                tools=[{"type": "function", "name": "write_file",
                                        "parameters": PARAMS}],
                                tool_choice="required", temperature=0, store=False)
    # NOTE: the Responses API's least max_output_tokens is 16, which may end the call whole.
    calls = [item for item in made.output if item.type == "function_call"]
    assert calls and calls[0].name == "write_file"
    assert made.status == ("incomplete" if made.usage and made.usage.output_tokens == 16
                           else "completed")
    claude = anthropic.Anthropic(base_url=base_url, api_key="x", max_retries=0, timeout=300)
    msg = claude.messages.create(model=LLM, messages=ASK, max_tokens=5,  # type: ignore[arg-type]
                                 tools=[{"name": "write_file", "input_schema": PARAMS}],
                                 tool_choice={"type": "any"})
    assert msg.stop_reason == "max_tokens"
    assert [b.type for b in msg.content] == ["tool_use"] and msg.content[0].name == "write_file"  # type: ignore[union-attr]
    chat = ollama.Client(host=base_url, timeout=300).chat(
        model=LLM, messages=ASK, tools=[TOOL],
        options={"num_predict": 5, "temperature": 0, "tool_choice": "required"})
    assert chat.done_reason == "length"
    assert chat.message.tool_calls and chat.message.tool_calls[0].function.name == "write_file"
    assert "{" not in (chat.message.content or "")
    raw = httpx.post(base_url + "/v1/chat/completions", timeout=300, json={
        "model": LLM, "messages": ASK, "tools": [TOOL], "max_tokens": 5,
        "tool_choice": {"type": "function", "function": {"name": "write_file"}}})
    assert raw.json()["choices"][0]["finish_reason"] == "length", raw.text


def test_a_partial_call_keeps_the_arguments_as_far_as_they_came() -> None:
    tools = [Tool("write_file", "", PARAMS), Tool("read_file", "", PARAMS)]
    cut = '[{"name": "read_file", "arguments": {"path": "a.t'
    call = partial_call(cut, tools)
    assert call is not None and call.name == "read_file"
    assert call.arguments_json() == '{"path": "a.t'
    assert partial_call('[{"na', tools) is None  # no tool named, two offered
    assert partial_call('[{"na', tools[:1]) is not None  # the only one offered
    parser = CallParser(tools)
    parser.feed(cut)
    assert parser.finish(cut=True)[1][0].partial == '{"path": "a.t'
    parser = CallParser(tools)
    parser.feed(cut)
    assert parser.finish(cut=False) == (cut, [])  # not cut: as text, as before
    whole = json.dumps([{"name": "read_file", "arguments": {"path": "a"}}])
    parser = CallParser(tools)
    parser.feed(whole)
    assert parser.finish(cut=True)[1][0].arguments == {"path": "a"}
    # Written as a Python dict (Qwen2.5-Coder-1.5B under cn did so), cut: the same.
    call = partial_call("{'name': 'read_file', 'arguments': {'path': 'a.t", tools)
    assert call is not None and call.name == "read_file" and call.partial == "{'path': 'a.t"
    # A second call cut after a whole one: both calls, the second partial, no text.
    for second in (cut[1:], "<tool_call>" + cut[1:], "{'name': 'read_file', 'arguments': {"):
        first = '<tool_call>{"name": "write_file", "arguments": {"path": "b"}}</tool_call>' \
            if second.startswith("<") else whole[1:-1]
        parser = CallParser(tools)
        assert parser.feed(first + "\n" + second) == ""
        rest, calls = parser.finish(cut=True)
        assert rest == "" and len(calls) == 2 and calls[1].name == "read_file", (second, rest)
        assert calls[1].partial is not None and calls[1].partial.startswith("{")


def test_an_optional_argument_sent_as_null_is_dropped() -> None:
    """Codex refused a call with `session_id: null` for an integer: an optional argument the
    model sent as null, where the schema takes no null, is left out; a required one, or one
    whose schema takes null, stays."""
    from npu_proxy.gateway.content.tools.parsing import parse_calls

    params = {"type": "object", "required": ["cmd"], "properties": {
        "cmd": {"type": "string"}, "session_id": {"type": "integer"},
        "note": {"type": ["string", "null"]}, "free": {}}}
    tool = Tool("exec", "", params)
    text = json.dumps({"name": "exec", "arguments": {"cmd": None, "session_id": None,
                                                     "note": None, "free": None}})
    _, calls = parse_calls(text, [tool])
    assert calls[0].arguments == {"cmd": None, "note": None, "free": None}


def test_a_whole_number_written_with_a_fraction_is_sent_as_an_integer() -> None:
    """Codex refused a call with `session_id: 3870000.0` for an integer ("invalid type:
    floating point"): a whole number where the schema says integer goes out as an integer;
    a fraction, a number the schema takes as a number, or one too large for a float to hold
    exactly stays as written."""
    from npu_proxy.gateway.content.tools.parsing import parse_calls

    params = {"type": "object", "properties": {
        "session_id": {"type": "integer"}, "timeout": {"type": ["integer", "null"]},
        "ratio": {"type": "number"}, "half": {"type": "integer"}, "huge": {"type": "integer"},
        "cmd": {"type": "string"}}}
    tool = Tool("exec", "", params)
    text = ('{"name": "exec", "arguments": {"session_id": 3870000.0, "timeout": -2.0, '
            '"ratio": 2.0, "half": 1.5, "huge": 8e+69, "cmd": "ls"}}')
    _, calls = parse_calls(text, [tool])
    sent = json.loads(json.dumps(calls[0].arguments))
    assert sent == {"session_id": 3870000, "timeout": -2, "ratio": 2.0, "half": 1.5,
                    "huge": 8e+69, "cmd": "ls"}
    assert json.dumps(calls[0].arguments).startswith('{"session_id": 3870000, "timeout": -2,')
