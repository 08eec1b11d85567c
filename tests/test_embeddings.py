"""Embeddings through the official clients (openai, ollama, LangChain) and raw HTTP.

Everything runs against the real server: the gateway, the embedding worker with
all-MiniLM-L6-v2 and, for the concurrency test, the LLM worker beside it.
"""

from __future__ import annotations

import base64
import concurrent.futures
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import ollama
import openai
import openvino_genai as ov_genai
import pytest
import zmq
from langchain_ollama import OllamaEmbeddings
from langchain_openai import OpenAIEmbeddings
from prometheus_client.parser import text_string_to_metric_families
from serverctl import Server, wait_for

from npu_proxy.models.locate import minilm_ir_folder
from npu_proxy.protocol.config import Config, WorkerSpec
from npu_proxy.protocol.liveness import Heartbeat
from npu_proxy.protocol.messages import Abort, Embed, Embeddings, ErrorCode, Failed, reply_decoder
from npu_proxy.protocol.sockets import TOPIC_HEARTBEAT, configure_sub, connect, worker_endpoint
from npu_proxy.workers.embed_engine import EmbedEngine, _fast_counter
from npu_proxy.workers.embed_model import count_tokens, embedding_config

EMBED = "all-minilm:l6-v2"
LLM = "smollm2:135m"
CAT, FELINE, STOCKS = "The cat sits on the mat.", "A feline rests on a rug.", \
    "Stock markets fell today."
LONG = " ".join(f"word{i % 50}" for i in range(300))  # ~600 tokens, beyond the 256 context


def unique(text: str = "probe") -> str:
    """A text no earlier request sent, so it cannot come from the vector cache."""
    return f"{text} {uuid.uuid4().hex}"


def cosine(a: Any, b: Any) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.fixture(scope="module")
def oai(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0,
                         _strict_response_validation=True)


@pytest.fixture(scope="module")
def oai_loose(base_url: str) -> openai.OpenAI:
    # NOTE: the SDK validates the response before its post-parser decodes base64, so with
    # strict validation its own default (base64) fails against any server, OpenAI included.
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def olla(base_url: str) -> ollama.Client:
    return ollama.Client(host=base_url)


@pytest.fixture(scope="module")
def ir_folder(server: Server) -> Path:
    return minilm_ir_folder(server.config)


@pytest.fixture(scope="module")
def local_pipe(ir_folder: Path) -> Any:
    """The same pipeline the worker runs, in this process."""
    return ov_genai.TextEmbeddingPipeline(str(ir_folder), "CPU", embedding_config())


@pytest.fixture(scope="module")
def tokenizer(ir_folder: Path) -> Any:
    return ov_genai.Tokenizer(str(ir_folder))


# --- the official clients ----------------------------------------------------------------


def test_openai_sdk_default_base64(oai_loose: openai.OpenAI, oai: openai.OpenAI,
                                   tokenizer: Any) -> None:
    texts = [unique("hello"), "world"]
    resp = oai_loose.embeddings.create(model=EMBED, input=texts)
    floats = oai.embeddings.create(model=EMBED, input=texts, encoding_format="float")
    assert [d.index for d in resp.data] == [0, 1]
    for got, want in zip(resp.data, floats.data, strict=True):
        assert isinstance(got.embedding, list) and len(got.embedding) == 384
        # NOTE: base64 carries the very float32 bytes; both formats must agree exactly.
        assert got.embedding == want.embedding
    tokens = sum(count_tokens(tokenizer, texts))
    assert resp.usage.prompt_tokens == resp.usage.total_tokens == tokens


def test_openai_sdk_float_strict(oai: openai.OpenAI, tokenizer: Any) -> None:
    raw = oai.embeddings.with_raw_response.create(model=EMBED, input=CAT,
                                                  encoding_format="float")
    resp = raw.parse()
    assert resp.object == "list" and resp.model == EMBED
    assert len(resp.data) == 1 and resp.data[0].object == "embedding"
    vec = np.asarray(resp.data[0].embedding)
    assert vec.shape == (384,) and abs(np.linalg.norm(vec) - 1.0) < 1e-4
    assert resp.usage.prompt_tokens == count_tokens(tokenizer, [CAT])[0]
    assert raw.headers["x-npu-proxy-token-count"] == str(resp.usage.prompt_tokens)
    assert raw.headers["x-request-id"]


