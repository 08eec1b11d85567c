"""A stream that is silent (a long prefill) sends its API's keep-alive, and clients still parse it.

The worker's test hook `hold_start_dir` holds each request after the worker accepted it (the
response's headers are out) and before its first step, until a file named after the request's
X-Request-ID exists: a prefill as long as the test wants. The client's transport releases that
gate itself on the first keep-alive it reads, so every stream below shows one before its first
token, or (without keep-alives) waits until the client's read timeout fails the test. The hook
`force_regex` makes the 135M model answer exactly "ok" through every API.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import httpx2
import ollama
import openai
import pytest
from serverctl import Server, gated_server, small_llm

LLM = "smollm2:135m"
ANSWER = "ok"
COMMENT = b": keep-alive\n\n"
PING = b"event: ping\n"
# The chat keep-alive: a chunk whose delta adds nothing (the stream's first chunk also names
# the role, so this is a keep-alive alone).
CHAT_KEEPALIVE = b'"delta":{"content":""}'
TEXT_KEEPALIVE = b'"text":"","logprobs":null,"finish_reason":null'
# What each agent client counts as activity (tests/fixtures/keepalive.json).
CLIENTS = json.loads((Path(__file__).parent / "fixtures" / "keepalive.json").read_text())[
    "clients"]


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # NOTE: the small model (serverctl.small_llm), which never ends by itself: force_regex
    # ends every answer ("stop") after its "ok", whatever model writes it.
    server = gated_server(tmp_path_factory.mktemp("keepalive"),
                          {"faults": {"force_regex": ANSWER}}, stream_keepalive_seconds=0.1,
                          models=small_llm())
    yield server
    server.stop()


class Releasing:
    """Records a response's bytes and opens the request's gate once `marker` was read
    `count` times: the transport of an httpx client (or of httpx2's, which the Anthropic SDK
    uses: `mod`)."""

    def __init__(self, gate: Path, marker: bytes, count: int) -> None:
        self.gate, self.marker, self.count = gate, marker, count
        self.seen = bytearray()

    def read(self, chunks: Iterable[bytes]) -> Iterator[bytes]:
        for chunk in chunks:
            self.seen.extend(chunk)
            if self.seen.count(self.marker) >= self.count:
                self.gate.touch()  # the keep-alive arrived: the "prefill" may end
            yield chunk

    def transport(self, mod: Any = httpx) -> Any:
        tee = self

        class Stream(mod.SyncByteStream):  # type: ignore[misc,name-defined]
            def __init__(self, inner: Any) -> None:
                self.inner = inner

            def __iter__(self) -> Iterator[bytes]:
                return tee.read(self.inner)

            def close(self) -> None:
                self.inner.close()

        class Transport(mod.HTTPTransport):  # type: ignore[misc,name-defined]
            def handle_request(self, request: Any) -> Any:
                response = super().handle_request(request)
                response.stream = Stream(response.stream)
                return response

        return Transport()


def _client(srv: Server, rid: str, marker: bytes, count: int = 1,
            mod: Any = httpx) -> tuple[Any, Releasing]:
    tee = Releasing(srv.gates / rid, marker, count)
    # NOTE: a stream that never sends the keep-alive is never released: the read timeout
    # fails the test then (the worker's own deadline is minutes away).
    return mod.Client(transport=tee.transport(mod), timeout=60,
                      headers={"X-Request-ID": rid}), tee


def _before_first(seen: bytes, marker: bytes, token: bytes) -> None:
    """`marker` was read before the first match of the pattern `token` (the first text)."""
    first = re.search(token, seen)
    assert marker in seen and first is not None, seen[:2000]
    assert seen.index(marker) < first.start(), seen[:2000]


def test_openai_chat_stream_keeps_alive_with_chunks_its_clients_count(srv: Server) -> None:
    """Qwen Code's stream idle timer (240 s) counts only chunks its SDK parsed, not SSE
    comments (issue 42: it closed its first request during a long prefill): the chat
    keep-alive is a chunk whose delta adds nothing, which the SDKs parse as such."""
    chat = {c["client"] for c in CLIENTS if c["api"] == "chat-completions"}
    assert {"qwen-code", "opencode", "continue"} <= chat
    assert all("delta" in c["server_sends"] for c in CLIENTS if c["client"] in chat)
    http, tee = _client(srv, "ka-chat-raw", CHAT_KEEPALIVE)
    with http, http.stream("POST", srv.url + "/v1/chat/completions", json={
            "model": LLM, "stream": True, "max_tokens": 8,
            "messages": [{"role": "user", "content": "Say ok"}]}) as r:
        assert r.status_code == 200
        body = r.read()
    _before_first(body, CHAT_KEEPALIVE, rb'"content":"[^"]')
    assert body.endswith(b"data: [DONE]\n\n") and COMMENT not in body
    kept = [json.loads(line[6:]) for line in body.split(b"\n\n")
            if line.startswith(b"data: {") and CHAT_KEEPALIVE in line]
    assert kept and all(k["object"] == "chat.completion.chunk" and
                        k["choices"][0]["finish_reason"] is None for k in kept)

    http, tee = _client(srv, "ka-chat-sdk", CHAT_KEEPALIVE)
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", http_client=http)
    stream = client.chat.completions.create(
        model=LLM, stream=True, max_tokens=8, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "Say ok"}])
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ANSWER
    assert [c for c in chunks if c.choices][-1].choices[0].finish_reason == "stop"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens >= 1
    assert CHAT_KEEPALIVE in tee.seen


def test_openai_completions_keep_alive(srv: Server) -> None:
    http, tee = _client(srv, "ka-completions", TEXT_KEEPALIVE)
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", http_client=http)
    text = "".join(c.choices[0].text for c in client.completions.create(
        model=LLM, prompt="Say ok", max_tokens=8, stream=True) if c.choices)
    assert text == ANSWER
    _before_first(bytes(tee.seen), TEXT_KEEPALIVE, rb'"text":"[^"]')


def test_responses_stream_keeps_alive_with_events_codex_counts(srv: Server) -> None:
    """Codex's stream idle timeout (300 s) is reset by SSE events only, not by comments, and
    it ignores a repeated response.in_progress: that is the Responses keep-alive, numbered in
    turn with the other events (issue 42: Codex gave up during a long prefill)."""
    codex = next(c for c in CLIENTS if c["client"] == "codex")
    assert codex["server_sends"] == "event: response.in_progress"
    in_progress = b"event: response.in_progress\n"
    # NOTE: the first in_progress follows response.created at once; the gate opens on the
    # second, which only a keep-alive sends.
    http, tee = _client(srv, "ka-responses", in_progress, count=2)
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", http_client=http)
    events = list(client.responses.create(model=LLM, input="Say ok", stream=True))
    assert events[-1].type == "response.completed"
    assert events[-1].response.output_text == ANSWER
    assert [e.sequence_number for e in events] == list(range(len(events)))
    first_delta = next(i for i, e in enumerate(events) if e.type == "response.output_text.delta")
    kept = [e for e in events[:first_delta] if e.type == "response.in_progress"]
    assert len(kept) >= 2 and all(e.response.id == events[0].response.id for e in kept)
    assert COMMENT not in tee.seen


def test_anthropic_stream_pings_while_prefilling(srv: Server) -> None:
    # NOTE: every Anthropic stream has one ping after message_start; a second one before the
    # first text delta is the keep-alive. Claude Code's byte watchdog counts any bytes.
    claude = next(c for c in CLIENTS if c["client"] == "claude-code")
    assert claude["server_sends"] == "event: ping"
    http, tee = _client(srv, "ka-anthropic", PING, count=2, mod=httpx2)
    client = anthropic.Anthropic(base_url=srv.url, api_key="x", http_client=http)
    with client.messages.stream(model=LLM, max_tokens=8,
                                messages=[{"role": "user", "content": "Say ok"}]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == ANSWER and final.stop_reason == "end_turn"
    seen = bytes(tee.seen)
    first_delta = seen.index(b"event: content_block_delta")
    assert seen[:first_delta].count(PING) >= 2, seen[:2000]
    assert seen.index(b"event: message_start") < seen.index(PING)


def test_ollama_gets_no_keepalive_as_its_client_fails_on_one(srv: Server) -> None:
    # Why Ollama's NDJSON gets no keep-alive: ollama-python reads every line as JSON, so a
    # blank line ends the stream with an error (the Ollama server itself sends nothing
    # before the first token).
    def blank_line_first(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=b'\n{"model":"m","created_at":"2025-01-01T00:00:00Z",'
                              b'"message":{"role":"assistant","content":"ok"},"done":true}\n')

    mocked = ollama.Client(host="http://127.0.0.1:1",
                           transport=httpx.MockTransport(blank_line_first))
    with pytest.raises(json.JSONDecodeError):
        list(mocked.chat(model="m", messages=[{"role": "user", "content": "hi"}], stream=True))

    (srv.gates / "ka-ollama").touch()
    client = ollama.Client(host=srv.url, headers={"X-Request-ID": "ka-ollama"})
    parts = list(client.chat(model=LLM, messages=[{"role": "user", "content": "Say ok"}],
                             stream=True))
    assert "".join(p.message.content or "" for p in parts) == ANSWER and parts[-1].done
