"""What real agent clients send, and the one rule for what the server does not act on
(docs/api-fields.md): mapped, ignored visibly (`X-NPU-Proxy-Ignored`), or a 400.

`ROWS` holds one case per row of docs/api-fields.md (same ids); the recorded bodies of Codex
CLI, Claude Code, opencode, qwen-code and Continue (tests/fixtures/clients/, their prompt text
replaced by placeholders) go to the shared server as they are. Calls are made deterministic by
forcing them (tool_choice) or by forcing the output's JSON (a response format), never by
hoping the 135M model writes one.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from serverctl import Server, wait_for

from npu_proxy.models.locate import locate

LLM = "smollm2:135m"
HEADER = "x-npu-proxy-ignored"
FIXTURES = Path(__file__).parent / "fixtures" / "clients"
DOC = Path(__file__).resolve().parent.parent / "docs" / "api-fields.md"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def _fixture(name: str) -> dict[str, Any]:
    return dict(json.loads((FIXTURES / name).read_text()))


def _ignored(r: httpx.Response) -> set[str]:
    return {n.strip() for n in r.headers.get(HEADER, "").split(",") if n.strip()}


def _post(base: str, path: str, body: dict[str, Any]) -> httpx.Response:
    headers = {"anthropic-version": "2023-06-01"} if path.startswith("/v1/messages") else {}
    return httpx.post(base + path, json=body, headers=headers, timeout=120)


def _responses(base: str, **body: Any) -> httpx.Response:
    return _post(base, "/v1/responses", {"model": LLM, "input": "Hi", "max_output_tokens": 8,
                                         **body})


def _messages(base: str, **body: Any) -> httpx.Response:
    return _post(base, "/v1/messages", {"model": LLM, "max_tokens": 8,
                                        "messages": [{"role": "user", "content": "Hi"}],
                                        **body})


def _count(base: str, **body: Any) -> int:
    r = _post(base, "/v1/messages/count_tokens",
              {"model": LLM, "messages": [{"role": "user", "content": "Hi"}], **body})
    assert r.status_code == 200, r.text
    return int(r.json()["input_tokens"])


def _ok(r: httpx.Response) -> dict[str, Any]:
    assert r.status_code == 200, r.text
    return dict(r.json())


# --- Responses rows --------------------------------------------------------------------------


def r_function(base: str) -> None:
    tool = {"type": "function", "name": "weather", "parameters": WEATHER, "strict": False}
    body = _ok(_responses(base, tools=[tool], max_output_tokens=40,
                          tool_choice={"type": "function", "name": "weather"}))
    (call,) = [o for o in body["output"] if o["type"] == "function_call"]
    assert call["name"] == "weather" and "namespace" not in call
    assert body["tools"][0]["strict"] is False


def r_namespace(base: str) -> None:
    space = {"type": "namespace", "name": "agents", "description": "Sub-agents.",
             "tools": [{"type": "function", "name": "spawn_agent", "parameters": WEATHER}]}
    r = _responses(base, tools=[space], max_output_tokens=40,
                   tool_choice={"type": "function", "name": "spawn_agent"})
    (call,) = [o for o in _ok(r)["output"] if o["type"] == "function_call"]
    assert call["name"] == "spawn_agent" and call["namespace"] == "agents"
    assert isinstance(json.loads(call["arguments"])["city"], str)


def r_custom(base: str) -> None:
    """NOTE: the output is forced to the call's JSON with a short input: a forced free-text
    input runs to max_output_tokens on the 135M model (it repeats itself)."""
    tool = {"type": "custom", "name": "apply_patch", "description": "Apply a patch."}
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
              "properties": {"name": {"const": "apply_patch"}, "arguments": {
                  "type": "object", "additionalProperties": False, "required": ["input"],
                  "properties": {"input": {"const": "*** Begin Patch"}}}}}
    r = _responses(base, tools=[tool], max_output_tokens=40,
                   text={"format": {"type": "json_schema", "name": "c", "schema": schema}})
    (call,) = [o for o in _ok(r)["output"] if o["type"] == "custom_tool_call"]
    assert call["name"] == "apply_patch" and call["input"] == "*** Begin Patch"
    assert "arguments" not in call and call["call_id"]


def r_custom_format(base: str) -> None:
    tool = {"type": "custom", "name": "apply_patch",
            "format": {"type": "grammar", "syntax": "regex", "definition": "[a-z]+"}}
    assert _ignored(_responses(base, tools=[tool])) == {"tools:custom.format"}


HOSTED = [{"type": "web_search", "external_web_access": False},
          {"type": "file_search", "vector_store_ids": ["vs_1"]},
          {"type": "code_interpreter", "container": {"type": "auto"}},
          {"type": "mcp", "server_label": "x", "server_url": "http://127.0.0.1:1"},
          {"type": "computer_use_preview", "display_width": 1, "display_height": 1,
           "environment": "linux"},
          {"type": "image_generation"}]


def r_hosted(base: str) -> None:
    r = _responses(base, tools=HOSTED)
    _ok(r)
    assert _ignored(r) == {f"tools:{t['type']}" for t in HOSTED}


def r_hosted_choice(base: str) -> None:
    r = _responses(base, tools=HOSTED[:1], tool_choice={"type": "web_search"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"


def r_developer(base: str) -> None:
    def tokens(role: str) -> int:
        body = _ok(_responses(base, input=[{"role": role, "content": "Be brief."},
                                           {"role": "user", "content": "Hi"}]))
        return int(body["usage"]["input_tokens"])

    assert tokens("developer") == tokens("system")


def r_reasoning_foreign(base: str) -> None:
    items = [{"role": "user", "content": "Hi"},
             {"type": "reasoning", "summary": [], "encrypted_content": "gAAAAABfromelsewhere"},
             {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}]
    r = _responses(base, input=items, store=False)
    _ok(r)
    assert _ignored(r) == {"input:reasoning.encrypted_content"}


def r_summary(base: str) -> None:
    r = _responses(base, reasoning={"summary": "auto"})
    assert _ok(r)["reasoning"]["summary"] == "auto"
    assert _ignored(r) == {"reasoning.summary"}


def r_accepted(base: str) -> None:
    r = _responses(base, prompt_cache_key="k", client_metadata={"turn_id": "t"}, store=False,
                   parallel_tool_calls=True, safety_identifier="u", service_tier="auto")
    assert _ok(r)["store"] is False and HEADER not in r.headers


def r_hosted_item(base: str) -> None:
    items = [{"role": "user", "content": "Hi"},
             {"type": "web_search_call", "id": "ws_1", "status": "completed",
              "action": {"type": "search", "query": "x"}},
             {"role": "user", "content": "Bye"}]
    r = _responses(base, input=items)
    _ok(r)
    assert _ignored(r) == {"input:web_search_call"}


def r_named_output(base: str) -> None:
    """Codex CLI 0.171 sends a function_call_output of its own making (its goal) with a name
    and a namespace, no call_id (issue 42: a 400 ended Codex's run): it reaches the model as a
    tool result; its namespace, not printed, is in the header. Neither id nor name: 400."""
    goal = {"type": "function_call_output", "id": "fco_1", "name": "goal_objective",
            "namespace": "agent", "output": "Create greet.py that prints Hello, World!"}
    ask = {"role": "user", "content": "Go on."}
    alone = _ok(_responses(base, input=[ask], max_output_tokens=1))
    r = _responses(base, input=[goal, ask], max_output_tokens=1)
    assert _ok(r)["usage"]["input_tokens"] > alone["usage"]["input_tokens"] + 8
    assert _ignored(r) == {"input:function_call_output.namespace"}
    nameless = {k: v for k, v in goal.items() if k != "name"}
    refused = _responses(base, input=[nameless, ask])
    assert refused.status_code == 400 and "call_id" in refused.json()["error"]["message"]


def r_background(base: str) -> None:
    for extra in ({"background": True}, {"conversation": "conv_1"},
                  {"prompt": {"id": "pmpt_1"}}):
        assert _responses(base, **extra).status_code == 400


def r_file(base: str) -> None:
    items = [{"role": "user", "content": [{"type": "input_file", "file_id": "file-1"}]}]
    assert _responses(base, input=items).status_code == 400


# --- Anthropic rows --------------------------------------------------------------------------


TURN = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Bye"}]


def _billing(n: int) -> str:
    return (f"x-anthropic-billing-header: cc_version=2.1.328.a{n}c; cc_entrypoint=cli; "
            f"cch=f{n:04d};")


def a_billing_line(base: str) -> None:
    """Claude Code's billing line (its `cch` new in every request) is not in the prompt, where
    it would defeat the prefix cache from the first tokens on."""
    system = "You are a terse assistant."
    plain = _count(base, system=system)
    for n in (1, 2):
        as_block = [{"type": "text", "text": _billing(n)}, {"type": "text", "text": system}]
        assert _count(base, system=as_block) == _count(base, system=f"{_billing(n)}\n{system}") \
            == plain
    r = _messages(base, max_tokens=1, system=[{"type": "text", "text": _billing(3)},
                                              {"type": "text", "text": system}])
    assert _ok(r)["usage"]["input_tokens"] == plain
    assert _ignored(r) == {"system.x-anthropic-billing-header"}


def a_system_turn(base: str) -> None:
    """Claude Code's system turn after the user's message goes after the system prompt, so
    that the model's turn follows the user's message, not 9 KB of environment."""
    mid = [*TURN[:1], {"role": "system", "content": [{"type": "text", "text": "Be brief.",
                                                       "cache_control": {"type": "ephemeral"}}]},
           *TURN[1:]]
    joined = _count(base, system="You are terse.\n\nBe brief.", messages=TURN)
    assert joined > _count(base, system="You are terse.", messages=TURN)
    sent = _ok(_messages(base, system="You are terse.", messages=mid))
    assert sent["usage"]["input_tokens"] == _count(base, system="You are terse.", messages=mid) \
        == joined
    assert _count(base, messages=mid) == _count(base, system="Be brief.", messages=TURN)


def a_defined_tools(base: str) -> None:
    for kind, name in (("bash_20250124", "bash"),
                       ("text_editor_20250728", "str_replace_based_edit_tool"),
                       ("memory_20250818", "memory")):
        bare = [{"name": name, "input_schema": {"type": "object"}}]
        assert _count(base, tools=[{"type": kind, "name": name}]) > _count(base, tools=bare)
    body = _ok(_messages(base, tools=[{"type": "bash_20250124", "name": "bash"}], max_tokens=40,
                         tool_choice={"type": "tool", "name": "bash"}))
    (use,) = [b for b in body["content"] if b["type"] == "tool_use"]
    assert use["name"] == "bash" and isinstance(use["input"], dict)


def a_server_tools(base: str) -> None:
    tools = [{"type": "web_search_20250305", "name": "web_search", "max_uses": 1},
             {"type": "code_execution_20250825", "name": "code_execution"}]
    r = _messages(base, tools=tools)
    _ok(r)
    assert _ignored(r) == {"tools:web_search_20250305", "tools:code_execution_20250825"}


def a_document_text(base: str) -> None:
    doc = {"type": "document", "title": "Notes",
           "source": {"type": "text", "media_type": "text/plain", "data": "Paris is big."}}
    with_doc = [{"role": "user", "content": [doc, {"type": "text", "text": "Hi"}]}]
    _ok(_messages(base, messages=with_doc))
    assert _count(base, messages=with_doc) > _count(base)


def a_document_pdf(base: str) -> None:
    doc = {"type": "document", "source": {"type": "base64", "media_type": "application/pdf",
                                          "data": "JVBERi0="}}
    r = _messages(base, messages=[{"role": "user", "content": [doc]}])
    assert r.status_code == 400 and r.json()["type"] == "error"


def a_server_results(base: str) -> None:
    history = [{"role": "user", "content": "Search"},
               {"role": "assistant", "content": [
                   {"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search",
                    "input": {"query": "x"}},
                   {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1",
                    "content": [{"type": "web_search_result", "title": "X",
                                 "url": "https://example.com", "encrypted_content": "e"}]},
                   {"type": "text", "text": "Found."}]},
               {"role": "user", "content": "Thanks"}]
    _ok(_messages(base, messages=history))


def a_accepted(base: str) -> None:
    r = _post(base, "/v1/messages?beta=true", {
        "model": LLM, "max_tokens": 8, "metadata": {"user_id": "u"},
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral"}}]}],
        "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        "tools": [{"name": "later", "input_schema": {"type": "object"}, "defer_loading": True}],
        "thinking": {"type": "adaptive", "display": "omitted"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "high"}})
    assert _ok(r)["type"] == "message" and HEADER not in r.headers


def a_deferred_tools(base: str) -> None:
    later = {"name": "later", "description": "A tool found by a tool search.",
             "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}},
             "defer_loading": True}
    now = {"name": "now", "input_schema": {"type": "object"}}
    assert _count(base, tools=[now, later]) == _count(base, tools=[now])
    found = [{"role": "user", "content": "Find a tool"},
             {"role": "assistant", "content": [
                 {"type": "tool_use", "id": "toolu_1", "name": "now", "input": {}}]},
             {"role": "user", "content": [
                 {"type": "tool_result", "tool_use_id": "toolu_1",
                  "content": [{"type": "tool_reference", "tool_name": "later"}]}]}]
    assert _count(base, tools=[now, later], messages=found) > \
        _count(base, tools=[now], messages=found)
    assert _count(base, tools=[now, later], tool_choice={"type": "tool", "name": "later"}) > \
        _count(base, tools=[now], tool_choice={"type": "tool", "name": "now"})


# --- every API: a bare JSON call -------------------------------------------------------------


def _call_schema(name: str) -> dict[str, Any]:
    return {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
            "properties": {"name": {"const": name}, "arguments": {
                "type": "object", "additionalProperties": False, "required": ["city"],
                "properties": {"city": {"const": "Paris"}}}}}


def _bare(base: str, api: str, name: str) -> tuple[list[tuple[str, Any]], str]:
    """Tools offered (auto), the output forced to `{"name": name, "arguments": {...}}`; the
    calls found (name, arguments) and the text."""
    schema = _call_schema(name)
    fn = {"name": "weather", "description": "Weather in a city.", "parameters": WEATHER}
    user = [{"role": "user", "content": "Weather in Paris?"}]
    if api == "openai":
        b = _ok(_post(base, "/v1/chat/completions", {
            "model": LLM, "messages": user, "max_tokens": 40,
            "tools": [{"type": "function", "function": fn}],
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "c", "schema": schema}}}))
        m = b["choices"][0]["message"]
        return [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                for c in m.get("tool_calls") or []], m["content"] or ""
    if api == "ollama":
        b = _ok(_post(base, "/api/chat", {
            "model": LLM, "messages": user, "stream": False, "format": schema,
            "options": {"num_predict": 40}, "tools": [{"type": "function", "function": fn}]}))
        m = b["message"]
        return [(c["function"]["name"], c["function"]["arguments"])
                for c in m.get("tool_calls") or []], m["content"]
    if api == "anthropic":
        b = _ok(_messages(base, messages=user, max_tokens=40,
                          tools=[{"name": "weather", "input_schema": WEATHER}],
                          output_config={"format": {"type": "json_schema", "schema": schema}}))
        return [(c["name"], c["input"]) for c in b["content"] if c["type"] == "tool_use"], \
            "".join(c.get("text", "") for c in b["content"] if c["type"] == "text")
    b = _ok(_responses(base, input=user, max_output_tokens=40,
                       tools=[{"type": "function", **fn}],
                       text={"format": {"type": "json_schema", "name": "c", "schema": schema}}))
    calls = [(o["name"], json.loads(o["arguments"])) for o in b["output"]
             if o["type"] == "function_call"]
    texts = [p["text"] for o in b["output"] if o["type"] == "message" for p in o["content"]]
    return calls, "".join(texts)


def _bare_call(api: str) -> Callable[[str], None]:
    def check(base: str) -> None:
        calls, text = _bare(base, api, "weather")
        assert calls == [("weather", {"city": "Paris"})] and text == ""

    return check


def x_bare_undeclared(base: str) -> None:
    for api in ("openai", "ollama", "anthropic", "responses"):
        calls, text = _bare(base, api, "nowhere")
        assert calls == [] and json.loads(text)["name"] == "nowhere"


ROWS: dict[str, Callable[[str], None]] = {
    "R-function": r_function, "R-namespace": r_namespace, "R-custom": r_custom,
    "R-custom-format": r_custom_format, "R-hosted": r_hosted,
    "R-hosted-choice": r_hosted_choice, "R-developer": r_developer,
    "R-reasoning-foreign": r_reasoning_foreign, "R-summary": r_summary,
    "R-accepted": r_accepted, "R-hosted-item": r_hosted_item,
    "R-named-output": r_named_output, "R-background": r_background,
    "R-file": r_file,
    "A-billing-line": a_billing_line, "A-system-turn": a_system_turn,
    "A-defined-tools": a_defined_tools,
    "A-server-tools": a_server_tools, "A-document-text": a_document_text,
    "A-document-pdf": a_document_pdf, "A-server-results": a_server_results,
    "A-accepted": a_accepted, "A-deferred-tools": a_deferred_tools,
    **{f"X-bare-call-{api}": _bare_call(api)
       for api in ("openai", "ollama", "anthropic", "responses")},
    "X-bare-undeclared": x_bare_undeclared,
}
# Rows shown by the thinking model's server below (a reasoning model is needed).
THINKING_ROWS = {"R-reasoning-replay", "R-include-encrypted"}


@pytest.mark.parametrize("row", sorted(ROWS))
def test_field_row(base_url: str, row: str) -> None:
    ROWS[row](base_url)


def test_a_moved_system_turn_is_logged(server: Server) -> None:
    """The A-system-turn move changes where the client's text stands: it is not silent, the
    gateway's log names it and the request."""
    mid = [*TURN[:1], {"role": "system", "content": "Be brief."}, *TURN[1:]]
    r = httpx.post(server.url + "/v1/messages", timeout=120,
                   headers={"anthropic-version": "2023-06-01", "X-Request-ID": "moved-system-1"},
                   json={"model": LLM, "max_tokens": 4, "messages": mid})
    _ok(r)
    wanted = "messages[1] (role system) appended to the system prompt"
    # NOTE: the gateway logs through a queue: waited for, not read at once.
    wait_for(lambda: any(wanted in line and "moved-system-1" in line
                         for line in server.worker_log("gateway").splitlines()),
             timeout=30, what="the move in the gateway's log")


def test_every_row_has_a_test() -> None:
    text = DOC.read_text()
    ids = set(re.findall(r"^\| (R-[a-z-]+|A-[a-z-]+|X-bare-undeclared) \|", text, re.M))
    ids |= set(re.findall(r"X-bare-call-[a-z]+", text))
    assert ids == set(ROWS) | THINKING_ROWS


# --- the recorded clients' bodies ------------------------------------------------------------


def _events(r: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")
            and line != "data: [DONE]"]


def test_codex_request_as_recorded(base_url: str) -> None:
    """Codex CLI's first Responses request: developer messages, function, namespace and
    web_search tools, include encrypted reasoning, summary auto, store false. NOTE: one field
    added, max_output_tokens, so that the 135M model's answer stays short."""
    body = _fixture("codex-responses.json")["body"]
    body["max_output_tokens"] = 16
    with httpx.stream("POST", base_url + "/v1/responses", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        assert _ignored(r) == {"tools:web_search", "reasoning.summary"}
        events = _events(r)
    assert events[0]["type"] == "response.created"
    assert events[-1]["type"] in ("response.completed", "response.incomplete")
    final = events[-1]["response"]
    assert {o["type"] for o in final["output"]} <= {"message", "function_call"}
    assert final["store"] is False


def test_claude_code_request_as_recorded(base_url: str) -> None:
    """Claude Code's first request: a `system` message after the user's, adaptive thinking,
    context_management, output_config.effort, 12 tools (one defer_loading), `?beta=true`.
    NOTE: the model name is a `claude-*` name (what Claude Code asks for by default), whose
    max_tokens 32000 is served up to the context; the stream is closed after the first text."""
    for name in ("claude-messages.json", "claude-messages-turn2.json"):
        body = {**_fixture(name)["body"], "model": "claude-sonnet-4-5"}
        with httpx.stream("POST", base_url + "/v1/messages?beta=true", json=body, timeout=120,
                          headers={"anthropic-version": "2023-06-01",
                                   "anthropic-beta": "claude-code-20250219"}) as r:
            assert r.status_code == 200, r.read()
            assert HEADER not in r.headers
            kinds = []
            for line in r.iter_lines():
                if line.startswith("event: "):
                    kinds.append(line[7:])
                    if kinds[-1] == "content_block_delta":
                        break
    assert kinds[:2] == ["message_start", "ping"] and "content_block_start" in kinds


@pytest.mark.parametrize("name", ["opencode-chat.json", "qwen-chat.json", "cn-chat.json"])
def test_chat_clients_as_recorded(base_url: str, name: str) -> None:
    """opencode, qwen-code and Continue: chat completions with function tools, streamed with
    usage. NOTE: max_tokens lowered to 8, so that the answer stays short."""
    body = {**_fixture(name)["body"], "max_tokens": 8, "model": LLM}
    r = httpx.post(base_url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    chunks = _events(r)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens"] > 0


# --- the official SDKs -----------------------------------------------------------------------


def test_openai_sdk_namespace_tool(base_url: str) -> None:
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0,
                           _strict_response_validation=True)
    resp = client.responses.create(
        model=LLM, input="Start a helper for Paris.", max_output_tokens=40,
        tools=[{"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.",
                "tools": [{"type": "function", "name": "spawn_agent", "parameters": WEATHER}]},
               {"type": "web_search"}],
        tool_choice={"type": "function", "name": "spawn_agent"}, store=False,
        include=["reasoning.encrypted_content"], prompt_cache_key="k")
    (call,) = [o for o in resp.output if o.type == "function_call"]
    assert call.name == "spawn_agent" and call.namespace == "multi_agent_v1"


def test_anthropic_sdk_system_message_mid_conversation(base_url: str) -> None:
    client = anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0)
    raw = client.messages.with_raw_response.create(
        model=LLM, max_tokens=8, messages=[
            {"role": "user", "content": "Hi"},
            {"role": "system", "content": "Answer in French."},  # type: ignore[misc,list-item]
        ])
    assert raw.http_response.status_code == 200
    assert raw.parse().content[0].type == "text"


# --- a thinking model: encrypted reasoning, read back ----------------------------------------

THINKER = "thinker:shapes"
# NOTE: renders an assistant turn's reasoning_content, so a replayed reasoning shows in the
# prompt's token count; the worker's force_regex makes the 135M model think in this shape.
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.reasoning_content %}<think>"
    "{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
