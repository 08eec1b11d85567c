"""Limits (issue 14): each is a setting, answered in the caller's API's own error shape and
status before anything reaches a worker (gateway/api/limits.py)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import ollama
import openai
import pytest
from errors import error_message
from serverctl import Server, small_llm

LLM = "smollm2:135m"
CONTEXT = 8192  # smollm2:135m's max_position_embeddings
HI = [{"role": "user", "content": "hi"}]
BIG = 50 * 1024 * 1024  # over the default max_body_bytes (32 MiB)


def _workers(url: str) -> dict[str, tuple[Any, Any]]:
    rows = httpx.get(url + "/health/devices", timeout=10).json()["workers"]
    return {w["name"]: (w["pid"], w["restarts"]) for w in rows}


def _error(resp: httpx.Response) -> tuple[str, str | None]:
    """The message and the param of an error body, checked for its API's shape."""
    body = resp.json()
    path = resp.request.url.path
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
        return str(body["error"]["message"]), None
    if path.startswith("/v1/"):
        error = body["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "invalid_request_error"
        return str(error["message"]), error["param"]
    assert set(body) == {"error"} and isinstance(body["error"], str)
    return str(body["error"]), None


# --- the body ------------------------------------------------------------------------------


def test_a_50_mb_body_is_413_in_each_apis_shape_and_no_worker_is_touched(base_url: str) -> None:
    before = _workers(base_url)
    assert before["llm"][0] is not None
    text = "x" * BIG
    oai = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.APIStatusError) as oai_err:
        oai.chat.completions.create(model=LLM, messages=[{"role": "user", "content": text}])
    assert oai_err.value.status_code == 413
    assert oai_err.value.code == "request_too_large"
    assert "max_body_bytes" in oai_err.value.message
    assert oai_err.value.response.headers["x-request-id"]
    claude = anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.APIStatusError) as claude_err:
        claude.messages.create(model=LLM, max_tokens=8,
                               messages=[{"role": "user", "content": text}])
    assert claude_err.value.status_code == 413
    assert claude_err.value.body["error"]["type"] == "request_too_large"  # type: ignore[index]
    assert "max_body_bytes" in claude_err.value.body["error"]["message"]  # type: ignore[index]
    with pytest.raises(ollama.ResponseError) as ollama_err:
        ollama.Client(host=base_url).chat(model=LLM, messages=[{"role": "user", "content": text}])
    assert ollama_err.value.status_code == 413
    assert "max_body_bytes" in ollama_err.value.error
    assert _workers(base_url) == before


def _chunks(data: bytes, size: int = 64 * 1024) -> Iterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i:i + size]


def test_a_chunked_upload_is_counted_and_the_connection_stays_usable(base_url: str) -> None:
    before = _workers(base_url)
    big = b'{"model": "smollm2:135m", "messages": [{"role": "user", "content": "' + \
        b"x" * BIG + b'"}]}'
    with httpx.Client(base_url=base_url, timeout=120) as client:
        for path in ("/v1/chat/completions", "/api/chat", "/v1/messages"):
            # NOTE: a generator body has no Content-Length: httpx sends it chunked.
            r = client.post(path, content=_chunks(big),
                            headers={"content-type": "application/json"})
            assert r.status_code == 413, r.text
            assert "transfer-encoding" in r.request.headers
            message, _ = _error(r)
            assert "max_body_bytes" in message
        small = b'{"model": "smollm2:135m", "max_tokens": 1, "messages": [{"role": "user", ' \
            b'"content": "hi"}]}'
        r = client.post("/v1/chat/completions", content=_chunks(small, 16),
                        headers={"content-type": "application/json"})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "length"
    assert _workers(base_url) == before


# --- output beyond the context -------------------------------------------------------------


