"""Every way a request ends frees its slot, in the gateway and in the worker (issue 14).

`/health/devices` shows both: `gateway_requests` (streams the gateway routes frames to) and
`in_flight` (requests the worker runs). Each test makes one way of ending happen through an
explicit fault hook and waits on those figures; none depends on how fast this machine is.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from serverctl import Server, small_llm

LONG_ANSWER = {"model": "smollm2:135m", "max_tokens": 4000, "ignore_eos": True,
               "messages": [{"role": "user", "content": "Tell me a very long story."}]}

# NOTE: every server here serves the embedded model cut to two layers (serverctl.small_llm):
# these tests are about slots and aborts, never what the model says. At its ~200 tokens/s a
# lost abort's 4,000 tokens end within the waits below, so each test also reads in the
# worker's log that its abort arrived.


def _row(srv: Server, worker: str = "llm") -> dict[str, Any]:
    rows = httpx.get(srv.url + "/health/devices", timeout=10).json()["workers"]
    return dict(next(w for w in rows if w["name"] == worker))


def _wait_free(srv: Server, worker: str = "llm", timeout: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    row = _row(srv, worker)
    while (row["in_flight"] or row["gateway_requests"]) and time.monotonic() < deadline:
        time.sleep(0.1)
        row = _row(srv, worker)
    return row


def _wait_log(srv: Server, worker: str, needle: str, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = srv.worker_log(worker)
        if needle in text:
            return text
        time.sleep(0.1)
    raise AssertionError(f"{needle!r} never appeared in {worker}.log:\n{srv.worker_log(worker)}")


def _finished_line(srv: Server, worker: str, request_id: str) -> str:
    """The worker's log line that says how request `request_id` (its X-Request-ID) ended."""
    needle = f"finished request_id={request_id} "
    log = _wait_log(srv, worker, needle)
    return next(x for x in log.splitlines() if needle in x)


def test_a_frame_gap_ends_the_request_and_frees_both_slots(tmp_path: Path) -> None:
    srv = Server(tmp_path, workers=[{"name": "llm", "role": "llm",
                                     "faults": {"gap_after_tokens": 8}}],
                 models=small_llm()).start()
    try:
        error = None
        with httpx.stream("POST", srv.url + "/v1/chat/completions", timeout=120,
                          headers={"X-Request-ID": "gap-1"},
                          json={**LONG_ANSWER, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {") and "error" in json.loads(line[6:]):
                    error = json.loads(line[6:])["error"]
        assert error is not None and "frame" in error["message"]
        # NOTE: without the abort the worker would go on to 4,000 tokens for nobody.
        line = _finished_line(srv, "llm", "gap-1")
        assert "reason=abort" in line, line
        row = _wait_free(srv)
        assert row["in_flight"] == 0 and row["gateway_requests"] == 0
    finally:
        srv.stop()


def test_a_client_gone_before_acceptance_frees_both_slots(tmp_path: Path) -> None:
    gate = tmp_path / "accept"
    srv = Server(tmp_path, workers=[{"name": "llm", "role": "llm",
                                     "faults": {"hold_accept_until": str(gate)}}],
                 models=small_llm()).start()
    try:
        # The worker takes nothing until the gate exists: the client gives up first.
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(srv.url + "/v1/chat/completions", json=LONG_ANSWER, timeout=1.0,
                       headers={"X-Request-ID": "gone-1"})
        deadline = time.monotonic() + 60
        while _row(srv)["gateway_requests"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _row(srv)["gateway_requests"] == 0
        gate.touch()
        # The worker now takes the request, then its abort (queued or after its first step).
        _wait_log(srv, "llm", "abort request_id=gone-1 ")
        row = _wait_free(srv)
        assert row["in_flight"] == 0 and row["gateway_requests"] == 0
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=120, json={
            "model": "smollm2:135m", "max_tokens": 4,
            "messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 200
    finally:
        srv.stop()


def test_an_npu_abort_between_dequeue_and_start_is_not_lost(tmp_path: Path) -> None:
    gate = tmp_path / "start"
    srv = Server(tmp_path, workers=[{
        "name": "npu", "role": "npu", "device": "CPU", "max_prompt_len": 256,
        "faults": {"hold_start_until": str(gate)}}], models=small_llm()).start()
    try:
        with httpx.stream("POST", srv.url + "/v1/chat/completions", timeout=120,
                          headers={"X-Request-ID": "race-1"},
                          json={**LONG_ANSWER, "max_tokens": 1000, "stream": True}) as r:
            assert r.status_code == 200
            # The engine took the request off its queue and holds it before the first step.
            _wait_log(srv, "npu", "holding request_id=race-1 before it starts")
        # The client is gone: the gateway's abort reaches the worker inside that window.
        _wait_log(srv, "npu", "abort request_id=race-1")
        gate.touch()
        log = _wait_log(srv, "npu", "finished request_id=race-1")
        line = next(x for x in log.splitlines() if "finished request_id=race-1" in x)
        # NOTE: a lost abort would run on to 1,000 tokens; the held one stops at its first.
        tokens = re.search(r"completion_tokens=(\d+)", line)
        assert "reason=abort" in line and tokens is not None and int(tokens[1]) <= 1, line
        row = _wait_free(srv, "npu")
        assert row["in_flight"] == 0 and row["gateway_requests"] == 0
    finally:
        srv.stop()
