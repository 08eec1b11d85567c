"""The prompt's own log-probabilities (issue 44, point 1): OpenAI completions' `echo` with
`logprobs` (with `max_tokens` 0 a text is scored, nothing generated: what perplexity and
log-likelihood evaluations send, a prompt of token ids included) and vLLM's `prompt_logprobs`
on completions and chat.

Each prompt token comes with the log-probability the model gives it after the tokens before
it (the first has none: null); the pieces join to the prompt. They are the model's own
numbers: the first token a greedy generation writes after a prompt has the log-probability
that scoring the prompt with that token appended gives it.

GenAI computes no logits for a prompt's start taken from the prefix cache, so only a worker
that reads every prompt whole gives them (`prefix_caching = false`, as this module's private
server's; or deterministic): the default worker, which reuses prompts, refuses with a 400
that says which setting gives them.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from serverctl import Server

LLM = "smollm2:135m"
TEXT = "The quick brown fox jumps over the lazy dog. Then it runs into the forest"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = Server(tmp_path_factory.mktemp("scoring"), workers=[
        {"name": "llm", "role": "llm", "prefix_caching": False}]).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def oai(srv: Server) -> openai.OpenAI:
    # NOTE: not strict: the SDK's types have no null in token_logprobs, which OpenAI's
    # legacy completions (and vLLM) give the first token of an echoed prompt.
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def http(srv: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=srv.url, timeout=120) as c:
        yield c


def _scored(oai: openai.OpenAI, prompt: str) -> Any:
    return oai.completions.create(model=LLM, prompt=prompt, echo=True, logprobs=1,
                                  max_tokens=0, temperature=0)


def test_echo_with_max_tokens_0_scores_the_prompt_and_generates_nothing(
        oai: openai.OpenAI) -> None:
    resp = _scored(oai, TEXT)
    choice = resp.choices[0]
    assert choice.text == TEXT
    assert resp.usage is not None and resp.usage.completion_tokens == 0
    lp = choice.logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.text_offset
    assert lp.top_logprobs is not None
    assert len(lp.tokens) == resp.usage.prompt_tokens > 10
    assert "".join(lp.tokens) == TEXT
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    rest = lp.token_logprobs[1:]
    assert all(isinstance(x, float) and x <= 0 and math.isfinite(x) for x in rest)
    # NOTE: a text is not all certain: some token costs the model something.
    assert min(rest) < -0.5  # type: ignore[type-var]
    for token, logprob, top in zip(lp.tokens[1:], rest, lp.top_logprobs[1:], strict=True):
        assert top == {token: logprob}
    offsets = [0]
    for token in lp.tokens[:-1]:
        offsets.append(offsets[-1] + len(token))
    assert lp.text_offset == offsets


def _same(a: float, b: float) -> bool:
    """One prediction computed twice. NOTE: the CPU plugin's kernels split a step's tokens by
    how many there are (one generated token; prompts of 17 or 18 tokens), so the same
    position's log-probability comes out with different float error, which grows with the
    logits: 0.149 apart for a token at -7.1 on an AMX CPU at f32 (below 0.1 on AVX2). Another
    position's prediction is another number altogether."""
    return abs(a - b) < 0.1 + 0.05 * max(abs(a), abs(b))


def test_a_token_scores_as_the_model_gave_it(oai: openai.OpenAI) -> None:
    """The first token greedy decoding writes after the text has, when the text with it is
    scored, the log-probability generation gave it: the scores are the model's predictions,
    each at its own token."""
    made = oai.completions.create(model=LLM, prompt=TEXT, max_tokens=1, temperature=0,
                                  logprobs=1)
    generated = made.choices[0].logprobs
    assert generated is not None and generated.tokens and generated.token_logprobs
    token, logprob = generated.tokens[0], generated.token_logprobs[0]
    assert token and logprob is not None
    scored = _scored(oai, TEXT + token).choices[0].logprobs
    assert scored is not None and scored.tokens and scored.token_logprobs
    assert scored.tokens[-1] == token
    last = scored.token_logprobs[-1]
    assert last is not None and _same(last, logprob), (last, logprob)
    # NOTE: causal: the text's own tokens score the same whatever follows them.
    alone = _scored(oai, TEXT).choices[0].logprobs
    assert alone is not None and alone.token_logprobs
    n = len(alone.token_logprobs)
    assert scored.tokens[:n] == alone.tokens
    for a, b in zip(alone.token_logprobs[1:], scored.token_logprobs[1:n], strict=True):
        assert a is not None and b is not None and _same(a, b), (a, b)