# NOTE: more than the context is clamped to it for every name (tests/test_context.py).
@pytest.mark.parametrize(("model", "max_tokens"), [
    (LLM, CONTEXT),  # the whole context may be asked for
    (LLM, 100_000),  # more: clamped to the room the prompt leaves
    ("claude-sonnet-4-5-20250929", 64_000),  # Claude Code's size, for a Claude model
])
def test_output_up_to_the_context_and_claude_names_are_served(
        base_url: str, model: str, max_tokens: int) -> None:
    body = {"model": model, "max_tokens": max_tokens, "stream": True, "messages": HI}
    with httpx.stream("POST", base_url + "/v1/messages", json=body, timeout=60) as r:
        assert r.status_code == 200
        # NOTE: the first event is enough; leaving aborts the generation.
        assert next(r.iter_lines()) == "event: message_start"


# --- counts and prompt length, on a server with low limits ---------------------------------

MAX_MESSAGES, MAX_TOOLS, MAX_CHARS, MAX_BODY, MAX_OBJECTS = 4, 2, 200, 4096, 40
RUN = uuid.uuid4().hex[:8]  # NOTE: the model cache is shared; names of this run are its own
MADE, ALIAS, COPY = (f"npx-test-{what}-{RUN}:latest" for what in ("made", "alias", "copy"))


@pytest.fixture(scope="module")
def low(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # NOTE: the small model (serverctl.small_llm): these tests see status codes and answers
    # of one token that end at max_tokens.
    srv = Server(tmp_path_factory.mktemp("limits"), workers=[{"name": "llm", "role": "llm"}],
                 max_messages=MAX_MESSAGES, max_tools=MAX_TOOLS, max_prompt_chars=MAX_CHARS,
                 max_body_bytes=MAX_BODY, max_json_objects=MAX_OBJECTS,
                 model_aliases={ALIAS: MADE}, models=small_llm()).start()
    yield srv
    srv.stop()


def _turns(n: int, chars: int = 2) -> list[dict[str, str]]:
    """n alternating messages, user first and last when n is odd, of `chars` characters."""
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": "y" * chars}
            for i in range(n)]


def _openai_tools(n: int) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {
        "name": f"f{i}", "description": "d", "parameters": {"type": "object", "properties": {}}}}
        for i in range(n)]


def _anthropic_tools(n: int) -> list[dict[str, Any]]:
    return [{"name": f"f{i}", "description": "d",
             "input_schema": {"type": "object", "properties": {}}} for i in range(n)]


def _ollama_tools(n: int) -> list[dict[str, Any]]:
    return _openai_tools(n)


OVER = {
    "max_messages": (_turns(MAX_MESSAGES + 1), 0, "messages"),
    "max_tools": (HI, MAX_TOOLS + 1, "tools"),
    "max_prompt_chars": (_turns(1, MAX_CHARS + 1), 0, "messages"),
}


