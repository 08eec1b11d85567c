"""The OpenAI API through the official SDK (strict response validation) and raw HTTP."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import openai
import pytest
from serverctl import Server

LLM = "smollm2:135m"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0,
                         _strict_response_validation=True)


# NOTE: the answer is forced by a regex, so the stop string comes whatever the model's
# numbers (issue 28: no test on a model's free text).
FORCED = {"structured_outputs": {"regex": "The capital of France is Paris\\."}}


def test_chat_answers_with_paris(client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=LLM, messages=QUESTION, temperature=0)  # type: ignore[arg-type]
    resp = raw.parse()
    assert raw.headers["x-request-id"]
    assert raw.headers["x-npu-proxy-device"] == "CPU"
    assert int(raw.headers["x-npu-proxy-token-count"]) == resp.usage.prompt_tokens  # type: ignore[union-attr]
    choice = resp.choices[0]
    # NOTE: what the model says is its own (issue 28): an answer, ended by the model or the
    # context.
    assert choice.message.content
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    assert resp.object == "chat.completion"
    usage = resp.usage
    assert usage is not None and usage.prompt_tokens > 10 and usage.completion_tokens > 3
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_chat_stream_shape(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(
        model=LLM, messages=QUESTION, temperature=0, stream=True))  # type: ignore[arg-type]
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    roles = [c.choices[0].delta.role for c in chunks if c.choices[0].delta.role]
    assert roles == ["assistant"] and chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert all(c.usage is None for c in chunks)


def test_stream_text_equals_non_stream_text(client: openai.OpenAI) -> None:
    # NOTE: forced by a regex, so both give it whatever else runs (issue 28); unforced, the
    # equality holds by construction only in deterministic mode (tests/test_deterministic.py).
    full = client.chat.completions.create(model=LLM, messages=QUESTION, temperature=0,  # type: ignore[arg-type]
                                          extra_body=FORCED)
    chunks = client.chat.completions.create(model=LLM, messages=QUESTION, temperature=0,  # type: ignore[arg-type]
                                            stream=True, extra_body=FORCED)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == \
        full.choices[0].message.content


def test_include_usage(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(
        model=LLM, messages=QUESTION, max_tokens=5, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True}))
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 5
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-2].choices[0].finish_reason == "length"


def test_completions(client: openai.OpenAI, base_url: str) -> None:
    resp = client.completions.create(model=LLM, prompt="The capital of France is",
                                     max_tokens=6, temperature=0)
    assert resp.object == "text_completion"
    assert resp.choices[0].text.strip()
    assert resp.usage is not None and resp.usage.completion_tokens <= 6
    # NOTE: the SDK types a completion chunk's finish_reason as non-null, while OpenAI itself
    # (and every compatible server) sends null until the last chunk: validate loosely here.
    loose = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    streamed = list(loose.completions.create(model=LLM, prompt="The capital of France is",
                                             max_tokens=6, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in streamed)  # NOTE: not resp's text (issue 28)
    assert streamed[-1].choices[0].finish_reason in ("length", "stop")


def test_completions_default_max_tokens_is_16(client: openai.OpenAI) -> None:
    resp = client.completions.create(model=LLM, prompt="Once upon a time", temperature=0)
    assert resp.usage is not None and resp.usage.completion_tokens <= 16


def test_models(client: openai.OpenAI) -> None:
    ids = [m.id for m in client.models.list()]
    assert LLM in ids
    assert client.models.retrieve(LLM).id == LLM
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model:7b")


def test_unknown_model_is_404_model_not_found(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="no-such-model", messages=QUESTION)  # type: ignore[arg-type]
    assert info.value.code == "model_not_found"
    body = info.value.body
    assert isinstance(body, dict) and set(body) >= {"message", "type", "param", "code"}


@pytest.mark.parametrize("body, param", [
    (b"{not json", None),
    (b'{"model": "smollm2:135m"}', "messages"),
    (b'{"model": "smollm2:135m", "messages": "hi"}', "messages"),
    (b'{"model": "smollm2:135m", "messages": [{"role": "user", "content": "x"}],'
     b' "max_tokens": "ten"}', "max_tokens"),
    (b'{"model": "smollm2:135m", "messages": [{"role": "user", "content": "x"}],'
     b' "temperature": 7}', "temperature"),
    (b'{"model": "smollm2:135m", "messages": [{"role": "user", "content": "x"}], "n": 3}',
     "n"),
])
def test_bad_input_is_400_in_openai_shape(base_url: str, body: bytes,
                                          param: str | None) -> None:
    r = httpx.post(base_url + "/v1/chat/completions", content=body,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["message"]
    if param is not None:
        assert err["param"] == param
    assert r.headers["x-request-id"]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/embeddings",
                                  "/api/chat", "/api/generate", "/api/embed", "/v1/messages"])
def test_body_that_is_not_utf8_is_400_in_each_apis_shape(base_url: str, path: str) -> None:
    # NOTE: in a field every route reads; msgspec skips unknown fields without decoding them.
    body = b'{"model": "smollm2:135m\xe9"}'
    r = httpx.post(base_url + path, content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    if path == "/v1/messages":
        assert r.json()["type"] == "error"
        message = r.json()["error"]["message"]
    elif path.startswith("/v1/"):
        message = r.json()["error"]["message"]
    else:
        message = r.json()["error"]
    assert "UTF-8" in message


HUGE = 10**20  # valid JSON, beyond the 64-bit integers that reach the worker
HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(("path", "body", "name"), [
    ("/v1/chat/completions", {"messages": HI, "max_tokens": HUGE}, "max_tokens"),
    ("/v1/chat/completions", {"messages": HI, "seed": HUGE}, "seed"),
    ("/v1/messages", {"messages": HI, "max_tokens": 5, "top_k": HUGE}, "top_k"),
    ("/api/generate", {"prompt": "hi", "options": {"num_predict": HUGE}}, "num_predict"),
    ("/api/chat", {"messages": HI, "options": {"num_ctx": -HUGE}}, "num_ctx"),
])
def test_integers_beyond_64_bits_are_400_in_each_apis_shape(
        base_url: str, path: str, body: dict[str, object], name: str) -> None:
    r = httpx.post(base_url + path, json={"model": "smollm2:135m", "stream": False, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    message = error if isinstance(error, str) else error["message"]
    assert name in message and "out of range" in message


def test_unknown_fields_are_ignored(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model=LLM, messages=QUESTION, max_tokens=3, user="u1", store=False,  # type: ignore[arg-type]
        metadata={"a": "b"}, extra_body={"something_new": {"x": 1}})
    assert resp.choices[0].message.content


def test_max_completion_tokens_wins(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model=LLM, messages=[{"role": "user", "content": "Write a long story about a cat."}],
        max_tokens=50, max_completion_tokens=4)
    assert resp.usage is not None and resp.usage.completion_tokens == 4
    assert resp.choices[0].finish_reason == "length"


def test_max_completion_tokens_0_is_refused_as_max_tokens_0_is(client: openai.OpenAI) -> None:
    """0 is a value, not "unset": it used to fall through to the default length."""
    for field in ("max_tokens", "max_completion_tokens"):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=LLM, messages=QUESTION,  # type: ignore[arg-type]
                                           **{field: 0})  # type: ignore[call-overload]
        assert err.value.param == field, err.value.body


def test_stop_is_honoured(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model=LLM, messages=QUESTION, temperature=0,  # type: ignore[arg-type]
                                          stop=["Paris"], extra_body=FORCED)
    # NOTE: the space before "Paris" may be that token's (` Paris`), so it may go with it.
    assert (resp.choices[0].message.content or "").rstrip() == "The capital of France is"
    assert resp.choices[0].finish_reason == "stop"
    streamed = client.chat.completions.create(model=LLM, messages=QUESTION, temperature=0,  # type: ignore[arg-type]
                                              stop="Paris", stream=True, extra_body=FORCED)
    assert "".join(c.choices[0].delta.content or "" for c in streamed).rstrip() == \
        "The capital of France is"


def test_sampling_without_a_seed_varies_and_with_one_repeats(client: openai.OpenAI) -> None:
    """OpenVINO GenAI's rng_seed defaults to 0: every sampled request without a seed drew the
    same numbers, so a client's "regenerate" got the same text back."""
    story = [{"role": "user", "content": "Write a story about a cat."}]

    def ask(**extra: int) -> str:
        r = client.chat.completions.create(model=LLM, messages=story,  # type: ignore[arg-type]
                                           max_tokens=32, temperature=1.0, **extra,
                                           # the whole vocabulary, as the test is about seeds
                                           extra_body={"top_k": 0, "min_p": 0.0})
        return r.choices[0].message.content or ""

    assert len({ask() for _ in range(4)}) > 1
    # NOTE: a prompt state taken from the prefix cache may differ from a fresh one in the last
    # bits, which can flip a draw; the cache is warm for the last two.
    seeded = [ask(seed=5) for _ in range(3)]
    assert seeded[1] == seeded[2]