def test_base64_is_little_endian_float32(base_url: str) -> None:
    body = {"model": EMBED, "input": [CAT, FELINE]}
    b64 = httpx.post(base_url + "/v1/embeddings", json={**body, "encoding_format": "base64"})
    flt = httpx.post(base_url + "/v1/embeddings", json={**body, "encoding_format": "float"})
    assert b64.status_code == flt.status_code == 200
    for got, want in zip(b64.json()["data"], flt.json()["data"], strict=True):
        decoded = np.frombuffer(base64.b64decode(got["embedding"]), dtype="<f4")
        assert decoded.tolist() == want["embedding"]


def test_ollama_sdk_embed_and_embeddings(olla: ollama.Client, tokenizer: Any) -> None:
    texts = [CAT, unique("ollama")]
    resp = olla.embed(model=EMBED, input=texts)
    assert resp.model == EMBED and len(resp.embeddings) == 2
    assert all(len(v) == 384 for v in resp.embeddings)
    assert resp.prompt_eval_count == sum(count_tokens(tokenizer, texts))
    assert resp.total_duration is not None and resp.total_duration > 0
    assert resp.load_duration is not None and resp.load_duration >= 0
    single = olla.embed(model="all-minilm", input=CAT)
    assert len(single.embeddings) == 1
    legacy = olla.embeddings(model=EMBED, prompt=CAT)
    assert len(legacy.embedding) == 384
    assert max(abs(a - b) for a, b in zip(legacy.embedding, resp.embeddings[0],
                                          strict=True)) < 1e-6


def test_ollama_empty_input_loads_without_vectors(base_url: str) -> None:
    r = httpx.post(base_url + "/api/embed", json={"model": EMBED, "input": []})
    assert r.status_code == 200 and r.json()["embeddings"] == []
    r = httpx.post(base_url + "/api/embeddings", json={"model": EMBED, "prompt": ""})
    assert r.status_code == 200 and r.json() == {"embedding": []}


def test_langchain_ollama(base_url: str) -> None:
    emb = OllamaEmbeddings(model=EMBED, base_url=base_url)
    docs = emb.embed_documents([CAT, FELINE, STOCKS])
    query = emb.embed_query(CAT)
    assert len(docs) == 3 and len(query) == 384
    assert cosine(query, docs[0]) > 0.9999


def test_langchain_openai(base_url: str) -> None:
    emb = OpenAIEmbeddings(model=EMBED, base_url=base_url + "/v1", api_key="unused",  # type: ignore[arg-type]
                           check_embedding_ctx_length=False, max_retries=0)
    docs = emb.embed_documents([CAT, FELINE, STOCKS])
    query = emb.embed_query(CAT)
    assert len(docs) == 3 and len(query) == 384
    assert cosine(query, docs[0]) > 0.9999


# --- what the vectors mean ---------------------------------------------------------------


def test_semantic_similarity(oai: openai.OpenAI) -> None:
    data = oai.embeddings.create(model=EMBED, input=[CAT, FELINE, STOCKS],
                                 encoding_format="float").data
    cat, feline, stocks = (d.embedding for d in data)
    assert cosine(cat, feline) > cosine(cat, stocks) + 0.2


def test_served_vectors_equal_in_process_pipeline(oai: openai.OpenAI, olla: ollama.Client,
                                                  local_pipe: Any) -> None:
    texts = [CAT, FELINE, STOCKS, unique("fresh text"), LONG]
    want = np.asarray(local_pipe.embed_documents(texts), dtype=np.float32)
    served = oai.embeddings.create(model=EMBED, input=texts, encoding_format="float").data
    got = np.asarray([d.embedding for d in served], dtype=np.float32)
    assert got.shape == want.shape == (5, 384)
    assert np.abs(got - want).max() < 1e-5
    ollama_got = np.asarray(olla.embed(model=EMBED, input=texts).embeddings, dtype=np.float32)
    assert np.abs(ollama_got - want).max() < 1e-5


# --- limits and errors -------------------------------------------------------------------


def _openai_error(r: httpx.Response, status: int = 400) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str)
    return dict(err)


def _ollama_error(r: httpx.Response, status: int = 400) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and isinstance(body["error"], str)
    return str(body["error"])


@pytest.mark.parametrize("route", ["/v1/embeddings", "/api/embed"])
def test_too_many_items(server: Server, route: str) -> None:
    limit = server.config.max_embed_items
    r = httpx.post(server.url + route, json={"model": EMBED, "input": ["x"] * (limit + 1)})
    message = _openai_error(r)["message"] if route.startswith("/v1") else _ollama_error(r)
    assert "max_embed_items" in message and str(limit) in message


