"""Output length and context overflow (issue 26), through the official clients against the
shared server and its embedded SmolLM2 (context 8192 tokens).

- Output asked beyond the context (max_tokens 32,000, as Qwen Code and Claude Code send) is
  served, clamped to the room the prompt leaves, and ends with the API's length reason.
- A history longer than the context: Ollama's chat drops its oldest messages (`truncate`,
  default true), as do the Responses API's truncation "auto"; everywhere else it is refused
  with that API's own overflow error, carrying the exact token count.
- Ollama's options.num_ctx, smaller than the model's context, is the request's context.

NOTE: the runs to the end of a context and the histories cut to fit one use a model made by
/api/create from SmolLM2 with PARAMETER num_ctx 1024 (as a Modelfile sets a smaller context):
its context in every API, reached in ~1,000 tokens rather than 8,000. A prompt near the full
8192 was one ~8,000-token prefill step, 8-14 s on 2 loaded cores (those runs were CI-only);
test_admission's long prefill still takes one.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import ollama
import openai
import pytest

from npu_proxy.gateway.content.params import ollama_params
from npu_proxy.protocol.messages import ChatMessage
from npu_proxy.workers.generation.sampling import droppable, fewest_dropped

LLM = "smollm2:135m"
CONTEXT = 8192  # smollm2:135m's max_position_embeddings
SMALL = 1024  # the context of the `small` model: LLM made with PARAMETER num_ctx 1024
ROOM = 12  # what the near-full prompt leaves for the reply
SYSTEM = {"role": "system", "content": "You are terse."}


def _count(url: str, messages: list[dict[str, str]], model: str = LLM) -> int:
    """The exact prompt tokens of a chat, by the server's own tokenizer (vLLM's /tokenize)."""
    r = httpx.post(url + "/tokenize", json={"model": model, "messages": messages}, timeout=60)
    assert r.status_code == 200, r.text
    return int(r.json()["count"])


def _history(turns: int) -> list[dict[str, str]]:
    """A system message, `turns` user/assistant exchanges of some 150 tokens each, and a
    last question: more than the context for 50 turns."""
    chat: list[dict[str, str]] = [SYSTEM]
    for i in range(turns):
        chat.append({"role": "user", "content": f"Note {i}: " + "the river runs " * 25})
        chat.append({"role": "assistant", "content": f"Noted {i}: " + "and the hills " * 25})
    chat.append({"role": "user", "content": "Say hi."})
    return chat


@pytest.fixture(scope="module")
def long_chat(base_url: str) -> tuple[list[dict[str, str]], int]:
    """A chat longer than the context, and its exact prompt tokens (/tokenize counts a text
    longer than the tokenizer's 8,192 whole: tokenizer_cap.py)."""
    chat = _history(50)
    tokens = _count(base_url, chat)
    assert tokens > CONTEXT
    return chat, tokens


@pytest.fixture(scope="module")
def small(base_url: str) -> Iterator[str]:
    """A model of SMALL tokens' context: LLM made by /api/create with num_ctx SMALL."""
    # NOTE: not an npx-test- name: test_create removes those of other runs when it starts,
    # and the cache is shared by every run on the machine.
    name = f"npx-ctx{SMALL}-{uuid.uuid4().hex[:8]}:latest"
    made = httpx.post(base_url + "/api/create", timeout=600, json={
        "model": name, "from": LLM, "parameters": {"num_ctx": SMALL}, "stream": False})
    assert made.status_code == 200, made.text
    yield name
    httpx.request("DELETE", base_url + "/api/delete", json={"model": name}, timeout=180)


@pytest.fixture(scope="module")
def full(base_url: str, small: str) -> list[dict[str, str]]:
    """One user message whose prompt leaves exactly ROOM tokens of the small context."""
    words = SMALL - ROOM - 20
    for _ in range(4):
        chat = [{"role": "user", "content": "word " * words}]
        off = SMALL - ROOM - _count(base_url, chat, small)
        if off == 0:
            return chat
        words += off
    raise AssertionError("could not size the prompt")


# --- output beyond the context: clamped, ends with the length reason -------------------------


def test_max_tokens_32000_runs_to_the_end_of_the_context_with_openai(
        base_url: str, small: str, full: list[dict[str, str]]) -> None:
    oai = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    done = oai.chat.completions.create(model=small, messages=full, max_tokens=32000,  # type: ignore[arg-type]
                                       temperature=0, extra_body={"ignore_eos": True})
    assert done.choices[0].finish_reason == "length"
    assert done.usage is not None
    assert done.usage.prompt_tokens == SMALL - ROOM
    assert done.usage.completion_tokens == ROOM
    # NOTE: the same near-full text as a raw prompt (no chat template: a few tokens more
    # room), so the run to the end of the context is a few dozen tokens, not the whole
    # context's worth.
    text = oai.completions.create(model=small, prompt=full[0]["content"], max_tokens=100_000,
                                  temperature=0, extra_body={"ignore_eos": True},
                                  stream=True, stream_options={"include_usage": True})
    chunks = list(text)
    usage = chunks[-1].usage
    assert usage is not None and usage.total_tokens == SMALL
    assert ROOM <= usage.completion_tokens < 200
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_max_tokens_32000_is_served_with_every_api(base_url: str) -> None:
    """Accepted (it was a 400): a short answer, ended by a stop string, within the context."""
    hi = [{"role": "user", "content": "Say hi."}]
    oai = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    done = oai.chat.completions.create(model=LLM, messages=hi, max_tokens=32000,  # type: ignore[arg-type]
                                       temperature=0, stop=[" "])
    assert done.usage is not None and done.usage.total_tokens <= CONTEXT
    claude = anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0)
    # NOTE: streamed, as Claude Code does: the SDK refuses so large a max_tokens otherwise.
    with claude.messages.stream(model=LLM, max_tokens=32000, messages=hi,  # type: ignore[arg-type]
                                stop_sequences=[" "]) as stream:
        message = stream.get_final_message()
    assert message.usage.input_tokens + message.usage.output_tokens <= CONTEXT
    answer = ollama.Client(host=base_url).chat(
        model=LLM, messages=hi, options={"num_predict": 100_000, "temperature": 0, "stop": [" "]})
    assert answer.done
    reply = oai.responses.create(model=LLM, input=hi, max_output_tokens=32000,  # type: ignore[arg-type]
                                 temperature=0, extra_body={"stop": [" "]})
    assert reply.usage is not None and reply.usage.total_tokens <= CONTEXT


