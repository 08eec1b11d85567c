"""POST /v1/rerank (and /rerank, /v2/rerank) against the shared server's rerank worker.

The worker runs the embedded reranker: the real all-MiniLM-L6-v2 weights built into a
cross-encoder-shaped IR that scores a pair as the embedding model would (workers/
rerank_model.py), so its scores can be checked against /v1/embeddings of the same texts.
"""

from __future__ import annotations

import asyncio
import math
import shutil
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
from serverctl import MODEL_CACHE, Server

from npu_proxy.models.locate import MINILM_RERANK_FOLDER

RERANK = "all-minilm-rerank:l6-v2"
EMBED = "all-minilm:l6-v2"
LLM = "smollm2:135m"
PUBLISHED = "published-rerank:test"

# (query, relevant document, irrelevant documents): real questions a retriever would face.
CASES = [
    ("What is the capital of France?",
     "Paris is the capital and largest city of France.",
     ["The mitochondria is the powerhouse of the cell.", "Bananas are rich in potassium."]),
    ("how do I bake bread",
     "Mix flour, water, yeast and salt, let the dough rise, then bake it at 220 C.",
     ["Stock markets fell sharply on Monday.", "The Eiffel Tower is in Paris."]),
    ("python list sort",
     "Use sorted(xs) or xs.sort() to order a list in Python.",
     ["The weather is sunny today.", "A guitar usually has six strings."]),
    ("symptoms of the flu",
     "Fever, cough, sore throat and muscle aches are common flu symptoms.",
     ["A guitar usually has six strings.", "Interest rates were raised by the central bank."]),
]


def rerank(base_url: str, path: str = "/v1/rerank", **body: Any) -> httpx.Response:
    return httpx.post(base_url + path, json={"model": RERANK, **body}, timeout=120)


def ok(base_url: str, **body: Any) -> dict[str, Any]:
    r = rerank(base_url, **body)
    assert r.status_code == 200, r.text
    data: dict[str, Any] = r.json()
    return data


def scores_by_index(data: dict[str, Any]) -> dict[int, float]:
    return {item["index"]: item["relevance_score"] for item in data["results"]}


def assert_openai_error(r: httpx.Response, status: int, param: str | None,
                        words: str) -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert words in error["message"], error["message"]


def test_shape_sorted_scores_usage_and_headers(base_url: str) -> None:
    query, good, bad = CASES[0]
    documents = [bad[0], good, bad[1]]
    r = rerank(base_url, query=query, documents=documents)
    assert r.status_code == 200, r.text
    data = r.json()
    assert set(data) == {"id", "model", "usage", "results"}
    assert data["id"].startswith("rerank-") and data["model"] == RERANK
    results = data["results"]
    assert sorted(item["index"] for item in results) == [0, 1, 2]
    for item in results:
        assert set(item) == {"index", "relevance_score", "document"}
        assert item["document"] == {"text": documents[item["index"]]}
        assert 0.0 <= item["relevance_score"] <= 1.0
    got = [item["relevance_score"] for item in results]
    assert got == sorted(got, reverse=True)
    total = data["usage"]["total_tokens"]
    assert set(data["usage"]) == {"total_tokens"} and total > 3 * 4
    assert r.headers["X-NPU-Proxy-Token-Count"] == str(total)
    assert r.headers["X-NPU-Proxy-Worker"] == "rerank"


def test_relevant_document_first_on_real_examples(base_url: str) -> None:
    for query, good, bad in CASES:
        data = ok(base_url, query=query, documents=[*bad, good])
        assert data["results"][0]["index"] == len(bad), (query, data)
        scores = scores_by_index(data)
        assert all(scores[len(bad)] > scores[i] + 0.05 for i in range(len(bad)))


def test_score_is_the_embedding_models_cosine(base_url: str) -> None:
    """The embedded reranker is the bi-encoder: (1 + cosine of the two embeddings) / 2."""
    query, good, bad = CASES[1]
    documents = [good, *bad]
    data = ok(base_url, query=query, documents=documents)
    r = httpx.post(base_url + "/v1/embeddings", timeout=120,
                   json={"model": EMBED, "input": [query, *documents]})
    assert r.status_code == 200, r.text
    vectors = np.array([item["embedding"] for item in r.json()["data"]])
    expected = (1.0 + vectors[1:] @ vectors[0]) / 2.0
    scores = scores_by_index(data)
    for i, want in enumerate(expected):
        assert math.isclose(scores[i], float(want), abs_tol=2e-4), (i, scores[i], want)