REGEX = r"<think>\n[a-z]{2,6}( [a-z]{2,6}){2,3}\n</think>\n\n[A-Z][a-z]{1,5}( [a-z]{2,6}){2,3}\."


@pytest.fixture(scope="module")
def thinker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("shapes-thinker")
    gguf = locate(Server(tmp / "probe").config, LLM).path
    srv = Server(tmp, workers=[{"name": "think", "role": "llm", "model": THINKER,
                                "faults": {"force_regex": REGEX}}],
                 models={THINKER: {"path": str(gguf), "chat_template": TEMPLATE}}).start()
    yield srv.url
    srv.stop()


def test_encrypted_reasoning_replays(thinker: str) -> None:
    """R-include-encrypted and R-reasoning-replay: Codex's stateless multi-turn."""
    ask = {"model": THINKER, "input": "Capital of France?", "max_output_tokens": 96,
           "store": False, "include": ["reasoning.encrypted_content"]}
    first = _ok(_post(thinker, "/v1/responses", ask))
    (rs,) = [o for o in first["output"] if o["type"] == "reasoning"]
    assert rs["summary"] == [] and isinstance(rs["encrypted_content"], str)
    said = [o for o in first["output"] if o["type"] == "message"]
    replay = {"type": "reasoning", "id": rs["id"], "summary": [],
              "encrypted_content": rs["encrypted_content"]}

    def tokens(items: list[dict[str, Any]]) -> tuple[int, set[str]]:
        r = _post(thinker, "/v1/responses", {**ask, "input": items})
        return int(_ok(r)["usage"]["input_tokens"]), _ignored(r)

    user = [{"role": "user", "content": "Capital of France?"}]
    follow = [{"role": "user", "content": "And Spain?"}]
    plain, _ = tokens([*user, *said, *follow])
    replayed, ignored = tokens([*user, replay, *said, *follow])
    assert replayed > plain and ignored == set()
    tampered = {**replay, "encrypted_content": rs["encrypted_content"][:-4] + "AAAA"}
    again, ignored = tokens([*user, tampered, *said, *follow])
    assert again == plain and ignored == {"input:reasoning.encrypted_content"}
