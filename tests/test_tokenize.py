"""POST /tokenize and /detokenize (vLLM's shapes, also under /v1/) with the worker's tokenizer."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

LLM = "smollm2:135m"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
PROMPT = "Once upon a time, in a land far away,"


@pytest.fixture(scope="module")
def oai(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0,
                         _strict_response_validation=True)


def tokenize(http: httpx.Client, path: str = "/tokenize", **body: Any) -> dict[str, Any]:
    r = http.post(path, json={"model": LLM, **body})
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    assert out["count"] == len(out["tokens"]) > 0
    assert all(isinstance(t, int) and t >= 0 for t in out["tokens"])
    return out


@pytest.mark.parametrize("tools", [None, WEATHER])
def test_chat_count_is_the_chats_prompt_tokens(http: httpx.Client, oai: openai.OpenAI,
                                               tools: list[dict[str, Any]] | None) -> None:
    extra: dict[str, Any] = {"tools": tools} if tools else {}
    counted = tokenize(http, messages=QUESTION, **extra)
    resp = oai.chat.completions.create(model=LLM, messages=QUESTION,  # type: ignore[arg-type]
                                       max_tokens=1, temperature=0, **extra)
    assert resp.usage is not None
    assert counted["count"] == resp.usage.prompt_tokens
    assert counted["max_model_len"] > counted["count"]
    assert counted["token_strs"] is None


def test_prompt_count_is_the_completions_prompt_tokens(http: httpx.Client,
                                                       oai: openai.OpenAI) -> None:
    counted = tokenize(http, prompt=PROMPT, return_token_strs=True)
    resp = oai.completions.create(model=LLM, prompt=PROMPT, max_tokens=1, temperature=0)
    assert resp.usage is not None and counted["count"] == resp.usage.prompt_tokens
    assert "".join(counted["token_strs"]) == PROMPT  # ASCII: every entry is whole text
    assert tokenize(http, "/v1/tokenize", prompt=PROMPT) == {**counted, "token_strs": None}


@pytest.mark.parametrize("text", [PROMPT, "Ünïcödé 東京 🙂🚀 <|im_start|>user\nhi<|im_end|>"])
def test_round_trip(http: httpx.Client, text: str) -> None:
    tokens = tokenize(http, prompt=text)["tokens"]
    for path in ("/detokenize", "/v1/detokenize"):
        r = http.post(path, json={"model": LLM, "tokens": tokens})
        assert r.status_code == 200, r.text
        assert r.json()["prompt"] == text


def test_chat_tokens_round_trip_to_the_template(http: httpx.Client) -> None:
    opened = tokenize(http, messages=QUESTION)
    closed = tokenize(http, messages=QUESTION, add_generation_prompt=False)
    assert closed["count"] < opened["count"]
    text = http.post("/detokenize", json={"model": LLM, "tokens": opened["tokens"]}).json()
    assert QUESTION[0]["content"] in text["prompt"] and "<|im_start|>" in text["prompt"]


def test_llama_cpp_spelling_without_model(http: httpx.Client) -> None:
    r = http.post("/tokenize", json={"content": PROMPT})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == tokenize(http, prompt=PROMPT)["tokens"]
    back = http.post("/detokenize", json={"tokens": r.json()["tokens"]}).json()
    assert back["content"] == back["prompt"] == PROMPT


@pytest.mark.parametrize("tokens", [[-1], [1, 10**9], ["a"], [1.5], [2**70], "12", None])
def test_bad_token_ids_are_400(http: httpx.Client, tokens: Any) -> None:
    for path in ("/detokenize", "/v1/detokenize"):
        r = http.post(path, json={"model": LLM, "tokens": tokens})
        assert r.status_code == 400, r.text
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("body,status", [
    ({"model": LLM}, 400),
    ({"model": LLM, "prompt": "a", "messages": QUESTION}, 400),
    ({"model": LLM, "messages": [{"role": "wizard", "content": "x"}]}, 400),
    ({"model": "no-such-model", "prompt": "a"}, 404),
    ({"model": "all-minilm:l6-v2", "prompt": "a"}, 400),
])
def test_bad_tokenize_requests(http: httpx.Client, body: dict[str, Any], status: int) -> None:
    r = http.post("/tokenize", json=body)
    assert r.status_code == status, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
