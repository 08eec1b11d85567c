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
from capcheck import check_capabilities
from serverctl import Server

from npu_proxy.models.locate import locate

MODEL = "thinker:test"
LLM = "smollm2:135m"
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and "
    "enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
# NOTE: short words, so that the whole shape fits in the tokens the tests allow (OUT).
REGEX = r"<think>\n[a-z]{2,6}( [a-z]{2,6}){2,3}\n</think>\n\n[A-Z][a-z]{1,5}( [a-z]{2,6}){2,3}\."
OUT = 96
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
    r = client.chat(model=MODEL, messages=QUESTION, think=True, options={"num_predict": OUT})
    assert _words(r.message.thinking or "") and _words(r.message.content)
    assert "<think>" not in r.message.content
    thinking, content = "", ""
    for part in client.chat(model=MODEL, messages=QUESTION, think=True, stream=True,
                            options={"num_predict": OUT}):
        thinking += part.message.thinking or ""
        content += part.message.content
    assert _words(thinking) and _words(content)


def test_ollama_generate_thinking(url: str) -> None:
    client = ollama.Client(host=url)
    r = client.generate(model=MODEL, prompt="Why is the sky blue?", options={"num_predict": OUT})
    assert _words(r.thinking or "") and _words(r.response)
    parts = list(client.generate(model=MODEL, prompt="Why is the sky blue?", stream=True,
                                 think="high", options={"num_predict": OUT}))
    assert _words("".join(p.thinking or "" for p in parts))
    assert _words("".join(p.response for p in parts))


def test_ollama_think_false_leaves_thinking_out_and_tells_the_template(url: str) -> None:
    client = ollama.Client(host=url)
    r = client.chat(model=MODEL, messages=QUESTION, think=False, options={"num_predict": OUT})
    assert r.message.thinking is None and _words(r.message.content)
    on = client.chat(model=MODEL, messages=QUESTION, think=True, options={"num_predict": OUT})
    # the template closed an empty <think></think> itself: a longer prompt
    assert (r.prompt_eval_count or 0) > (on.prompt_eval_count or 0) > 0
    parts = list(client.generate(model=MODEL, prompt="Hi", think=False, stream=True,
                                 options={"num_predict": OUT}))
    assert all(p.thinking is None for p in parts) and _words("".join(p.response for p in parts))
    count_on = httpx.post(url + "/tokenize", json={"model": MODEL, "messages": QUESTION}).json()
    count_off = httpx.post(url + "/tokenize", json={
        "model": MODEL, "messages": QUESTION,
        "chat_template_kwargs": {"enable_thinking": False}}).json()
    assert count_off["count"] == r.prompt_eval_count
    assert count_on["count"] == on.prompt_eval_count


def test_capabilities_of_the_thinking_model_and_of_one_made_from_it(url: str) -> None:
    with httpx.Client(base_url=url, timeout=120) as http:
        assert check_capabilities(http, MODEL) == ["completion", "tools", "thinking"]
        show = http.post("/api/show", json={"model": MODEL}).json()
        assert "enable_thinking" in show["template"]
        client = ollama.Client(host=url)
        made = "thinker-brief:test"
        client.create(model=made, from_=MODEL, system="Answer in one line.")
        try:
            assert check_capabilities(http, made) == ["completion", "tools", "thinking"]
            r = client.chat(model=made, messages=QUESTION, think=True,
                            options={"num_predict": OUT})
            assert _words(r.message.thinking or "") and _words(r.message.content)
        finally:
            http.request("DELETE", "/api/delete", json={"model": made})


# --- OpenAI chat ---------------------------------------------------------------------------


def _reasoning(obj: object) -> str | None:
    extra = getattr(obj, "model_extra", None) or {}
    assert extra.get("reasoning_content") == extra.get("reasoning")
    return extra.get("reasoning_content")


def test_openai_chat_reasoning_content(url: str) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=OUT)
    message = r.choices[0].message
    assert _words(_reasoning(message) or "") and _words(message.content or "")
    reasoning, content = "", ""
    for c in client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=OUT,
                                            stream=True):
        if c.choices:
            reasoning += _reasoning(c.choices[0].delta) or ""
            content += c.choices[0].delta.content or ""
    assert _words(reasoning) and _words(content)
    off = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=OUT,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert _reasoning(off.choices[0].message) is None and _words(off.choices[0].message.content
                                                                 or "")
    assert off.usage is not None and r.usage is not None
    assert off.usage.prompt_tokens > r.usage.prompt_tokens


