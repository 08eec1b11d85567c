"""Limits (issue 14): each is a setting, answered in the caller's API's own error shape and
status before anything reaches a worker (gateway/api/limits.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import ollama
import openai
import pytest
from serverctl import Server

LLM = "smollm2:135m"
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


# --- a server with a low limit -------------------------------------------------------------

MAX_BODY = 4096


@pytest.fixture(scope="module")
def low(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = Server(tmp_path_factory.mktemp("limits"), workers=[{"name": "llm", "role": "llm"}],
                 max_body_bytes=MAX_BODY).start()
    yield srv
    srv.stop()


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
