"""Admission and robustness of one worker.

- A worker takes at most max_running + max_queue requests and refuses the rest at once
  (QUEUE_FULL); with no other worker for the model the gateway answers 503 + Retry-After in
  the caller's API.
- Request work never gets a healthy worker killed: a multi-megabyte prompt is refused on its
  length without being tokenized, and a long prefill (one pipeline step holds the GIL) does
  not count as a lost heartbeat.

Driven by what the server exposes (/health/devices, the worker's own sockets), never by timing.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec
import pytest
import zmq
from serverctl import Server, wait_row, worker_row

from npu_proxy.protocol.liveness import Heartbeat
from npu_proxy.protocol.messages import (
    ChatMessage,
    ErrorCode,
    Failed,
    Generate,
    SamplingParams,
    Tokenize,
    encode,
    reply_decoder,
)
from npu_proxy.protocol.sockets import (
    configure_sub,
    connect,
    subscribe_replies,
    worker_endpoint,
)

LLM = "smollm2:135m"
RUNNING = 2
QUEUED = 2
BURST = 200
SHORT = [{"role": "user", "content": "Tell me a story about a lighthouse keeper."}]
# NOTE: the held requests generate until the test cuts them: close to the model's whole
# context, far more than the bursts below take.
HELD_TOKENS = 8000
BURST_TOKENS = 8


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = Server(tmp_path_factory.mktemp("admission"), workers=[
        # NOTE: a whole prompt per step (not the default steps of 512), so a long prompt is
        # one long silent step: test_a_long_prefill_does_not_get_the_worker_killed.
        {"name": "llm", "role": "llm", "device": "CPU", "max_running": RUNNING,
         "max_queue": QUEUED, "max_batch_tokens": 0},
    ], inference_timeout=600.0).start()
    yield server
    server.stop()


@dataclass
class Outcome:
    status: int
    headers: httpx.Headers
    body: Any = None  # the error body of a refusal
    text: str = ""
    finish_reason: str | None = None
    usage: dict[str, Any] = field(default_factory=dict)
    done: bool = False  # the stream ended with `data: [DONE]`


def stream_chat(url: str, max_tokens: int, cut: threading.Event | None = None,
                started: threading.Event | None = None) -> Outcome:
    """One OpenAI chat stream read to its end (or until `cut` is set)."""
    body = {"model": LLM, "messages": SHORT, "max_tokens": max_tokens, "stream": True,
            "temperature": 0, "ignore_eos": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            r.read()
            return Outcome(r.status_code, r.headers, body=r.json())
        out = Outcome(r.status_code, r.headers)
        if started is not None:
            started.set()
        for line in r.iter_lines():
            if cut is not None and cut.is_set():
                break
            if line == "data: [DONE]":
                out.done = True
            elif line.startswith("data: {"):
                chunk = json.loads(line[6:])
                out.usage = chunk.get("usage") or out.usage
                for choice in chunk["choices"]:
                    out.text += choice["delta"].get("content") or ""
                    out.finish_reason = choice.get("finish_reason") or out.finish_reason
        return out


def assert_refused(out: Outcome) -> None:
    assert out.status == 503, out
    assert int(out.headers["retry-after"]) > 0
    error = out.body["error"]
    assert error["type"] == "server_error" and error["code"] == "unavailable"
    assert "llm" in error["message"] or "right now" in error["message"]


def assert_complete(out: Outcome) -> None:
    assert out.status == 200, out
    assert out.done and out.finish_reason == "length" and out.text
    assert out.usage["completion_tokens"] == BURST_TOKENS


class Sampler:
    """Reads the worker's row over and over while a burst runs; every reading must stay
    within the admission bounds."""

    def __init__(self, srv: Server) -> None:
        self.srv = srv
        self.rows: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.rows.append(worker_row(self.srv, "llm"))
            self._stop.wait(0.05)

    def stop(self) -> list[dict[str, Any]]:
        self._stop.set()
        self._thread.join(30)
        return self.rows


def burst(url: str, n: int, max_tokens: int) -> list[Outcome]:
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        return list(pool.map(lambda _: stream_chat(url, max_tokens), range(n)))


def within_bounds(row: dict[str, Any]) -> bool:
    """At most RUNNING generate, and the worker holds at most RUNNING + QUEUED requests.

    NOTE: not queue <= QUEUED: a request the worker took counts as queued until it starts
    (in its inbox, being checked, waiting), so right as a burst reaches an idle worker a
    heartbeat can show 1 running and 3 queued for a moment (seen once in a full run)."""
    return bool(row["in_flight"] <= RUNNING and row["in_flight"] + row["queue"] <= RUNNING + QUEUED)


def test_a_full_worker_refuses_at_once_and_the_admitted_complete(srv: Server) -> None:
    before = wait_row(srv, "llm", lambda r: r["state"] == "ready", timeout=120)
    # 1. Fill the worker with requests that generate until cut: two running, two waiting.
    cut = threading.Event()
    held_pool = concurrent.futures.ThreadPoolExecutor(RUNNING + QUEUED)
    held = []
    for _ in range(RUNNING + QUEUED):
        started = threading.Event()
        held.append(held_pool.submit(stream_chat, srv.url, HELD_TOKENS, cut, started))
        # NOTE: one at a time, so which are running and which wait is decided by arrival.
        assert started.wait(120), "a held request was not accepted"
    try:
        wait_row(srv, "llm", lambda r: (r["in_flight"], r["queue"]) == (RUNNING, QUEUED),
                 timeout=120)
        # 2. While it is full, every further request is refused at once, in each API's shape.
        sampler = Sampler(srv)
        refused = burst(srv.url, BURST, BURST_TOKENS)
        rows = sampler.stop()
        assert not any(f.done() for f in held), "a held request ended during the burst"
        for out in refused:
            assert_refused(out)
        r = httpx.post(srv.url + "/api/chat", timeout=60, json={
            "model": LLM, "messages": SHORT, "stream": False})
        assert r.status_code == 503 and int(r.headers["retry-after"]) > 0
        assert isinstance(r.json()["error"], str)
        r = httpx.post(srv.url + "/v1/messages", timeout=60, json={
            "model": LLM, "max_tokens": 8, "messages": SHORT})
        assert r.status_code == 529 and int(r.headers["retry-after"]) > 0
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == "overloaded_error"
        assert all(within_bounds(row) for row in rows), rows
    finally:
        cut.set()
        held_outcomes = [f.result(timeout=120) for f in held]
        held_pool.shutdown()
    assert all(out.status == 200 for out in held_outcomes)
    # 3. Cut, they free their slots; a burst on the idle worker: whatever is admitted completes,
    # the rest is refused, and at least a full worker's worth (the first arrivals) is admitted.
    wait_row(srv, "llm", lambda r: (r["in_flight"], r["queue"]) == (0, 0), timeout=120)
    sampler = Sampler(srv)
    outcomes = burst(srv.url, BURST, BURST_TOKENS)
    rows = sampler.stop()
    complete = [out for out in outcomes if out.status == 200]
    for out in complete:
        assert_complete(out)
    for out in outcomes:
        if out.status != 200:
            assert_refused(out)
    assert len(complete) >= RUNNING + QUEUED
    assert all(within_bounds(row) for row in rows), rows
    # 4. Every slot is free again, and the worker was never restarted.
    # NOTE: the counts come from the worker's heartbeats, the state from the supervisor's
    # status (its own reading of the same heartbeats, sent on): one may lag the other.
    after = wait_row(srv, "llm", lambda r: (r["in_flight"], r["queue"], r["state"]) == (
        0, 0, "ready"), timeout=120)
    assert (after["pid"], after["restarts"]) == (before["pid"], before["restarts"])


# --- request work and heartbeats -----------------------------------------------------------


class WorkerWire:
    """The llm worker's own sockets, as the gateway uses them: PUSH to `.in`, SUB to `.out`."""

    def __init__(self, srv: Server) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        out = worker_endpoint(srv.config, "llm", "out")
        configure_sub(self.sub, None)
        subscribe_replies(self.sub, srv.config, out)
        connect(self.sub, srv.config, out)
        # NOTE: not the gateway's IMMEDIATE option: a send waits for the connection instead
        # of failing while it is still being made.
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 0)
        connect(self.push, srv.config, worker_endpoint(srv.config, "llm", "in"))
        self.decoder = reply_decoder()
        # NOTE: a SUB hears nothing sent before its subscription reached the worker; a first
        # heartbeat proves it has.
        self.next_frame(lambda f: isinstance(f, Heartbeat))

    def next_frame(self, match: Callable[[Any], bool], timeout: float = 120.0) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.sub.poll(200):
                _topic, raw = self.sub.recv_multipart()
                frame = self.decoder.decode(raw)
                if match(frame):
                    return frame
        raise AssertionError("no such frame from the worker")

    def ask(self, msg: msgspec.Struct) -> Any:
        self.push.send(encode(msg))
        rid = getattr(msg, "id", "")
        return self.next_frame(lambda f: getattr(f, "id", None) == rid)

    def close(self) -> None:
        self.sub.close(0)
        self.push.close(0)
        self.ctx.term()


