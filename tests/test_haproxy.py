"""More than one instance behind HAProxy, with the config shipped in deploy/haproxy/: streams
pass through whole, and when one instance dies new requests keep succeeding."""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from serverctl import Server, descendants, free_port, stop_process

CONFIG = Path(__file__).resolve().parents[1] / "deploy" / "haproxy" / "haproxy.cfg"
HAPROXY = shutil.which("haproxy") or "/usr/sbin/haproxy"

pytestmark = pytest.mark.skipif(not Path(HAPROXY).exists(),
                                reason="haproxy not installed (.ci/run installs it)")


def instance(tmp: Path, name: str, **worker: Any) -> Server:
    # NOTE: each instance names its worker differently, so a response's
    # x-npu-proxy-worker header says which instance served it.
    return Server(tmp / name, workers=[{"name": f"llm-{name}", "role": "llm", **worker}])


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[Server, Server]]:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    # NOTE: a's tokens come 50 ms apart at least, so its streams are still running when the
    # test kills it, however fast the machine is.
    a = instance(tmp_path, "a", faults={"token_delay_seconds": 0.05})
    b = instance(tmp_path, "b")
    a.start(wait=False)
    b.start(wait=False)
    try:
        a.wait_ready()
        b.wait_ready()
        yield a, b
    finally:
        b.stop()
        a.stop()


@pytest.fixture
def balancer(pair: tuple[Server, Server], tmp_path: Path) -> Iterator[str]:
    a, b = pair
    port = free_port()
    env = {**os.environ, "NPU_PROXY_LB_BIND": f"127.0.0.1:{port}",
           "NPU_PROXY_A": f"127.0.0.1:{a.port}", "NPU_PROXY_B": f"127.0.0.1:{b.port}"}
    log = open(tmp_path / "haproxy.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([HAPROXY, "-db", "-f", str(CONFIG)], env=env, stdout=log,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        # Both instances in service: the balancer has spread requests over both.
        served: set[str] = set()
        deadline = time.monotonic() + 60
        while len(served) < 2:
            assert proc.poll() is None, (tmp_path / "haproxy.log").read_text()
            assert time.monotonic() < deadline, served
            try:
                r = httpx.post(url + "/v1/chat/completions", json=body(2), timeout=60)
                if r.status_code == 200:
                    served.add(r.headers["x-npu-proxy-worker"])
            except httpx.TransportError:
                time.sleep(0.1)
        yield url
    finally:
        stop_process(proc)
        log.close()


def body(max_tokens: int, stream: bool = False) -> dict[str, Any]:
    return {"model": "smollm2:135m", "max_tokens": max_tokens, "ignore_eos": True,
            "stream": stream, "stream_options": {"include_usage": True} if stream else None,
            "messages": [{"role": "user", "content": "Tell me a long story."}]}


class Stream:
    """An OpenAI chat stream through the balancer, read in a thread."""

    def __init__(self, url: str, max_tokens: int) -> None:
        self.worker = ""
        self.chunks: list[dict[str, Any]] = []
        self.done = False
        self.failed: BaseException | None = None
        pool = concurrent.futures.ThreadPoolExecutor(1)
        self.future = pool.submit(self._run, url, max_tokens)
        pool.shutdown(wait=False)

    def _run(self, url: str, max_tokens: int) -> None:
        try:
            with httpx.stream("POST", url + "/v1/chat/completions", timeout=300,
                              json=body(max_tokens, stream=True)) as r:
                self.worker = r.headers.get("x-npu-proxy-worker", "")
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        self.done = True
                    elif line.startswith("data: "):
                        self.chunks.append(json.loads(line[6:]))
        except httpx.TransportError as exc:
            self.failed = exc

    def wait_chunks(self, n: int) -> None:
        deadline = time.monotonic() + 120
        while len(self.chunks) < n and not self.future.done():
            assert time.monotonic() < deadline, self.chunks
            time.sleep(0.02)


def test_streams_survive_the_balancer_and_an_instance_loss(
        pair: tuple[Server, Server], balancer: str) -> None:
    a, _ = pair
    streams = [Stream(balancer, 120) for _ in range(4)]
    for s in streams:
        s.wait_chunks(3)
    by_worker = {s.worker for s in streams}
    # Least connections: four long streams at once land on both instances.
    assert by_worker == {"llm-a", "llm-b"}, by_worker
    # Instance a dies whole (supervisor, gateway, workers), mid-stream.
    for pid in descendants(a.proc.pid) | {a.proc.pid}:  # type: ignore[union-attr]
        os.kill(pid, signal.SIGKILL)
    a.proc.wait()  # type: ignore[union-attr]
    for s in streams:
        s.future.result(timeout=300)
    for s in streams:
        if s.worker == "llm-b":
            # Whole: every token, the finish reason, the usage and [DONE].
            content = [c for c in s.chunks if c["choices"] and c["choices"][0]["delta"]
                       .get("content")]
            usage = [c["usage"] for c in s.chunks if c.get("usage")]
            assert s.failed is None and s.done, s.chunks[-2:]
            assert usage and usage[-1]["completion_tokens"] == 120
            assert content and s.chunks[-2]["choices"][0]["finish_reason"] == "length"
        else:
            assert not s.done  # cut by the instance's death, which the client sees
    # New requests keep succeeding, served by the instance that is left, before and after
    # HAProxy's health check marks the dead one down.
    for _ in range(6):
        r = httpx.post(balancer + "/v1/chat/completions", json=body(4), timeout=120)
        assert r.status_code == 200 and r.headers["x-npu-proxy-worker"] == "llm-b"