def test_top_n_cuts_the_sorted_list(base_url: str) -> None:
    query, good, bad = CASES[2]
    documents = [bad[0], bad[1], good]
    full = ok(base_url, query=query, documents=documents)["results"]
    one = ok(base_url, query=query, documents=documents, top_n=1)["results"]
    assert one == full[:1] and one[0]["index"] == 2
    assert ok(base_url, query=query, documents=documents, top_n=2)["results"] == full[:2]
    assert ok(base_url, query=query, documents=documents, top_n=0)["results"] == full
    assert ok(base_url, query=query, documents=documents, top_n=10)["results"] == full


def test_return_documents_false_leaves_the_texts_out(base_url: str) -> None:
    query, good, bad = CASES[3]
    data = ok(base_url, query=query, documents=[good, *bad], return_documents=False)
    assert all(set(item) == {"index", "relevance_score"} for item in data["results"])
    assert data["results"][0]["index"] == 0


def test_documents_as_objects_and_every_path_agree(base_url: str) -> None:
    query, good, bad = CASES[0]
    texts = [good, *bad]
    plain = ok(base_url, query=query, documents=texts)
    objects = ok(base_url, query=query, documents=[{"text": t} for t in texts])
    assert objects["results"] == plain["results"]
    for path in ("/rerank", "/v2/rerank"):
        r = rerank(base_url, path, query=query, documents=texts)
        assert r.status_code == 200, r.text
        assert r.json()["results"] == plain["results"]


def test_many_documents_with_a_long_query(base_url: str) -> None:
    """One query against 16+ documents (what crashed OpenVINO's pair tokenizer) scores each
    document as it scores alone."""
    query = "which of these numbered notes talks about baking bread in a hot oven at home?"
    documents = [f"note {i}: " + ("bake the bread in a hot oven" if i == 37 else
                                  f"the train leaves platform {i} at noon") for i in range(48)]
    data = ok(base_url, query=query, documents=documents)
    assert len(data["results"]) == 48 and data["results"][0]["index"] == 37
    scores = scores_by_index(data)
    for i in (0, 17, 37):
        alone = scores_by_index(ok(base_url, query=query, documents=[documents[i]]))
        assert math.isclose(alone[0], scores[i], abs_tol=1e-4)


def test_huge_documents_are_truncated_unless_told_not_to(base_url: str) -> None:
    query = "bread"
    huge = "bread is baked in an oven. " * 2000  # about 14,000 tokens
    data = ok(base_url, query=query, documents=[huge, "the stock market"])
    assert data["results"][0]["index"] == 0
    # NOTE: each pair is cut at the model's 512 tokens; the short one is a few tokens.
    assert data["usage"]["total_tokens"] <= 512 + 16
    r = rerank(base_url, query=query, documents=["short", huge], truncate=False)
    assert_openai_error(r, 400, "documents", "document 1")
    assert r.json()["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"query": "", "documents": ["a"]}, "query", "must not be empty"),
    ({"query": "   ", "documents": ["a"]}, "query", "must not be empty"),
    ({"documents": ["a"]}, "query", "required"),
    ({"query": ["q"], "documents": ["a"]}, "query", "a string"),
    ({"query": "q"}, "documents", "required"),
    ({"query": "q", "documents": []}, "documents", "must not be empty"),
    ({"query": "q", "documents": "a"}, "documents", "must be a list"),
    ({"query": "q", "documents": ["a", 3]}, "documents", "item 1"),
    ({"query": "q", "documents": [{"title": "a"}]}, "documents", "item 0"),
    ({"query": "q", "documents": [{"text": None}]}, "documents", "item 0"),
    ({"query": "q", "documents": ["a"], "top_n": -1}, "top_n", "0 (every document) or more"),
    ({"query": "q", "documents": ["a"], "top_n": "2"}, "top_n", "Expected `int"),
    ({"query": "q", "documents": ["a"], "return_documents": "yes"}, "return_documents",
     "Expected `bool"),
])
def test_bad_requests_are_400_in_openais_shape(base_url: str, body: dict[str, Any],
                                               param: str, words: str) -> None:
    assert_openai_error(rerank(base_url, **body), 400, param, words)


def test_models_that_do_not_rerank(base_url: str) -> None:
    body = {"query": "q", "documents": ["a"]}
    r = httpx.post(base_url + "/v1/rerank", json={"model": "no-such-model", **body}, timeout=30)
    assert_openai_error(r, 404, "model", "not found")
    assert r.json()["error"]["code"] == "model_not_found"
    for name, what in ((EMBED, "an embedding model"), (LLM, "a text generation model")):
        r = httpx.post(base_url + "/rerank", json={"model": name, **body}, timeout=30)
        assert_openai_error(r, 400, "model", what)
    r = httpx.post(base_url + "/v1/chat/completions", timeout=30, json={
        "model": RERANK, "messages": [{"role": "user", "content": "hi"}]})
    assert_openai_error(r, 400, "model", "a reranking model; use the rerank")


