"""Token log-probabilities through the `ollama` and `openai` SDKs, streaming and not.

OpenVINO GenAI gives the sampled token's log-probability: one entry per generated token
(completion_tokens / eval_count of them), each <= 0, whose texts join to the generated text
and whose bytes are the token's own; a top_logprobs list holds the sampled token alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import httpx
import ollama
import openai
import pytest
from serverctl import Server

LLM = "smollm2:135m"
# NOTE: the greedy answer is Japanese, whose characters are split across tokens here.
MESSAGES = [{"role": "user", "content": "Write 'thank you' in Japanese."}]
OPTIONS = {"temperature": 0, "num_predict": 24}


@pytest.fixture(scope="module")
def oai(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0,
                         _strict_response_validation=True)


@pytest.fixture(scope="module")
def oll(server: Server) -> ollama.Client:
    return ollama.Client(host=server.url, timeout=120)


def check(entries: Sequence[Any], text: str, count: int, top: bool) -> None:
    """What a user can rely on: one entry per generated token, log-probabilities, pieces that
    join to the text, and (when asked) alternatives that are the sampled token only."""
    assert len(entries) == count > 0
    assert "\ufffd" not in text
    assert all(e["logprob"] <= 0.0 for e in entries)
    assert "".join(e["token"] for e in entries) == text
    if all("bytes" in e for e in entries):  # the ollama SDK's types drop them
        data = b"".join(bytes(e["bytes"] or []) for e in entries)
        # NOTE: equal unless the generation stopped inside a character (its bytes are not text).
        assert data.startswith(text.encode()) and len(data) - len(text.encode()) < 4
    for e in entries:
        if top:
            assert [(t["token"], t["logprob"]) for t in e["top_logprobs"]] == \
                [(e["token"], e["logprob"])]
        else:
            assert not e.get("top_logprobs")


# --- Ollama ------------------------------------------------------------------------------


def test_ollama_chat_logprobs(oll: ollama.Client) -> None:
    resp = oll.chat(model=LLM, messages=MESSAGES, options=OPTIONS, logprobs=True,
                    top_logprobs=3)
    entries = [e.model_dump() for e in resp.logprobs or []]
    check(entries, resp.message.content or "", resp.eval_count or 0, top=True)


def test_ollama_chat_stream_logprobs(oll: ollama.Client) -> None:
    chunks = list(oll.chat(model=LLM, messages=MESSAGES, options=OPTIONS, logprobs=True,
                           top_logprobs=3, stream=True))
    entries = []
    for c in chunks:
        mine = [e.model_dump() for e in c.logprobs or []]
        assert "".join(e["token"] for e in mine) == c.message.content  # per chunk, too
        entries += mine
    text = "".join(c.message.content or "" for c in chunks)
    check(entries, text, chunks[-1].eval_count or 0, top=True)


def test_ollama_generate_logprobs(oll: ollama.Client) -> None:
    resp = oll.generate(model=LLM, prompt=MESSAGES[0]["content"], options=OPTIONS,
                        logprobs=True)
    check([e.model_dump() for e in resp.logprobs or []], resp.response, resp.eval_count or 0,
          top=False)
    chunks = list(oll.generate(model=LLM, prompt=MESSAGES[0]["content"], options=OPTIONS,
                               logprobs=True, stream=True))
    entries = [e.model_dump() for c in chunks for e in c.logprobs or []]
    check(entries, "".join(c.response for c in chunks), chunks[-1].eval_count or 0, top=False)


def test_ollama_bytes_and_absent_unless_asked(http: httpx.Client) -> None:
    body = {"model": LLM, "messages": MESSAGES, "options": OPTIONS, "stream": False}
    plain = http.post("/api/chat", json=body).json()
    assert "logprobs" not in plain
    asked = http.post("/api/chat", json={**body, "logprobs": True}).json()
    entries = asked["logprobs"]
    assert all(isinstance(e["bytes"], list) for e in entries)
    check(entries, asked["message"]["content"], asked["eval_count"], top=False)
    assert asked["message"]["content"] == plain["message"]["content"]  # same greedy text


@pytest.mark.parametrize("extra", [{"top_logprobs": 21}, {"top_logprobs": -1},
                                   {"top_logprobs": "3"}])
def test_ollama_bad_top_logprobs(http: httpx.Client, extra: dict[str, Any]) -> None:
    r = http.post("/api/chat", json={"model": LLM, "messages": MESSAGES, "stream": False,
                                     "logprobs": True, **extra})
    assert r.status_code == 400 and isinstance(r.json()["error"], str)


# --- OpenAI ------------------------------------------------------------------------------


def _chat_entries(content: Sequence[Any]) -> list[dict[str, Any]]:
    return [c.model_dump() for c in content]


def test_openai_chat_logprobs(oai: openai.OpenAI) -> None:
    resp = oai.chat.completions.create(model=LLM, messages=MESSAGES,  # type: ignore[arg-type]
                                       temperature=0, max_tokens=24, logprobs=True,
                                       top_logprobs=2)
    choice = resp.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert resp.usage is not None
    check(_chat_entries(choice.logprobs.content), choice.message.content or "",
          resp.usage.completion_tokens, top=True)


def test_openai_chat_stream_logprobs(oai: openai.OpenAI) -> None:
    chunks = list(oai.chat.completions.create(
        model=LLM, messages=MESSAGES, temperature=0, max_tokens=24,  # type: ignore[arg-type]
        logprobs=True, stream=True, stream_options={"include_usage": True}))
    entries: list[dict[str, Any]] = []
    text = ""
    for c in chunks:
        if not c.choices:
            continue
        choice = c.choices[0]
        if choice.logprobs is not None and choice.logprobs.content:
            mine = _chat_entries(choice.logprobs.content)
            assert "".join(e["token"] for e in mine) == choice.delta.content
            entries += mine
        text += choice.delta.content or ""
    assert chunks[-1].usage is not None
    check(entries, text, chunks[-1].usage.completion_tokens, top=False)


def _completion_entries(lp: Any) -> list[dict[str, Any]]:
    tops = lp.top_logprobs or [None] * len(lp.tokens)
    out = []
    for token, value, top in zip(lp.tokens, lp.token_logprobs, tops, strict=True):
        entry: dict[str, Any] = {"token": token, "logprob": value}
        if top is not None:
            entry["top_logprobs"] = [{"token": k, "logprob": v} for k, v in top.items()]
        out.append(entry)
    return out


def test_openai_completion_logprobs(oai: openai.OpenAI) -> None:
    prompt = MESSAGES[0]["content"]
    resp = oai.completions.create(model=LLM, prompt=prompt, temperature=0, max_tokens=24,
                                  logprobs=1)
    choice = resp.choices[0]
    assert choice.logprobs is not None and resp.usage is not None
    entries = _completion_entries(choice.logprobs)
    check(entries, choice.text, resp.usage.completion_tokens, top=True)
    offsets = choice.logprobs.text_offset or []
    assert [choice.text[o:o + len(e["token"])] for o, e in zip(offsets, entries, strict=True)] \
        == [e["token"] for e in entries]

    # NOTE: the SDK's strict validation refuses its own Completion type for stream chunks,
    # whose finish_reason is null until the last one, so the stream is read without it.
    loose = openai.OpenAI(base_url=str(oai.base_url), api_key="unused", max_retries=0)
    chunks = list(loose.completions.create(model=LLM, prompt=prompt, temperature=0,
                                           max_tokens=24, logprobs=1, stream=True,
                                           stream_options={"include_usage": True}))
    streamed: list[dict[str, Any]] = []
    text = ""
    for c in chunks:
        if c.choices and c.choices[0].logprobs is not None:
            lp = c.choices[0].logprobs
            assert lp.text_offset and lp.text_offset[0] == len(text)
            streamed += _completion_entries(lp)
        text += c.choices[0].text if c.choices else ""
    assert chunks[-1].usage is not None
    check(streamed, text, chunks[-1].usage.completion_tokens, top=True)


@pytest.mark.parametrize("path,extra", [
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}),
    ("/v1/chat/completions", {"top_logprobs": 2}),
    ("/v1/chat/completions", {"logprobs": 1}),
    ("/v1/completions", {"logprobs": 6}),
])
def test_openai_bad_logprobs(http: httpx.Client, path: str, extra: dict[str, Any]) -> None:
    body: dict[str, Any] = {"model": LLM, "max_tokens": 2, **extra}
    body.update({"messages": MESSAGES} if "chat" in path else {"prompt": "Hi"})
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