# NOTE: 8 M CJK characters: tokenizing 4 M of them took 6.5 s with the GIL held, so this much
# used to silence the worker's heartbeats past the 10 s heartbeat timeout.
HUGE = "日本語のテキスト" * 2**20


def test_a_huge_prompt_is_refused_unread_and_the_worker_lives(srv: Server) -> None:
    before = wait_row(srv, "llm", lambda r: r["state"] == "ready", timeout=120)
    wire = WorkerWire(srv)
    try:
        failed = wire.ask(Generate(
            id="huge-generate", model=LLM, params=SamplingParams(max_tokens=4),
            deadline=time.time() + 600, messages=[ChatMessage(role="user", content=HUGE)]))
        assert isinstance(failed, Failed) and failed.code == ErrorCode.PROMPT_TOO_LONG
        # Refused on its length in characters: never tokenized, so never counted.
        assert failed.prompt_tokens is None and failed.limit == 8191
        assert "characters" in failed.message and not failed.retry_elsewhere
        failed = wire.ask(Tokenize(id="huge-count", model=LLM, prompt=HUGE))
        assert isinstance(failed, Failed) and failed.code == ErrorCode.PROMPT_TOO_LONG
        assert "characters" in failed.message
    finally:
        wire.close()
    after = wait_row(srv, "llm", lambda r: (r["in_flight"], r["queue"]) == (0, 0), timeout=120)
    assert (after["pid"], after["restarts"]) == (before["pid"], before["restarts"])
    # Through the gateway, in the API's shape (unless its own request limits answer first).
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=120, json={
        "model": LLM, "max_tokens": 4, "messages": [{"role": "user", "content": HUGE}]})
    assert r.status_code in (400, 413), r.text[:300]
    assert r.json()["error"]["message"]
    after = worker_row(srv, "llm")
    assert (after["pid"], after["restarts"]) == (before["pid"], before["restarts"])


def test_a_long_prefill_does_not_get_the_worker_killed(srv: Server) -> None:
    """A prompt just under the context, read in one pipeline step (max_batch_tokens = 0):
    5-14 s on 2 CPU cores, during which the worker cannot heartbeat; the supervisor used to
    kill it at 10 s."""
    before = wait_row(srv, "llm", lambda r: r["state"] == "ready", timeout=120)
    long = "The quick brown fox jumps over the lazy dog. " * 790  # about 7,900 tokens
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=600, json={
        "model": LLM, "max_tokens": 2, "messages": [{"role": "user", "content": long}]})
    assert r.status_code == 200, r.text[:300]
    assert 7000 < r.json()["usage"]["prompt_tokens"] < 8191
    after = wait_row(srv, "llm", lambda r: (r["in_flight"], r["queue"]) == (0, 0), timeout=120)
    assert (after["pid"], after["restarts"]) == (before["pid"], before["restarts"])