# A schema the reply cannot complete within a small context: only the clamp ends it.
ENDLESS = {"type": "array", "items": {"type": "integer"}, "minItems": 4000}


@pytest.mark.parametrize("num_predict", [100_000, -1])
def test_output_runs_to_the_end_of_a_small_context_and_says_length(
        base_url: str, num_predict: int) -> None:
    num_ctx = 160
    chat = [SYSTEM, {"role": "user", "content": "List numbers. " + "the river runs " * 30}]
    done = ollama.Client(host=base_url).chat(
        model=LLM, messages=chat, format=ENDLESS,
        options={"num_ctx": num_ctx, "num_predict": num_predict, "temperature": 0})
    assert done.prompt_eval_count == _count(base_url, chat)
    assert done.eval_count is not None
    assert done.prompt_eval_count + done.eval_count == num_ctx
    assert done.done_reason == "length"


def test_num_predict_minus_one_means_until_the_context_is_full() -> None:
    assert (ollama_params({"num_predict": -1}, None).max_tokens or 0) >= CONTEXT
    assert (ollama_params({"num_predict": -2}, None).max_tokens or 0) >= CONTEXT


# --- a history longer than the context ------------------------------------------------------


def test_ollama_chat_drops_the_oldest_messages(base_url: str, small: str,
                                               long_chat: tuple[list[dict[str, str]], int]
                                               ) -> None:
    chat, _ = long_chat
    done = ollama.Client(host=base_url).chat(model=small, messages=chat,
                                             options={"num_predict": 8, "temperature": 0})
    assert done.done
    assert done.prompt_eval_count is not None
    # Room for the 8 tokens asked, and no more dropped than needed (a message is < 200).
    assert SMALL - 8 - 200 < done.prompt_eval_count <= SMALL - 8


def test_ollama_chat_drops_the_oldest_messages_to_fit_num_ctx(base_url: str) -> None:
    chat = _history(6)  # some 1,900 tokens
    num_ctx = 600
    assert _count(base_url, chat) > num_ctx
    done = ollama.Client(host=base_url).chat(
        model=LLM, messages=chat, options={"num_ctx": num_ctx, "num_predict": 8,
                                           "temperature": 0})
    assert done.done and done.prompt_eval_count is not None
    assert num_ctx - 8 - 200 < done.prompt_eval_count <= num_ctx - 8
    r = httpx.post(base_url + "/api/chat", timeout=120, json={
        "model": LLM, "messages": chat, "stream": False, "shift": True,
        "options": {"num_ctx": num_ctx, "num_predict": 8, "temperature": 0}})
    assert r.status_code == 200
    assert r.headers["x-npu-proxy-context-length"] == str(num_ctx)
    dropped = int(r.headers["x-npu-proxy-truncated-messages"])
    assert dropped > 0
    # The system message stays, the oldest others go.
    kept = [SYSTEM, *chat[1 + dropped:]]
    assert r.json()["prompt_eval_count"] == _count(base_url, kept)


