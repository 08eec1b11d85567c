"""Thinking on all four APIs, streaming and not, with the official SDKs.

The thinking model is the embedded SmolLM2 served as `thinker:test` with a Qwen3-style chat
template (`[models."thinker:test"] chat_template`), so its capabilities say `thinking`; its
worker's test hook `force_regex` constrains every generation to `<think>…</think>answer`, which
a 135M model would not write by itself. The splitter alone is tested in test_reasoning.py.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import ollama
import openai
import pytest
from serverctl import Server

from models.locate import locate

MODEL = "thinker:test"
LLM = "smollm2:135m"
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and "
    "enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
REGEX = r"<think>\n[a-z]+( [a-z]+){2,5}\n</think>\n\n[A-Z][a-z]+( [a-z]+){2,5}\."
WORD = r"[A-Za-z]+( [a-z]+){2,5}"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def thinker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("thinker")
    probe = Server(tmp / "probe")
    gguf = locate(probe.config, LLM).path
    srv = Server(tmp, workers=[{"name": "think", "role": "llm", "model": MODEL,
                                "faults": {"force_regex": REGEX}}],
                 models={MODEL: {"path": str(gguf), "chat_template": TEMPLATE}}).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def url(thinker: Server) -> str:
    return thinker.url


def _words(text: str) -> bool:
    return re.fullmatch(WORD + r"\.?", text) is not None


# --- Ollama --------------------------------------------------------------------------------


def test_ollama_chat_thinking(url: str) -> None:
    client = ollama.Client(host=url)
    r = client.chat(model=MODEL, messages=QUESTION, think=True, options={"num_predict": 48})
    assert _words(r.message.thinking or "") and _words(r.message.content)
    assert "<think>" not in r.message.content
    thinking, content = "", ""
    for part in client.chat(model=MODEL, messages=QUESTION, think=True, stream=True,
                            options={"num_predict": 48}):
        thinking += part.message.thinking or ""
        content += part.message.content
    assert _words(thinking) and _words(content)


def test_ollama_generate_thinking(url: str) -> None:
    client = ollama.Client(host=url)
    r = client.generate(model=MODEL, prompt="Why is the sky blue?", options={"num_predict": 48})
    assert _words(r.thinking or "") and _words(r.response)
    parts = list(client.generate(model=MODEL, prompt="Why is the sky blue?", stream=True,
                                 think="high", options={"num_predict": 48}))
    assert _words("".join(p.thinking or "" for p in parts))
    assert _words("".join(p.response for p in parts))


def test_ollama_think_false_leaves_thinking_out_and_tells_the_template(url: str) -> None:
    client = ollama.Client(host=url)
    r = client.chat(model=MODEL, messages=QUESTION, think=False, options={"num_predict": 48})
    assert r.message.thinking is None and _words(r.message.content)
    parts = list(client.generate(model=MODEL, prompt="Hi", think=False, stream=True,
                                 options={"num_predict": 48}))
    assert all(p.thinking is None for p in parts) and _words("".join(p.response for p in parts))
    on = httpx.post(url + "/tokenize", json={"model": MODEL, "messages": QUESTION}).json()
    off = httpx.post(url + "/tokenize", json={
        "model": MODEL, "messages": QUESTION,
        "chat_template_kwargs": {"enable_thinking": False}}).json()
    assert off["count"] > on["count"]


def test_capabilities_of_the_thinking_model(url: str) -> None:
    show = httpx.post(url + "/api/show", json={"model": MODEL}).json()
    assert show["capabilities"] == ["completion", "tools", "thinking"]
    assert "enable_thinking" in show["template"]


# --- OpenAI chat ---------------------------------------------------------------------------


def _reasoning(obj: object) -> str | None:
    extra = getattr(obj, "model_extra", None) or {}
    assert extra.get("reasoning_content") == extra.get("reasoning")
    return extra.get("reasoning_content")


def test_openai_chat_reasoning_content(url: str) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=48)
    message = r.choices[0].message
    assert _words(_reasoning(message) or "") and _words(message.content or "")
    reasoning, content = "", ""
    for c in client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=48,
                                            stream=True):
        if c.choices:
            reasoning += _reasoning(c.choices[0].delta) or ""
            content += c.choices[0].delta.content or ""
    assert _words(reasoning) and _words(content)
    off = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=48,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert _reasoning(off.choices[0].message) is None and _words(off.choices[0].message.content
                                                                 or "")


def test_openai_regex_structured_output(url: str) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    r = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=48,
        extra_body={"structured_outputs": {"regex": "<think>\nhmm\n</think>\n\nParis\\."}})
    assert (_reasoning(r.choices[0].message), r.choices[0].message.content) == ("hmm", "Paris.")
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8,
                                       extra_body={"guided_regex": "(yes|no)"})
    assert r.choices[0].message.content in ("yes", "no")
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8,
                                       extra_body={"guided_regex": "(?=a)b"})
    assert "regex" in str(err.value)


def test_thinking_asked_of_a_model_that_does_not_think_is_a_400(base_url: str) -> None:
    with pytest.raises(ollama.ResponseError) as err:
        ollama.Client(host=base_url).chat(model=LLM, messages=QUESTION, think=True)
    assert err.value.status_code == 400 and "does not support thinking" in str(err.value)
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as oerr:
        client.chat.completions.create(
            model=LLM, messages=QUESTION, max_tokens=1,
            extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    assert "does not support thinking" in str(oerr.value)


# --- Anthropic -----------------------------------------------------------------------------


def test_anthropic_thinking_blocks(url: str) -> None:
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    think: Any = {"type": "enabled", "budget_tokens": 1024}
    r = client.messages.create(model=MODEL, max_tokens=48, messages=QUESTION, thinking=think)
    assert [b.type for b in r.content] == ["thinking", "text"]
    assert r.content[0].type == "thinking" and _words(r.content[0].thinking)
    assert r.content[0].signature == ""
    assert r.content[1].type == "text" and _words(r.content[1].text)
    with client.messages.stream(model=MODEL, max_tokens=48, messages=QUESTION,
                                thinking=think) as stream:
        kinds = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert kinds[0] == "thinking_delta" and kinds[-1] == "text_delta"
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].type == "thinking" and _words(final.content[0].thinking)
    assert final.content[1].type == "text" and _words(final.content[1].text)
    plain = client.messages.create(model=MODEL, max_tokens=48, messages=QUESTION)
    assert [b.type for b in plain.content] == ["text"]
    assert plain.content[0].type == "text" and _words(plain.content[0].text)
