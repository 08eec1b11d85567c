"""`capabilities` in /api/show, /api/tags and /v1/models, and the 400s that follow them."""

from __future__ import annotations

import anthropic
import httpx
import ollama
import openai
import pytest
from capcheck import check_capabilities

from npu_proxy.models.capabilities import capabilities

LLM = "smollm2:135m"
EMBED = "all-minilm:l6-v2"
RERANK = "all-minilm-rerank:l6-v2"
IMAGE = "data:image/png;base64,iVBORw0KGgo="


def test_llm_capabilities(http: httpx.Client) -> None:
    assert check_capabilities(http, LLM) == ["completion", "tools"]
    card = http.get(f"/v1/models/{LLM}").json()
    num_ctx = http.post("/api/show", json={"model": LLM}).json()["model_info"]
    assert card["max_model_len"] == num_ctx["llama.context_length"] > 0


def test_embedding_model_capabilities(http: httpx.Client) -> None:
    assert check_capabilities(http, EMBED) == ["embedding"]


def test_reranking_model_capabilities(http: httpx.Client) -> None:
    assert check_capabilities(http, RERANK) == ["rerank"]


def test_openai_and_anthropic_refuse_what_the_model_cannot_do(base_url: str) -> None:
    oai = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model=LLM, max_tokens=1, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": IMAGE}}]}])
    assert "does not support images" in str(err.value)
    with pytest.raises(openai.BadRequestError) as err:
        oai.completions.create(model=LLM, prompt="def f(", suffix="\n", max_tokens=1)
    assert "does not support insert" in str(err.value)
    claude = anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as aerr:
        claude.messages.create(model=LLM, max_tokens=1, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "iVBORw0KGgo="}}]}])
    assert "does not support images" in str(aerr.value)
    with pytest.raises(anthropic.BadRequestError) as aerr:
        claude.messages.create(model=LLM, max_tokens=1, messages=[
            {"role": "user", "content": "What is on the screen?"},
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": "toolu_1", "name": "screenshot", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                          "content": [{"type": "image", "source": {
                                              "type": "base64", "media_type": "image/png",
                                              "data": "iVBORw0KGgo="}}]}]}])
    assert "does not support images" in str(aerr.value)


def test_capabilities_from_kind_and_template() -> None:
    assert capabilities("embed", "").names == ["embedding"]
    assert capabilities("rerank", "").names == ["rerank"]
    assert capabilities("asr", "").names == ["transcription"]
    plain = capabilities("llm", "{% for m in messages %}{{ m.content }}{% endfor %}")
    assert plain.names == ["completion", "tools"] and not plain.native_tools
    native = capabilities("llm", "{% if tools %}{{ tools | tojson }}{% endif %}")
    assert native.names == ["completion", "tools"] and native.native_tools
    for thinks in ("{% if enable_thinking is false %}<think>\n\n</think>{% endif %}",
                   "{{ m.content.split('</think>')[-1] }}",
                   "<|start|>assistant<|channel|>analysis<|message|>"):
        assert capabilities("llm", thinks).names == ["completion", "tools", "thinking"]


def test_a_created_model_has_its_base_models_capabilities(base_url: str,
                                                          http: httpx.Client) -> None:
    made = "capabilities-made:test"
    ollama.Client(host=base_url).create(model=made, from_=LLM, system="Be brief.")
    try:
        assert check_capabilities(http, made) == ["completion", "tools"]
    finally:
        http.request("DELETE", "/api/delete", json={"model": made})