def test_ollama_chat_without_truncate_is_400(base_url: str,
                                             long_chat: tuple[list[dict[str, str]], int]
                                             ) -> None:
    chat, tokens = long_chat
    # NOTE: raw, as Ollama's docs send it: the ollama SDK's chat() has no `truncate`.
    r = httpx.post(base_url + "/api/chat", timeout=120, json={
        "model": LLM, "messages": chat, "truncate": False, "options": {"num_predict": 8}})
    assert r.status_code == 400
    assert set(r.json()) == {"error"}
    found = re.search(r"prompt is (\d+) tokens", r.json()["error"])
    assert found is not None and int(found[1]) == tokens, r.json()


def test_openai_chat_is_context_length_exceeded(
        base_url: str, long_chat: tuple[list[dict[str, str]], int]) -> None:
    chat, tokens = long_chat
    oai = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model=LLM, messages=chat, max_tokens=8)  # type: ignore[arg-type]
    assert err.value.code == "context_length_exceeded"
    assert err.value.param == "messages"
    body: Any = err.value.body
    assert body["type"] == "invalid_request_error"
    found = re.match(
        f"This model's maximum context length is {CONTEXT} tokens. However, your messages "
        r"resulted in (\d+) tokens", body["message"])
    assert found is not None and int(found[1]) == tokens, body


def test_openai_completions_is_context_length_exceeded(base_url: str) -> None:
    oai = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        oai.completions.create(model=LLM, prompt="word " * 9000, max_tokens=8)
    assert err.value.code == "context_length_exceeded" and err.value.param == "prompt"
    assert f"maximum context length is {CONTEXT} tokens" in err.value.message


def test_responses_overflow_is_context_length_exceeded(base_url: str,
                              long_chat: tuple[list[dict[str, str]], int]) -> None:
    chat, tokens = long_chat
    oai = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as err:
        oai.responses.create(model=LLM, input=chat, max_output_tokens=16)  # type: ignore[arg-type]
    assert err.value.code == "context_length_exceeded" and err.value.param == "input"
    found = re.search(r"resulted in (\d+) tokens", err.value.message)
    assert found is not None and int(found[1]) == tokens, err.value.message
    with pytest.raises(openai.BadRequestError):
        oai.responses.create(model=LLM, input=chat, max_output_tokens=16,  # type: ignore[arg-type]
                             truncation="disabled")


def test_responses_truncation_auto(base_url: str, small: str,
                                   long_chat: tuple[list[dict[str, str]], int]) -> None:
    chat, tokens = long_chat
    oai = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    done = oai.responses.create(model=small, input=chat, max_output_tokens=16,  # type: ignore[arg-type]
                                truncation="auto", temperature=0)
    assert done.truncation == "auto"
    assert done.usage is not None
    assert SMALL - 16 - 200 < done.usage.input_tokens <= SMALL - 16 < tokens


def test_anthropic_is_prompt_too_long(base_url: str,
                                      long_chat: tuple[list[dict[str, str]], int]) -> None:
    chat, tokens = long_chat
    claude = anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0)
    system, turns = chat[0]["content"], chat[1:]
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(model=LLM, system=system, messages=turns,  # type: ignore[arg-type]
                               max_tokens=32000, stream=True)
    body: Any = err.value.body
    assert body["error"]["type"] == "invalid_request_error"
    # NOTE: Anthropic's form: Claude Code reads both numbers to compact by their difference.
    found = re.fullmatch(r"prompt is too long: (\d+) tokens > (\d+) maximum",
                         body["error"]["message"])
    assert found is not None, body
    assert int(found[1]) == tokens and int(found[2]) == CONTEXT - 1


# --- num_ctx ----------------------------------------------------------------------------------


def test_a_smaller_num_ctx_without_truncate_is_400(base_url: str) -> None:
    num_ctx = 600
    r = httpx.post(base_url + "/api/chat", timeout=120, json={
        "model": LLM, "messages": _history(6), "stream": False, "truncate": False,
        "options": {"num_ctx": num_ctx, "num_predict": 4}})
    assert r.status_code == 400
    assert f"takes at most {num_ctx - 1}" in r.json()["error"]


def test_a_larger_num_ctx_is_reported(base_url: str) -> None:
    r = httpx.post(base_url + "/api/chat", timeout=120, json={
        "model": LLM, "messages": [{"role": "user", "content": "hi"}], "stream": False,
        "options": {"num_ctx": 4 * CONTEXT, "num_predict": 1}})
    assert r.status_code == 200, r.text
    assert r.headers["x-npu-proxy-context-length"] == str(CONTEXT)


# --- which messages truncation may drop ------------------------------------------------------


def test_truncation_keeps_the_system_messages_and_the_last_user_turn() -> None:
    roles = ["system", "user", "assistant", "user", "assistant", "tool", "user", "assistant",
             "tool"]
    messages = [ChatMessage(role=r) for r in roles]
    assert droppable(messages) == [1, 2, 3, 4, 5]
    assert fewest_dropped(lambda k: k >= 3, 5) == 3
    assert fewest_dropped(lambda k: False, 5) is None