def test_developer_role(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(model=LLM, temperature=0, max_tokens=20, messages=[
        {"role": "developer", "content": "You answer in one short sentence."},
        *QUESTION])  # type: ignore[list-item]
    assert resp.choices[0].message.content


def test_eight_concurrent_streams(client: openai.OpenAI) -> None:
    def one(i: int) -> tuple[str, str | None]:
        stream = client.chat.completions.create(model=LLM, messages=QUESTION,  # type: ignore[arg-type]
                                                temperature=0, stream=True, max_tokens=30)
        parts, finish = [], None
        for c in stream:
            parts.append(c.choices[0].delta.content or "")
            finish = c.choices[0].finish_reason or finish
        return "".join(parts), finish

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(8)))
    for text, finish in results:
        # NOTE: batched, each may pick another token at a near tie (docs/configuration.md,
        # "Deterministic mode"): every stream is whole, whatever it says.
        assert text
        assert finish in ("stop", "length")


def _abort_line(server: Server, rid: str, timeout: float = 10.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in server.worker_log("llm").splitlines():
            if f"finished request_id={rid} " in line:
                return line
        time.sleep(0.1)
    raise AssertionError(f"no finish line for {rid}")


def test_closing_a_stream_stops_generation(server: Server) -> None:
    rid = f"test-abort-{time.time_ns()}"
    body = {"model": LLM, "stream": True, "max_tokens": 400, "temperature": 0.8,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": "Write a very long story about a dog."}]}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body,
                      headers={"x-request-id": rid}, timeout=30) as r:
        assert r.headers["x-request-id"] == rid
        seen = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                seen += 1
            if seen >= 4:
                break
    line = _abort_line(server, rid)
    assert "reason=abort" in line
    tokens = int(line.rsplit("completion_tokens=", 1)[1].split()[0])
    assert tokens < 400, line


def test_disconnect_before_non_streaming_answer_aborts(server: Server) -> None:
    rid = f"test-abort-ns-{time.time_ns()}"
    # NOTE: ignore_eos, so the answer cannot end on its own before the client gives up.
    body = {"model": LLM, "max_tokens": 4000, "temperature": 0.8, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Write a very long story about a dog."}]}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/chat/completions", json=body,
                   headers={"x-request-id": rid}, timeout=1.0)
    line = _abort_line(server, rid)
    assert "reason=abort" in line
    assert int(line.rsplit("completion_tokens=", 1)[1].split()[0]) < 4000