@pytest.mark.parametrize("route", ["/v1/embeddings", "/api/embed"])
def test_too_long_item(server: Server, route: str) -> None:
    limit = server.config.max_embed_chars
    r = httpx.post(server.url + route, json={"model": EMBED, "input": ["ok", "a" * (limit + 1)]})
    message = _openai_error(r)["message"] if route.startswith("/v1") else _ollama_error(r)
    assert "max_embed_chars" in message and "item 1" in message


def test_truncate_false_rejects_long_input(olla: ollama.Client, base_url: str) -> None:
    with pytest.raises(ollama.ResponseError) as info:
        olla.embed(model=EMBED, input=[CAT, LONG], truncate=False)
    assert info.value.status_code == 400
    assert "256" in info.value.error and "truncate" in info.value.error
    r = httpx.post(base_url + "/v1/embeddings",
                   json={"model": EMBED, "input": LONG, "truncate": False})
    assert _openai_error(r)["param"] == "input"


def test_long_input_is_truncated_by_default(olla: ollama.Client, oai: openai.OpenAI) -> None:
    resp = olla.embed(model=EMBED, input=LONG)
    assert resp.prompt_eval_count == 256 and len(resp.embeddings[0]) == 384
    usage = oai.embeddings.create(model=EMBED, input=LONG, encoding_format="float").usage
    assert usage.prompt_tokens == 256


@pytest.mark.parametrize("tokens", [[101, 7592, 102], [[101, 7592, 102], [101, 102]]])
def test_token_arrays_say_text_is_required(base_url: str, oai: openai.OpenAI,
                                           tokens: Any) -> None:
    r = httpx.post(base_url + "/v1/embeddings", json={"model": EMBED, "input": tokens})
    err = _openai_error(r)
    assert err["param"] == "input" and "token ids" in err["message"]
    assert "string" in err["message"]
    with pytest.raises(openai.BadRequestError):
        oai.embeddings.create(model=EMBED, input=tokens)
    r = httpx.post(base_url + "/api/embed", json={"model": EMBED, "input": tokens})
    assert "token ids" in _ollama_error(r)


def _head(vector: Any, n: int) -> np.ndarray[Any, Any]:
    """The first n components of a vector, renormalised: what `dimensions` must answer."""
    head = np.asarray(vector[:n], dtype=np.float64)
    return head / np.linalg.norm(head)


def test_dimensions_below_native_are_the_renormalised_head(
        oai: openai.OpenAI, oai_loose: openai.OpenAI, olla: ollama.Client) -> None:
    texts = [CAT, STOCKS]
    native = [d.embedding for d in
              oai.embeddings.create(model=EMBED, input=texts, encoding_format="float").data]
    assert all(len(v) == 384 for v in native)
    answers = {
        "openai float": [d.embedding for d in oai.embeddings.create(
            model=EMBED, input=texts, dimensions=128, encoding_format="float").data],
        # The SDK's own default: base64, decoded by the SDK.
        "openai base64": [list(d.embedding) for d in oai_loose.embeddings.create(
            model=EMBED, input=texts, dimensions=128).data],
        "ollama": [list(v) for v in olla.embed(model=EMBED, input=texts,
                                               dimensions=128).embeddings],
    }
    for how, vectors in answers.items():
        assert [len(v) for v in vectors] == [128, 128], how
        for vector, full in zip(vectors, native, strict=True):
            assert abs(np.linalg.norm(np.asarray(vector, dtype=np.float64)) - 1.0) < 1e-5, how
            assert cosine(vector, _head(full, 128)) > 0.9999, how
    # The raw head is shorter than unit length: the answers above were renormalised.
    assert np.linalg.norm(np.asarray(native[0][:128])) < 0.99