def test_token_ids_score_as_their_text_in_lm_evaluation_harness_form(
        oai: openai.OpenAI, http: httpx.Client) -> None:
    """lm-evaluation-harness's `local-completions` log-likelihood request: the prompt as a
    list of one token-id list, echo, logprobs 1, max_tokens 1, temperature 0. Its reader
    takes the prompt's scores from the echoed list (all but the generated last entry)."""
    r = http.post("/tokenize", json={"model": LLM, "prompt": TEXT})
    assert r.status_code == 200, r.text
    ids = r.json()["tokens"]
    made = oai.completions.create(model=LLM, prompt=[ids], echo=True, logprobs=1,
                                  max_tokens=1, temperature=0, seed=1234)
    lp = made.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs is not None
    assert len(lp.token_logprobs) == len(ids) + 1
    assert "".join(lp.tokens[:len(ids)]) == TEXT
    assert made.choices[0].text.startswith(TEXT)
    texts = _scored(oai, TEXT).choices[0].logprobs
    assert texts is not None and texts.token_logprobs is not None
    assert len(texts.token_logprobs) == len(ids)
    assert lp.token_logprobs[0] is None and texts.token_logprobs[0] is None
    for a, b in zip(texts.token_logprobs[1:], lp.token_logprobs[1:len(ids)], strict=True):
        assert a is not None and b is not None and _same(a, b), (a, b)


def test_echo_with_logprobs_streams_the_prompt_first_then_the_tokens(
        oai: openai.OpenAI) -> None:
    chunks = list(oai.completions.create(model=LLM, prompt=TEXT, echo=True, logprobs=1,
                                         max_tokens=4, temperature=0, stream=True,
                                         stream_options={"include_usage": True}))
    texts = [c.choices[0] for c in chunks if c.choices]
    first = texts[0]
    assert first.text == TEXT
    assert first.logprobs is not None and first.logprobs.tokens is not None
    assert "".join(first.logprobs.tokens) == TEXT
    assert first.logprobs.token_logprobs and first.logprobs.token_logprobs[0] is None
    generated = [c.logprobs for c in texts[1:] if c.logprobs is not None]
    assert generated and generated[0].text_offset and generated[0].text_offset[0] == len(TEXT)
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 4
    assert len(first.logprobs.tokens) == usage.prompt_tokens
    assert sum(len(g.tokens or []) for g in generated) == 4


def test_vllm_prompt_logprobs_on_completions_and_chat(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"model": LLM, "prompt": TEXT, "max_tokens": 2,
                                           "temperature": 0, "prompt_logprobs": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    scores = body["choices"][0]["prompt_logprobs"]
    assert len(scores) == body["usage"]["prompt_tokens"]
    assert scores[0] is None
    pieces = []
    for entry in scores[1:]:
        ((token_id, score),) = entry.items()
        assert int(token_id) >= 0 and score["logprob"] <= 0 and score["rank"] is None
        pieces.append(score["decoded_token"])
    assert TEXT.endswith("".join(pieces))
    assert body["choices"][0]["text"] and body["usage"]["completion_tokens"] == 2
    r = http.post("/v1/chat/completions", json={"model": LLM, "messages": QUESTION,
                                                "max_tokens": 2, "prompt_logprobs": 1})
    assert r.status_code == 200, r.text
    body = r.json()
    scores = body["prompt_logprobs"]
    assert len(scores) == body["usage"]["prompt_tokens"] and scores[0] is None
    # NOTE: the prompt as the model read it: the chat template's rendering of the question.
    read = "".join(next(iter(e.values()))["decoded_token"] for e in scores[1:])
    assert QUESTION[0]["content"] in read
    assert body["choices"][0]["message"]["content"]


@pytest.mark.parametrize("path,extra", [
    ("/v1/completions", {"prompt_logprobs": 21}),
    ("/v1/completions", {"prompt_logprobs": -1}),
    ("/v1/completions", {"prompt_logprobs": 1, "stream": True}),
    ("/v1/completions", {"max_tokens": 0}),
    ("/v1/completions", {"max_tokens": -1, "echo": True, "logprobs": 1}),
    ("/v1/completions", {"echo": True, "logprobs": 6}),
    ("/v1/chat/completions", {"prompt_logprobs": 21}),
    ("/v1/chat/completions", {"prompt_logprobs": 0, "stream": True}),
])
def test_bad_prompt_logprobs_are_400s(http: httpx.Client, path: str,
                                      extra: dict[str, Any]) -> None:
    body: dict[str, Any] = {"model": LLM, "max_tokens": 2, **extra}
    body.update({"messages": QUESTION} if "chat" in path else {"prompt": "Hi"})
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_a_worker_that_reuses_prompts_refuses_to_score_them(base_url: str) -> None:
    """The shared server's llm worker keeps its prefix cache: a 400 naming the settings,
    even for a prompt it has just read (whose start it would take from the cache)."""
    body = {"model": LLM, "prompt": TEXT, "max_tokens": 0, "echo": True, "logprobs": 1}
    with httpx.Client(base_url=base_url, timeout=120) as c:
        assert c.post("/v1/completions", json={**body, "max_tokens": 1, "echo": False,
                                               "logprobs": None}).status_code == 200
        r = c.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert "prefix_caching = false" in message and "deterministic" in message