def test_limits_are_answered_before_the_worker(base_url: str) -> None:
    r = rerank(base_url, query="q", documents=["a"] * 1001)
    assert_openai_error(r, 400, "documents", "max_rerank_documents")
    r = rerank(base_url, query="q", documents=["a", "b" * 100_001])
    assert_openai_error(r, 400, "documents", "max_rerank_chars")
    r = rerank(base_url, query="q" * 100_001, documents=["a"])
    assert_openai_error(r, 400, "query", "max_rerank_chars")
    r = httpx.post(base_url + "/v1/rerank", content=b"{not json", timeout=30,
                   headers={"Content-Type": "application/json"})
    assert_openai_error(r, 400, None, "not valid JSON")


def test_capability_is_listed(base_url: str) -> None:
    r = httpx.post(base_url + "/api/show", json={"model": RERANK}, timeout=30)
    assert r.status_code == 200 and r.json()["capabilities"] == ["rerank"]


def test_concurrent_requests_get_their_own_scores(base_url: str) -> None:
    """Requests in flight together (the same query and different ones) are batched in the
    worker; each answer is the one it gets alone."""
    bodies = [{"query": q, "documents": [*bad, good]} for q, good, bad in CASES]
    bodies += [{"query": CASES[0][0], "documents": [d, CASES[1][1]]} for d in CASES[2][2]]
    alone = [scores_by_index(ok(base_url, **body)) for body in bodies]

    async def all_at_once() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
            return await asyncio.gather(*(
                client.post("/v1/rerank", json={"model": RERANK, **body})
                for body in bodies * 3))

    answers = asyncio.run(all_at_once())
    for i, r in enumerate(answers):
        assert r.status_code == 200, r.text
        want = alone[i % len(bodies)]
        got = scores_by_index(r.json())
        assert got.keys() == want.keys()
        assert all(math.isclose(got[k], want[k], abs_tol=1e-4) for k in want)


@pytest.fixture(scope="module")
def published(server: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A rerank worker on a reranker folder as OpenVINO publishes them: a tokenizer with one
    input, to which GenAI adds the second (the embedded reranker's files otherwise, which the
    shared server built)."""
    import openvino as ov
    import openvino_tokenizers
    from transformers import AutoTokenizer

    tmp = tmp_path_factory.mktemp("published")
    folder = tmp / "reranker"
    shutil.copytree(MODEL_CACHE / MINILM_RERANK_FOLDER, folder)
    single = openvino_tokenizers.convert_tokenizer(AutoTokenizer.from_pretrained(folder),
                                                   max_length=512)
    ov.save_model(single, folder / "openvino_tokenizer.xml")
    srv = Server(tmp, workers=[{"name": "rerank", "role": "rerank", "model": PUBLISHED}],
                 model_cache=str(tmp / "cache"),
                 models={PUBLISHED: {"path": str(folder), "kind": "rerank"}}).start()
    yield srv
    srv.stop()


def test_a_published_reranker_gets_a_pair_safe_tokenizer(published: Server,
                                                         base_url: str) -> None:
    """A long query against many short documents corrupts memory in a published reranker's
    own pair tokenizer; the worker loads it with a pair-safe one and scores as the embedded
    model does."""
    query = " ".join(f"word{i}" for i in range(40))
    documents = [f"doc {i}" for i in range(32)]
    r = httpx.post(published.url + "/v1/rerank", timeout=120,
                   json={"model": PUBLISHED, "query": query, "documents": documents})
    assert r.status_code == 200, r.text
    theirs = scores_by_index(r.json())
    ours = scores_by_index(ok(base_url, query=query, documents=documents))
    assert all(math.isclose(theirs[i], ours[i], abs_tol=1e-4) for i in ours)
    [marker] = (published.tmp / "cache" / ".rerank-pairs").glob("*/pair-safe-from.txt")
    assert marker.read_text().strip() == str((published.tmp / "reranker").resolve())


def test_hostile_texts_are_scored(base_url: str) -> None:
    """Control characters, NUL, special-token spellings, emoji, combining marks and
    right-to-left text are text like any other."""
    documents = ["a\x00b", "\x01\x02\x7f", "[CLS] [SEP] [PAD] [MASK] [UNK]", "😀" * 300,
                 "e\u0301" * 200, "مرحبا بالعالم", "\u200b\u200e", " ", ""]
    for query in ("[SEP]", "x\x00y", "😀 bread"):
        data = ok(base_url, query=query, documents=documents)
        assert sorted(item["index"] for item in data["results"]) == list(range(len(documents)))
        assert all(0.0 <= item["relevance_score"] <= 1.0 for item in data["results"])
