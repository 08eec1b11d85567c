"""Fill in the middle: `suffix` on /api/generate and /v1/completions, as editors' tab
completion sends it (Continue's autocomplete through Ollama's API, minuet's
`openai_fim_compatible` through OpenAI's), on a model whose vocabulary has the tokens for it.

The model is Qwen2.5-Coder-1.5B (the slow tier's session server, tests/conftest.py `qwen`):
what it writes is not asserted, only that its prompt was the model's fill-in-the-middle form
(the prompt's token count is that form's) and that the reply is a completion. The embedded
SmolLM2 has no such tokens: `suffix` is its capability's 400 (test_capabilities). The form's
detection from a model's files is pure code, tested here without a server.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import ollama
import openai
import pytest
from capcheck import check_capabilities
from qwen_coder import QWEN
from serverctl import Server

from npu_proxy.models.capabilities import FIM_FORMS, fim_form
from npu_proxy.models.facts import special_tokens

BEFORE = "def add(a, b):\n    "
AFTER = "\n\n\nprint(add(2, 3))\n"
QWEN_FORM = f"<|fim_prefix|>{BEFORE}<|fim_suffix|>{AFTER}<|fim_middle|>"
GREEDY_SHORT = {"temperature": 0, "num_predict": 24}


def _count(server: Server, text: str) -> int:
    r = httpx.post(server.url + "/tokenize", json={"model": QWEN, "prompt": text}, timeout=600)
    assert r.status_code == 200, r.text
    return int(r.json()["count"])


@pytest.mark.slow
def test_qwen_coder_can_insert(qwen: Server) -> None:
    with httpx.Client(base_url=qwen.url, timeout=600) as http:
        assert "insert" in check_capabilities(http, QWEN)


@pytest.mark.slow
def test_ollama_generate_with_a_suffix_reads_the_fill_in_the_middle_form(qwen: Server) -> None:
    client = ollama.Client(host=qwen.url, timeout=600)
    r = client.generate(model=QWEN, prompt=BEFORE, suffix=AFTER, options=GREEDY_SHORT)
    assert r.done and r.done_reason in ("stop", "length")
    assert r.prompt_eval_count == _count(qwen, QWEN_FORM)
    # Ollama's templates write the form alone: a system prompt changes nothing.
    told = client.generate(model=QWEN, prompt=BEFORE, suffix=AFTER, system="Be terse.",
                           options=GREEDY_SHORT)
    assert told.prompt_eval_count == r.prompt_eval_count
    streamed = list(client.generate(model=QWEN, prompt=BEFORE, suffix=AFTER, stream=True,
                                    options=GREEDY_SHORT))
    assert streamed[-1].done and streamed[-1].prompt_eval_count == r.prompt_eval_count
    assert "".join(c.response for c in streamed) == r.response


@pytest.mark.slow
def test_openai_completions_with_a_suffix_read_the_fill_in_the_middle_form(
        qwen: Server) -> None:
    client = openai.OpenAI(base_url=qwen.url + "/v1", api_key="unused", max_retries=0,
                           timeout=600)
    r = client.completions.create(model=QWEN, prompt=BEFORE, suffix=AFTER, max_tokens=24,
                                  temperature=0)
    assert r.usage is not None and r.usage.prompt_tokens == _count(qwen, QWEN_FORM)
    assert r.choices[0].finish_reason in ("stop", "length")
    # An empty prompt is the cursor at the file's start: still a completion, not a load.
    start = client.completions.create(model=QWEN, prompt="", suffix=AFTER, max_tokens=4)
    assert start.usage is not None and start.usage.prompt_tokens == _count(
        qwen, f"<|fim_prefix|><|fim_suffix|>{AFTER}<|fim_middle|>")


@pytest.mark.slow
def test_a_suffix_with_raw_or_token_ids_is_a_400(qwen: Server) -> None:
    raw = httpx.post(qwen.url + "/api/generate", timeout=600, json={
        "model": QWEN, "prompt": BEFORE, "suffix": AFTER, "raw": True, "stream": False})
    assert raw.status_code == 400 and "raw" in raw.json()["error"]
    ids = httpx.post(qwen.url + "/v1/completions", timeout=600, json={
        "model": QWEN, "prompt": [1, 2, 3], "suffix": AFTER, "max_tokens": 1})
    assert ids.status_code == 400 and ids.json()["error"]["param"] == "suffix"


# --- the form, from a model's files (pure code) -------------------------------------------


def test_each_form_is_found_by_its_three_tokens() -> None:
    for form in FIM_FORMS:
        assert fim_form({"<|im_end|>", form.prefix, form.suffix, form.middle}) == form
        assert fim_form({form.prefix, form.middle}) is None
    assert fim_form(set()) is None


def test_a_folders_added_tokens_name_its_form(tmp_path: Path) -> None:
    added = {str(151659 + i): {"content": t, "special": False}
             for i, t in enumerate(("<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>"))}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": added}))
    assert fim_form(special_tokens(tmp_path)) == FIM_FORMS[0]
    (tmp_path / "tokenizer_config.json").unlink()
    (tmp_path / "tokenizer.json").write_text(json.dumps({"added_tokens": [
        {"id": 1, "content": "<fim_prefix>"}, {"id": 2, "content": "<fim_suffix>"},
        {"id": 3, "content": "<fim_middle>"}]}))
    assert fim_form(special_tokens(tmp_path)) == FIM_FORMS[1]


@pytest.mark.parametrize("config", [
    {"added_tokens_decoder": ["<|fim_prefix|>"]},
    {"added_tokens_decoder": {"1": "<|fim_prefix|>", "2": {"content": 7}}},
    {"added_tokens_decoder": {"1": {"content": "<|fim_prefix|>" + "x" * 40 + ">"}}},
    [1, 2],
])
def test_hostile_tokenizer_files_name_no_form(tmp_path: Path, config: object) -> None:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert fim_form(special_tokens(tmp_path)) is None