@pytest.mark.parametrize("key", list(OVER))
def test_counts_over_the_limits_are_400_with_the_official_clients(low: Server,
                                                                   key: str) -> None:
    messages, tools, param = OVER[key]
    before = _workers(low.url)
    oai = openai.OpenAI(base_url=low.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as oai_err:
        oai.chat.completions.create(model=LLM, messages=messages, max_tokens=1,  # type: ignore[arg-type]
                                    **({"tools": _openai_tools(tools)} if tools else {}))
    assert key in oai_err.value.message and oai_err.value.param == param
    claude = anthropic.Anthropic(base_url=low.url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as claude_err:
        claude.messages.create(model=LLM, messages=messages, max_tokens=1,  # type: ignore[arg-type]
                               **({"tools": _anthropic_tools(tools)} if tools else {}))
    assert claude_err.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert key in claude_err.value.message
    with pytest.raises(anthropic.BadRequestError) as count_err:
        claude.messages.count_tokens(model=LLM, messages=messages,  # type: ignore[arg-type]
                                     **({"tools": _anthropic_tools(tools)} if tools else {}))
    assert key in count_err.value.message
    with pytest.raises(ollama.ResponseError) as ollama_err:
        ollama.Client(host=low.url).chat(model=LLM, messages=messages,
                                         tools=_ollama_tools(tools) if tools else None)
    assert ollama_err.value.status_code == 400 and key in ollama_err.value.error
    assert _workers(low.url) == before


def test_the_limits_are_named_with_their_numbers(low: Server) -> None:
    r = httpx.post(low.url + "/v1/chat/completions", timeout=60, json={
        "model": LLM, "messages": _turns(MAX_MESSAGES + 1)})
    message, _ = _error(r)
    assert f"{MAX_MESSAGES + 1} messages" in message and f"limit is {MAX_MESSAGES}" in message
    r = httpx.post(low.url + "/v1/messages", timeout=60, json={
        "model": LLM, "max_tokens": 1, "system": "s" * MAX_CHARS, "messages": HI})
    assert r.status_code == 400
    message, _ = _error(r)
    # NOTE: the system prompt counts; Claude Code offers to compact on these words.
    assert message.startswith("prompt is too long") and "max_prompt_chars" in message
    assert f"{MAX_CHARS + 2} characters" in message
    r = httpx.post(low.url + "/v1/chat/completions", timeout=60, json={
        "model": LLM, "messages": _turns(1, MAX_CHARS + 1)})
    assert r.json()["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/api/chat",
                                  "/v1/responses"])
def test_a_body_of_too_many_objects_is_refused_before_it_is_decoded(low: Server,
                                                                    path: str) -> None:
    """A million empty messages (a 30 MB body) took the gateway's event loop a second and
    107 MiB to decode before max_messages could be checked: the body's objects are counted
    first, so the refusal names max_json_objects, not max_messages."""
    field = "input" if path == "/v1/responses" else "messages"
    many: list[dict[str, Any]] = [{}] * MAX_OBJECTS  # with the body's own object, one over
    r = httpx.post(low.url + path, timeout=60,
                   json={"model": LLM, "max_tokens": 1, field: many})
    assert r.status_code == 400, r.text
    message = error_message(r)
    assert "max_json_objects" in message and f"limit is {MAX_OBJECTS}" in message, message
    # At the limit the body is decoded and checked as before.
    r = httpx.post(low.url + path, timeout=60,
                   json={"model": LLM, "max_tokens": 1, field: many[1:]})
    assert r.status_code == 400 and "max_json_objects" not in error_message(r)


def test_counts_are_checked_before_any_message_is_read(low: Server) -> None:
    """Too many messages, the last one bad: the count is what is refused (it is checked on
    the decoded list, before any per-message work), not the message."""
    messages = [*_turns(MAX_MESSAGES), {"role": "wizard", "content": "x"}]
    r = httpx.post(low.url + "/v1/chat/completions", timeout=60,
                   json={"model": LLM, "messages": messages})
    assert r.status_code == 400
    message, param = _error(r)
    assert "max_messages" in message and param == "messages", message


@pytest.mark.parametrize(("path", "body"), [
    ("/api/generate", {"prompt": "z" * (MAX_CHARS + 1)}),
    ("/api/generate", {"prompt": "z" * MAX_CHARS, "system": "s"}),
    ("/api/generate", {"prompt": "z" * (MAX_CHARS + 1), "raw": True}),
    ("/v1/completions", {"prompt": "z" * (MAX_CHARS + 1)}),
])
def test_a_long_prompt_is_400(low: Server, path: str, body: dict[str, Any]) -> None:
    r = httpx.post(low.url + path, json={"model": LLM, "stream": False, **body}, timeout=60)
    assert r.status_code == 400, r.text
    message, param = _error(r)
    assert "max_prompt_chars" in message and param in (None, "prompt", "messages")


def test_requests_at_the_limits_are_served(low: Server) -> None:
    oai = openai.OpenAI(base_url=low.url + "/v1", api_key="unused", max_retries=0)
    resp = oai.chat.completions.create(  # type: ignore[call-overload]
        model=LLM, max_tokens=1,
        messages=[{"role": "system", "content": "s"}, *_turns(MAX_MESSAGES - 1)])
    assert resp.choices[0].finish_reason == "length"
    # NOTE: tool definitions count too (about 90 characters each here).
    resp = oai.chat.completions.create(  # type: ignore[call-overload]
        model=LLM, max_tokens=1, tools=_openai_tools(MAX_TOOLS),
        messages=[{"role": "user", "content": "hi"}])
    assert resp.choices[0].finish_reason in ("length", "stop")
    r = httpx.post(low.url + "/api/generate", timeout=60, json={
        "model": LLM, "stream": False, "prompt": "z" * MAX_CHARS,
        "options": {"num_predict": 1}})
    assert r.status_code == 200, r.text


def _sized(size: int) -> bytes:
    """A valid chat request of exactly `size` bytes (padded with JSON whitespace)."""
    body = b'{"model": "smollm2:135m", "max_tokens": 1, "messages": [{"role": "user", ' \
        b'"content": "hi"}]}'
    return body + b" " * (size - len(body))


@pytest.mark.parametrize("chunked", [False, True])
def test_the_body_limit_is_exact(low: Server, chunked: bool) -> None:
    def post(data: bytes) -> httpx.Response:
        content = _chunks(data, 1000) if chunked else data
        return httpx.post(low.url + "/v1/chat/completions", content=content, timeout=60,
                          headers={"content-type": "application/json"})

    assert post(_sized(MAX_BODY)).status_code == 200
    r = post(_sized(MAX_BODY + 1))
    assert r.status_code == 413
    message, _ = _error(r)
    assert str(MAX_BODY) in message and "max_body_bytes" in message


def test_the_limits_are_in_the_configuration(tmp_path: Path) -> None:
    from npu_proxy.protocol.config import Config, load_config

    defaults = Config()
    assert defaults.max_body_bytes == 32 * 1024 * 1024
    assert (defaults.max_messages, defaults.max_tools, defaults.max_prompt_chars) == \
        (10_000, 256, 1_000_000)
    path = tmp_path / "c.toml"
    path.write_text("max_body_bytes = 1000\nmax_messages = 5\nmax_tools = 6\n"
                    "max_prompt_chars = 7\n")
    config = load_config(path, env={})
    assert (config.max_body_bytes, config.max_messages, config.max_tools,
            config.max_prompt_chars) == (1000, 5, 6, 7)


def test_tool_text_counts_against_the_prompt_limit(low: Server) -> None:
    """json.dumps writes 1e15 as 1000000000000000.0: eight such numbers (a body well under
    the limit) are a prompt over it, refused before the tool text is built."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"n": {"enum": [1e15] * 8}}}}}
    r = httpx.post(low.url + "/v1/chat/completions", timeout=60, json={
        "model": LLM, "messages": HI, "max_tokens": 1, "tools": [tool]})
    assert r.status_code == 400, r.text
    message, _ = _error(r)
    assert message.startswith("prompt is too long") and "max_prompt_chars" in message
    r = httpx.post(low.url + "/api/chat", timeout=60, json={
        "model": LLM, "messages": HI, "stream": False, "tools": [tool]})
    assert r.status_code == 400 and "max_prompt_chars" in _error(r)[0]


def test_delete_acts_only_on_the_name_given(low: Server) -> None:
    """Deleting a configured alias once deleted its target; deleting a model that copies
    point at took the copies with it."""
    http = httpx.Client(base_url=low.url, timeout=120)

    def listed() -> set[str]:
        return {m["name"] for m in http.get("/api/tags").json()["models"]}

    def delete(name: str) -> httpx.Response:
        return http.request("DELETE", "/api/delete", json={"model": name})

    assert http.post("/api/create", json={"model": MADE, "from": LLM,
                                          "system": "Be brief."}).status_code == 200
    try:
        r = delete(ALIAS)
        assert r.status_code == 400, r.text
        assert f"alias of '{MADE}'" in _error(r)[0]
        assert MADE in listed()
        r = http.post("/api/copy", json={"source": MADE, "destination": ALIAS})
        assert r.status_code == 400 and "config file" in _error(r)[0]
        assert http.post("/api/copy", json={"source": MADE, "destination": COPY}) \
            .status_code == 200
        r = delete(MADE)
        assert r.status_code == 400 and COPY in _error(r)[0]
        assert {MADE, COPY} <= listed()
        assert delete(COPY).status_code == 200
        assert MADE in listed() and COPY not in listed()
    finally:
        delete(COPY)
        assert delete(MADE).status_code == 200
    assert MADE not in listed()