def test_openai_regex_structured_output(url: str) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    r = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=OUT,
        extra_body={"structured_outputs": {"regex": "<think>\nhmm\n</think>\n\nParis\\."}})
    assert (_reasoning(r.choices[0].message), r.choices[0].message.content) == ("hmm", "Paris.")
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8,
                                       extra_body={"guided_regex": "(yes|no)"})
    assert r.choices[0].message.content in ("yes", "no")
    # lookaround: XGrammar refuses it; a raw NUL crashed the worker
    for bad in ("(?=a)b", "a\x00"):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8,
                                           extra_body={"guided_regex": bad})
        assert "regex" in str(err.value)
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8,
                                       extra_body={"guided_regex": "\\x41{3}"})
    assert r.choices[0].message.content == "AAA"


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
    r = client.messages.create(model=MODEL, max_tokens=OUT, messages=QUESTION, thinking=think)
    assert [b.type for b in r.content] == ["thinking", "text"]
    assert r.content[0].type == "thinking" and _words(r.content[0].thinking)
    assert r.content[0].signature == ""
    assert r.content[1].type == "text" and _words(r.content[1].text)
    with client.messages.stream(model=MODEL, max_tokens=OUT, messages=QUESTION,
                                thinking=think) as stream:
        kinds = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert kinds[0] == "thinking_delta" and kinds[-1] == "text_delta"
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert final.content[0].type == "thinking" and _words(final.content[0].thinking)
    assert final.content[1].type == "text" and _words(final.content[1].text)
    plain = client.messages.create(model=MODEL, max_tokens=OUT, messages=QUESTION)
    assert [b.type for b in plain.content] == ["text"]
    assert plain.content[0].type == "text" and _words(plain.content[0].text)
    # without thinking the template switched it off; count_tokens counts alike
    assert plain.usage.input_tokens > r.usage.input_tokens
    assert client.messages.count_tokens(model=MODEL, messages=QUESTION,
                                        thinking=think).input_tokens == r.usage.input_tokens
    assert client.messages.count_tokens(model=MODEL, messages=QUESTION
                                        ).input_tokens == plain.usage.input_tokens


# --- OpenAI Responses ----------------------------------------------------------------------


def test_responses_reasoning_items(url: str) -> None:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    r = client.responses.create(model=MODEL, input="What is the capital of France?",
                                max_output_tokens=OUT)
    assert [item.type for item in r.output] == ["reasoning", "message"]
    item = r.output[0]
    assert item.type == "reasoning" and item.summary == [] and item.content is not None
    assert [c.type for c in item.content] == ["reasoning_text"]
    assert _words(item.content[0].text) and _words(r.output_text)
    assert r.usage is not None
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
    with client.responses.stream(model=MODEL, input="What is the capital of France?",
                                 max_output_tokens=OUT) as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    done = [e.text for e in events if e.type == "response.reasoning_text.done"]
    kinds = [e.type for e in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    assert _words(deltas) and done == [deltas]
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert _words(final.output_text)
    assert final.usage is not None and final.usage.output_tokens_details.reasoning_tokens > 0
    off = client.responses.create(model=MODEL, input="Hi", max_output_tokens=OUT,
                                  reasoning={"effort": "none"})
    assert [item.type for item in off.output] == ["message"] and _words(off.output_text)


def test_anthropic_and_responses_take_a_model_that_does_not_think(base_url: str) -> None:
    """Clients of these APIs ask for reasoning whatever the model: no 400, no reasoning."""
    client = anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0)
    r = client.messages.create(model=LLM, max_tokens=2, messages=QUESTION,
                               thinking={"type": "enabled", "budget_tokens": 1024})
    assert [b.type for b in r.content] == ["text"]
    oai = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    resp = oai.responses.create(model=LLM, input="Hi", max_output_tokens=2,
                                reasoning={"effort": "high"})
    assert [item.type for item in resp.output] == ["message"]
    assert resp.usage is not None and resp.usage.output_tokens_details.reasoning_tokens == 0
