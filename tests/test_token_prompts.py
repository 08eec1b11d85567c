"""Token-id prompts on OpenAI completions (issue 44): `prompt` as a list of the model's token
ids, or a list holding one such list — what lm-evaluation-harness's `local-completions`
model and vLLM clients send. The ids are read as given (no template, no tokenizer): a
sequence that is not the tokenizer's own spelling of its text reaches the model with its own
length. `echo` gives back their text. Ids out of the vocabulary, lists of the wrong kinds and
more ids than the context holds are 400s in OpenAI's error shape, and the server goes on.
"""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

LLM = "smollm2:135m"
TEXT = "The quick brown fox jumps over the lazy dog."


def _tokens(http: httpx.Client, text: str) -> tuple[list[int], list[str]]:
    r = http.post("/tokenize", json={"model": LLM, "prompt": text, "return_token_strs": True})
    assert r.status_code == 200, r.text
    return r.json()["tokens"], r.json()["token_strs"]


def _complete(http: httpx.Client, prompt: Any, **extra: Any) -> httpx.Response:
    return http.post("/v1/completions", json={"model": LLM, "prompt": prompt,
                                              "max_tokens": 2, "temperature": 0, **extra})


def test_token_ids_reach_the_model_as_given(http: httpx.Client) -> None:
    ids, _ = _tokens(http, TEXT)
    assert len(ids) > 5
    for prompt in (ids, [ids]):
        r = _complete(http, prompt)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == len(ids)
    # NOTE: "fox" spelled letter by letter: the text's own tokenization has one token there,
    # so a count of the ids' length shows they were not read as text again.
    letters = [_tokens(http, c)[0] for c in ("f", "o", "x")]
    assert all(len(t) == 1 for t in letters), letters
    spelled = [t[0] for t in letters]
    r = _complete(http, spelled, echo=True)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["prompt_tokens"] == 3
    assert _tokens(http, "fox")[0] != spelled
    assert body["choices"][0]["text"].startswith("fox")


def test_the_openai_sdk_sends_token_ids(base_url: str, http: httpx.Client) -> None:
    ids, pieces = _tokens(http, TEXT)
    oai = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)
    made = oai.completions.create(model=LLM, prompt=[ids], max_tokens=2, temperature=0,
                                  echo=True)
    assert made.usage is not None and made.usage.prompt_tokens == len(ids)
    assert made.choices[0].text.startswith("".join(pieces))


@pytest.mark.parametrize(("prompt", "says"), [
    ([10**7], "token id 10000000 is not in the vocabulary"),
    ([5, -1], "token id -1 is not in the vocabulary"),
    ([2**40], "token id 1099511627776 is not in the vocabulary"),
    ([True, 5], "'prompt' must be"),
    ([1.5], "'prompt' must be"),
    (["a", 1], "'prompt' must be"),
    ([[1, 2], "b"], "exactly one prompt"),
    ([[1, 2], [3, 4]], "exactly one prompt"),
    ([[]], "'prompt' must be"),
    ([[[1]]], "'prompt' must be"),
    ([{"a": 1}], "'prompt' must be"),
])
def test_hostile_token_prompts_are_400s(http: httpx.Client, prompt: Any, says: str) -> None:
    r = _complete(http, prompt)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] in ("prompt", None)
    assert says in error["message"], error


def test_more_ids_than_the_context_is_the_context_error(http: httpx.Client) -> None:
    shown = http.get(f"/v1/models/{LLM}")
    assert shown.status_code == 200, shown.text
    context = shown.json()["max_model_len"]
    assert context > 0
    for n in (context + 1, context):
        r = _complete(http, [100] * n)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == "context_length_exceeded", error
        assert error["param"] == "prompt", error
    r = _complete(http, [100] * 4)
    assert r.status_code == 200, r.text


def test_tokenizer_info_is_what_lm_evaluation_harness_reads(http: httpx.Client) -> None:
    """vLLM's GET /tokenizer_info, which lm-evaluation-harness's `remote` tokenizer reads
    (its end-of-text token, its chat template) before tokenizing through /tokenize and
    /detokenize, with no model named (the default LLM) or with one."""
    for query in ("", f"?model={LLM}"):
        r = http.get("/tokenizer_info" + query)
        assert r.status_code == 200, r.text
        info = r.json()
        assert info["model"] == LLM
        eos = info["eos_token"]
        assert isinstance(eos, str) and eos
        ids = http.post("/tokenize", json={"prompt": eos, "add_special_tokens": False})
        assert ids.status_code == 200, ids.text
        assert ids.json()["count"] == 1
        back = http.post("/detokenize", json={"tokens": ids.json()["tokens"]})
        assert back.status_code == 200 and back.json()["prompt"] == eos
        assert "{%" in info["chat_template"]
        card = http.get(f"/v1/models/{LLM}").json()
        assert info["model_max_length"] == card["max_model_len"] > 0
    r = http.get("/tokenizer_info?model=no-such-model")
    assert r.status_code == 404, r.text
    assert r.json()["error"]["code"] == "model_not_found"