def test_dimensions_above_native_are_400(oai: openai.OpenAI, base_url: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        oai.embeddings.create(model=EMBED, input=CAT, dimensions=512)
    assert "384" in info.value.message and info.value.param == "dimensions"
    r = httpx.post(base_url + "/api/embed", json={"model": EMBED, "input": CAT,
                                                  "dimensions": 512})
    assert "384" in _ollama_error(r)
    ok = oai.embeddings.create(model=EMBED, input=CAT, dimensions=384, encoding_format="float")
    assert len(ok.data[0].embedding) == 384
    assert np.linalg.norm(np.asarray(ok.data[0].embedding)) == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize("body, param", [
    ({"model": EMBED, "input": []}, "input"),
    ({"model": EMBED}, "input"),
    ({"model": EMBED, "input": [CAT, 3.5]}, "input"),
    ({"model": EMBED, "input": CAT, "encoding_format": "int8"}, "encoding_format"),
    ({"model": EMBED, "input": {"text": CAT}}, "input"),
])
def test_bad_openai_input_is_400(base_url: str, body: dict[str, Any], param: str) -> None:
    r = httpx.post(base_url + "/v1/embeddings", json=body)
    assert _openai_error(r)["param"] == param


@pytest.mark.parametrize("route", ["/api/embed", "/api/embeddings"])
def test_invalid_keep_alive_is_400(base_url: str, route: str) -> None:
    text = {"input": CAT} if route == "/api/embed" else {"prompt": CAT}
    r = httpx.post(base_url + route, json={"model": EMBED, **text, "keep_alive": "soon"})
    assert "keep_alive" in _ollama_error(r)


def test_embed_keep_alive_reflected_in_ps(olla: ollama.Client) -> None:
    def expires() -> float:
        model = next(m for m in olla.ps().models if m.model == EMBED)
        assert model.expires_at is not None
        return model.expires_at.timestamp() - time.time()

    olla.embed(model=EMBED, input=CAT, keep_alive="2h")
    assert 7200 - 60 < expires() <= 7200
    olla.embeddings(model=EMBED, prompt=CAT, keep_alive=90)
    assert 30 < expires() <= 90
    loaded = olla.embed(model=EMBED, input=[], keep_alive="5m")
    assert loaded.embeddings == []
    assert 240 < expires() <= 300


def test_unknown_model_is_404(oai: openai.OpenAI, olla: ollama.Client) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        oai.embeddings.create(model="no-such-embedder", input=CAT)
    assert info.value.code == "model_not_found"
    with pytest.raises(ollama.ResponseError) as oinfo:
        olla.embed(model="no-such-embedder", input=CAT)
    assert oinfo.value.status_code == 404 and "not found" in oinfo.value.error
    with pytest.raises(ollama.ResponseError) as oinfo:
        olla.embeddings(model="no-such-embedder", prompt=CAT)
    assert oinfo.value.status_code == 404


def test_wrong_model_kind_is_400_in_each_shape(oai: openai.OpenAI, olla: ollama.Client,
                                               base_url: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        oai.embeddings.create(model=LLM, input=CAT)
    assert info.value.param == "model" and "text generation" in info.value.message
    with pytest.raises(ollama.ResponseError) as oinfo:
        olla.embed(model=LLM, input=CAT)
    assert oinfo.value.status_code == 400 and "text generation" in oinfo.value.error
    with pytest.raises(openai.BadRequestError) as info:
        oai.chat.completions.create(model=EMBED, messages=[{"role": "user", "content": "hi"}])
    assert "embedding model" in info.value.message
    r = httpx.post(base_url + "/api/chat", json={
        "model": EMBED, "stream": False, "messages": [{"role": "user", "content": "hi"}]})
    if r.status_code == 404 and not r.headers.get("content-type", "").startswith(
            "application/json"):
        pytest.skip("/api/chat is not served by this build")
    assert "embedding model" in _ollama_error(r)


# --- concurrency and the cache -----------------------------------------------------------


def test_chat_stream_and_embeddings_at_the_same_time(oai: openai.OpenAI) -> None:
    chat_started = threading.Event()
    chat_done = threading.Event()

    def chat() -> tuple[str, str | None, float, float]:
        stream = oai.chat.completions.create(
            model=LLM, max_tokens=40, stream=True,
            messages=[{"role": "user", "content": "Write a long story about a lighthouse."}])
        parts: list[str] = []
        finish: str | None = None
        first = 0.0
        for chunk in stream:
            if not chat_started.is_set():
                first = time.monotonic()
                chat_started.set()
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
        chat_done.set()
        return "".join(parts), finish, first, time.monotonic()

    def embed() -> list[float]:
        assert chat_started.wait(60)
        finished: list[float] = []
        while not chat_done.is_set() or len(finished) < 10:
            resp = oai.embeddings.create(model=EMBED, input=[unique("during chat"), CAT],
                                         encoding_format="float")
            assert len(resp.data) == 2 and len(resp.data[0].embedding) == 384
            finished.append(time.monotonic())
        return finished

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        chat_future = pool.submit(chat)
        embed_future = pool.submit(embed)
        text, finish, first, last = chat_future.result(timeout=120)
        finished = embed_future.result(timeout=120)
    assert text and finish in ("stop", "length")
    assert len(finished) >= 10
    # NOTE: the embedding worker answers while the LLM worker is still streaming.
    assert any(first < t < last for t in finished), (first, last, finished[:3])


class HeartbeatReader:
    """The embedding worker's own heartbeats, read from its PUB socket like the supervisor."""

    def __init__(self, config: Config, worker: str) -> None:
        self.worker = worker
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        configure_sub(self.sub, TOPIC_HEARTBEAT)
        connect(self.sub, config, worker_endpoint(config, worker, "out"))
        self.decoder = reply_decoder()

    def after(self, since: float, timeout: float = 10.0) -> Heartbeat:
        """The first heartbeat sent after `since` (time.time())."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.sub.poll(200):
                continue
            _topic, raw = self.sub.recv_multipart()
            beat = self.decoder.decode(raw)
            if isinstance(beat, Heartbeat) and beat.worker == self.worker \
                    and beat.sent_at > since:
                return beat
        raise TimeoutError(f"no heartbeat from {self.worker}")

    def close(self) -> None:
        self.sub.close(0)
        self.ctx.term()


@pytest.fixture
def heartbeats(server: Server) -> Iterator[HeartbeatReader]:
    reader = HeartbeatReader(server.config, "embed")
    yield reader
    reader.close()


def test_cache_hit_skips_the_pipeline(heartbeats: HeartbeatReader, olla: ollama.Client) -> None:
    text = unique("cache me")
    before = heartbeats.after(time.time())
    first = olla.embed(model=EMBED, input=text).embeddings[0]
    after_miss = heartbeats.after(time.time())
    second = olla.embed(model=EMBED, input=text).embeddings[0]
    after_hit = heartbeats.after(time.time())
    assert (after_miss.cache_misses - before.cache_misses,
            after_miss.cache_hits - before.cache_hits) == (1, 0)
    assert (after_hit.cache_misses - after_miss.cache_misses,
            after_hit.cache_hits - after_miss.cache_hits) == (0, 1)
    assert first == second


# --- the engine in-process ---------------------------------------------------------------


class CountingPipe:
    """Wraps the real pipeline and records every text that reaches it."""

    def __init__(self, pipe: Any) -> None:
        self.pipe = pipe
        self.calls: list[list[str]] = []

    def embed_documents(self, texts: list[str]) -> Any:
        self.calls.append(list(texts))
        return self.pipe.embed_documents(texts)


@pytest.fixture
def engine(ir_folder: Path, local_pipe: Any,
           tokenizer: Any) -> Iterator[tuple[EmbedEngine, list[Any], CountingPipe]]:
    frames: list[Any] = []
    spec = WorkerSpec(name="embed", role="embed")
    eng = EmbedEngine(Config(embedding_cache_size=4), spec, str(ir_folder), frames.append)
    counting = CountingPipe(local_pipe)
    eng.pipe, eng.tokenizer = counting, tokenizer
    stop = threading.Event()
    thread = threading.Thread(target=eng.run, args=(stop,), daemon=True)
    thread.start()
    yield eng, frames, counting
    stop.set()
    thread.join(5)


def _wait(frames: list[Any], n: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while len(frames) < n and time.monotonic() < deadline:
        time.sleep(0.005)
    assert len(frames) >= n


def _request(texts: list[str], truncate: bool = True) -> Embed:
    return Embed(id=uuid.uuid4().hex, model=EMBED, texts=texts, deadline=time.time() + 60,
                 truncate=truncate)


def test_engine_cache_hits_never_reach_the_pipeline(
        engine: tuple[EmbedEngine, list[Any], CountingPipe]) -> None:
    eng, frames, pipe = engine
    eng.submit(_request([CAT, FELINE]))
    _wait(frames, 1)
    eng.submit(_request([FELINE, STOCKS, CAT]))
    _wait(frames, 2)
    assert sorted(pipe.calls[0]) == sorted([CAT, FELINE]) and pipe.calls[1:] == [[STOCKS]]
    assert (eng.cache_hits, eng.cache_misses) == (2, 3)
    one, two = frames
    assert isinstance(one, Embeddings) and isinstance(two, Embeddings)
    m1 = np.frombuffer(one.data, dtype="<f4").reshape(one.rows, one.dims)
    m2 = np.frombuffer(two.data, dtype="<f4").reshape(two.rows, two.dims)
    assert np.array_equal(m1[1], m2[0]) and np.array_equal(m1[0], m2[2])


def test_engine_hits_survive_eviction_by_the_same_batch(
        engine: tuple[EmbedEngine, list[Any], CountingPipe]) -> None:
    eng, frames, pipe = engine  # NOTE: the cache holds 4 vectors
    eng.submit(_request([CAT]))
    _wait(frames, 1)
    new = [unique(f"evictor {i}") for i in range(5)]
    eng.submit(_request([CAT, *new]))
    _wait(frames, 2)
    frame = frames[1]
    assert isinstance(frame, Embeddings) and frame.rows == 6
    assert (eng.cache_hits, eng.cache_misses) == (1, 6)
    assert all(CAT not in call for call in pipe.calls[1:])


def test_engine_batches_requests_that_queue_together(
        engine: tuple[EmbedEngine, list[Any], CountingPipe]) -> None:
    eng, frames, pipe = engine
    requests = [_request([unique(f"queued {i}")]) for i in range(6)]
    for req in requests:
        eng.submit(req)
    _wait(frames, 6)
    # NOTE: the first may be taken alone; the rest queued behind it share a pipeline call.
    assert len(pipe.calls) <= 2 and sum(len(c) for c in pipe.calls) == 6
    assert sorted(f.id for f in frames) == sorted(r.id for r in requests)


def test_engine_rejects_long_text_without_truncate(
        engine: tuple[EmbedEngine, list[Any], CountingPipe]) -> None:
    eng, frames, pipe = engine
    eng.submit(_request([CAT, LONG], truncate=False))
    _wait(frames, 1)
    (frame,) = frames
    assert isinstance(frame, Failed) and frame.limit == 256 and frame.prompt_tokens
    assert frame.prompt_tokens > 256 and pipe.calls == []


def test_engine_survives_a_pipeline_error(
        engine: tuple[EmbedEngine, list[Any], CountingPipe]) -> None:
    eng, frames, pipe = engine
    real = pipe.pipe

    class Broken:
        def embed_documents(self, texts: list[str]) -> Any:
            raise RuntimeError("device lost")

    pipe.pipe = Broken()
    eng.submit(_request([unique("doomed")]))
    _wait(frames, 1)
    pipe.pipe = real
    eng.submit(_request([unique("fine")]))
    _wait(frames, 2)
    assert isinstance(frames[0], Failed) and "device lost" in frames[0].message
    assert isinstance(frames[1], Embeddings)



@pytest.fixture
def idle_engine(ir_folder: Path, local_pipe: Any,
                tokenizer: Any) -> Iterator[tuple[EmbedEngine, list[Any], CountingPipe,
                                                  threading.Thread]]:
    """An engine whose loop is not started yet: what is submitted first queues together."""
    frames: list[Any] = []
    eng = EmbedEngine(Config(embedding_cache_size=0), WorkerSpec(name="embed", role="embed"),
                      str(ir_folder), frames.append)
    counting = CountingPipe(local_pipe)
    eng.pipe, eng.tokenizer = counting, tokenizer
    stop = threading.Event()
    thread = threading.Thread(target=eng.run, args=(stop,), daemon=True)
    yield eng, frames, counting, thread
    stop.set()
    if thread.is_alive():
        thread.join(5)


POISON = "this text makes the pipeline fail"


class PoisonedPipe(CountingPipe):
    """Fails any call that holds POISON, as a pipeline refusing one input would."""

    def embed_documents(self, texts: list[str]) -> Any:
        self.calls.append(list(texts))
        if POISON in texts:
            raise RuntimeError("cannot embed this input")
        return self.pipe.embed_documents(texts)


def test_engine_one_bad_text_fails_only_its_request(
        idle_engine: tuple[EmbedEngine, list[Any], CountingPipe, threading.Thread],
        local_pipe: Any) -> None:
    eng, frames, _, thread = idle_engine
    eng.pipe = pipe = PoisonedPipe(local_pipe)
    good = [_request([unique("good one")]), _request([unique("good two"), CAT])]
    bad = _request([FELINE, POISON])
    for req in (good[0], bad, good[1]):
        eng.submit(req)
    thread.start()
    _wait(frames, 3)
    by_id = {f.id: f for f in frames}
    assert isinstance(by_id[bad.id], Failed) and "cannot embed" in by_id[bad.id].message
    for req in good:
        frame = by_id[req.id]
        assert isinstance(frame, Embeddings) and frame.rows == len(req.texts)
        matrix = np.frombuffer(frame.data, dtype="<f4").reshape(frame.rows, frame.dims)
        lone = np.asarray(local_pipe.embed_documents(req.texts))
        assert all(cosine(a, b) > 0.9999 for a, b in zip(matrix, lone, strict=True))
    # NOTE: one call for the batch of three, then one per request on its own.
    assert len(pipe.calls[0]) == 5 and len(pipe.calls) == 4


def test_engine_batches_truncate_choices_apart_correctly(
        idle_engine: tuple[EmbedEngine, list[Any], CountingPipe, threading.Thread]) -> None:
    eng, frames, pipe, thread = idle_engine
    cut, strict, short = (_request([LONG, unique("cut")]), _request([LONG], truncate=False),
                          _request([unique("short")], truncate=False))
    for req in (cut, strict, short):
        eng.submit(req)
    thread.start()
    _wait(frames, 3)
    by_id = {f.id: f for f in frames}
    assert isinstance(by_id[strict.id], Failed) and by_id[strict.id].limit == 256
    assert isinstance(by_id[cut.id], Embeddings) and by_id[cut.id].rows == 2
    assert by_id[cut.id].prompt_tokens[0] == 256
    assert isinstance(by_id[short.id], Embeddings) and by_id[short.id].rows == 1
    # NOTE: the refused request's text never reached the pipeline; the others shared a call.
    assert len(pipe.calls) == 1 and sorted(pipe.calls[0]) == sorted([*cut.texts, *short.texts])


def test_engine_skips_a_queued_request_whose_client_left(
        idle_engine: tuple[EmbedEngine, list[Any], CountingPipe, threading.Thread]) -> None:
    eng, frames, pipe, thread = idle_engine
    kept, left = _request([unique("kept")]), _request([unique("left")])
    eng.submit(kept)
    eng.submit(left)
    eng.submit(Abort(id=left.id))
    thread.start()
    _wait(frames, 1)
    assert [f.id for f in frames] == [kept.id] and pipe.calls == [kept.texts]


def test_engine_counts_pipeline_calls_by_size(
        idle_engine: tuple[EmbedEngine, list[Any], CountingPipe, threading.Thread]) -> None:
    eng, frames, pipe, thread = idle_engine
    eng.max_batch = 4
    requests = [_request([unique(f"sized {i}")]) for i in range(6)]
    for req in requests:
        eng.submit(req)
    thread.start()
    _wait(frames, 6)
    # NOTE: 4 texts per call at most: one call of 4 ("3-4") and one of 2.
    assert sorted(len(c) for c in pipe.calls) == [2, 4]
    assert eng.batches[:4] == [0, 1, 1, 0] and sum(eng.batches) == 2


def _scrape(url: str) -> dict[tuple[str, str], float]:
    """The embed worker's samples of the two embedding counters, by (name, size)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.labels.get("worker") == "embed" and s.name in (
                    "npu_proxy_embedding_batches_total",
                    "npu_proxy_embedding_cache_misses_total"):
                out[(s.name, s.labels.get("size", ""))] = s.value
    return out


def _calls(samples: dict[tuple[str, str], float]) -> float:
    return sum(v for (n, _), v in samples.items() if n == "npu_proxy_embedding_batches_total")


def _misses(samples: dict[tuple[str, str], float]) -> float:
    return samples.get(("npu_proxy_embedding_cache_misses_total", ""), 0.0)


def test_concurrent_requests_are_batched_and_get_lone_vectors(base_url: str,
                                                              local_pipe: Any) -> None:
    texts = [unique(f"concurrent client {i} asks about {STOCKS}") for i in range(16)]
    before = _scrape(base_url)
    barrier = threading.Barrier(len(texts))

    def one(text: str) -> list[float]:
        with httpx.Client(base_url=base_url, timeout=60) as client:
            barrier.wait(30)
            r = client.post("/v1/embeddings", json={"model": EMBED, "input": text})
            assert r.status_code == 200, r.text
            return list(r.json()["data"][0]["embedding"])

    with concurrent.futures.ThreadPoolExecutor(len(texts)) as pool:
        served = list(pool.map(one, texts))
    # NOTE: the counters reach /metrics with the worker's next heartbeat.
    def counted() -> dict[tuple[str, str], float] | None:
        now = _scrape(base_url)
        return now if _misses(now) - _misses(before) >= len(texts) else None

    after = wait_for(counted, what="the worker's heartbeat with the 16 texts counted")
    assert _misses(after) - _misses(before) == len(texts)
    calls = _calls(after) - _calls(before)
    assert 1 <= calls < len(texts), f"{calls} pipeline calls for {len(texts)} requests"
    assert any(size != "1" and after[(n, size)] > before.get((n, size), 0)
               for n, size in after if n == "npu_proxy_embedding_batches_total")
    for text, vec in zip(texts, served, strict=True):
        lone = local_pipe.embed_documents([text])[0]
        assert cosine(vec, lone) > 0.9999


def test_fast_token_counter_agrees_with_openvino(ir_folder: Path, tokenizer: Any) -> None:
    fast = _fast_counter(ir_folder, tokenizer)
    assert fast is not None  # NOTE: else every request pays ~3 ms for the OpenVINO count.
    texts = [CAT, FELINE, STOCKS, LONG, "Ünïcödé — \u2018quotes\u2019 … 中文 🙂", "a" * 150]
    assert [len(e.ids) for e in fast.encode_batch(texts)] == count_tokens(tokenizer, texts)


def test_embedding_responses_say_where_they_ran(server: Server) -> None:
    for path, body in (("/v1/embeddings", {"model": "all-minilm", "input": ["a", "b c"]}),
                       ("/api/embed", {"model": "all-minilm", "input": "a"})):
        r = httpx.post(server.url + path, json=body, timeout=60)
        assert r.status_code == 200
        assert r.headers["x-npu-proxy-worker"] == "embed"
        assert r.headers["x-npu-proxy-device"] == "CPU"
        assert r.headers["x-npu-proxy-route-reason"] == "preferred"
        assert int(r.headers["x-npu-proxy-token-count"]) >= 3


def test_a_bursts_stragglers_count_with_it_and_a_lone_request_stops_the_waiting(
        idle_engine: tuple[EmbedEngine, list[Any], CountingPipe, threading.Thread],
        monkeypatch: pytest.MonkeyPatch) -> None:
    eng = idle_engine[0]
    burst = [(time.time(), _request([unique(f"burst {i}")])) for i in range(16)]
    # A burst of 16 gathered as 15, then its 16th, which came right after: a burst of 16.
    eng._note_burst(burst[0][0], burst[:15])
    eng._note_burst(time.time(), burst[15:])
    assert list(eng._sizes) == [16]
    # So the next burst waits for its 16th (it stops gathering at the size bursts bring).
    for arrived, req in burst:
        eng._inbox.put((arrived, req))
    assert len(eng._gather(eng._inbox.get())) == 16
    # A request that came on its own, long after: the next one does not wait for company.
    eng._note_burst(time.time() + 10 * eng.batch_wait, burst[:1])
    # NOTE: whether it waited, not how long it took: a loaded machine may pause any thread
    # for longer than batch_wait (15 ms).
    waits: list[float | None] = []
    get = eng._inbox.get

    def watched(block: bool = True, timeout: float | None = None) -> Any:
        if block:
            waits.append(timeout)
        return get(block, timeout)

    monkeypatch.setattr(eng._inbox, "get", watched)
    assert len(eng._gather((time.time(), _request([unique("lone")])))) == 1
    assert waits == []


def test_tokens_are_counted_while_the_batch_gathers(
        idle_engine: tuple[EmbedEngine, list[Any], CountingPipe, threading.Thread],
        tokenizer: Any) -> None:
    """Each request is counted as it is taken, in the gaps between arrivals, not after the
    batch is complete; the counts still decide usage and the too-long answer."""
    eng, frames, _pipe, thread = idle_engine
    gathering = threading.Event()
    counted_when: list[bool] = []
    gather, token_counts = eng._gather, eng._token_counts

    def watched_gather(first: Any) -> Any:
        gathering.set()
        try:
            return gather(first)
        finally:
            gathering.clear()

    def watched_counts(texts: list[str]) -> list[int]:
        counted_when.append(gathering.is_set())
        return token_counts(texts)

    eng._gather, eng._token_counts = watched_gather, watched_counts  # type: ignore[method-assign]
    fine = [_request([unique("one"), CAT]), _request([FELINE])]
    too_long = _request([LONG], truncate=False)
    for req in (*fine, too_long):
        eng.submit(req)
    thread.start()
    _wait(frames, 3)
    assert counted_when == [True, True, True]
    by_id = {f.id: f for f in frames}
    for req in fine:
        answer = by_id[req.id]
        assert isinstance(answer, Embeddings)
        assert answer.prompt_tokens == count_tokens(tokenizer, req.texts)
    refused = by_id[too_long.id]
    assert isinstance(refused, Failed) and refused.code == ErrorCode.PROMPT_TOO_LONG
    assert eng._counted == {}
