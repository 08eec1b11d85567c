"""Checks before bodies (issue 27): Host, Origin and the key are decided from the headers, a
refused body is read and dropped (never kept), at most `max_receiving_bodies` bodies are read
at once and each chunk must come within `body_read_timeout`.

These drive the gateway's real ASGI stack (gateway/app.py) in-process with a client that
sends its body in chunks, so the bytes the gateway keeps can be counted with tracemalloc;
tests/test_auth.py sends the same upload to a real server.
"""

from __future__ import annotations

import asyncio
import json
import tracemalloc
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from npu_proxy.gateway.app import Gateway
from npu_proxy.gateway.http.drain import BodyCounter
from npu_proxy.protocol.config import Config

KEY = "gate-key"
CHUNK = 64 * 1024
UPLOAD = 8 * 1024 * 1024


def gateway(tmp_path: Path, **settings: Any) -> Callable[..., Awaitable[Any]]:
    config = Config(api_key=KEY, runtime_dir=str(tmp_path), **settings)
    return Gateway(config).app()  # type: ignore[return-value]


class Client:
    """One request: its headers, then `chunks` chunks of CHUNK fresh bytes each; with
    `stall`, it stops sending after the first chunk until `stall` is set."""

    def __init__(self, chunks: int, stall: asyncio.Event | None = None) -> None:
        self.left = chunks
        self.stall = stall
        self.sent_first = asyncio.Event()
        self.answered = asyncio.Event()
        self.status = 0
        self.headers: dict[str, str] = {}
        self.body = b""

    async def receive(self) -> dict[str, Any]:
        if self.answered.is_set() or self.left == 0:
            await self.answered.wait()  # NOTE: hypercorn's disconnect once the answer is sent
            return {"type": "http.disconnect"}
        if self.sent_first.is_set() and self.stall is not None:
            await self.stall.wait()
        self.sent_first.set()
        self.left -= 1
        # NOTE: a new object each time, as a socket's reads are: kept, they add up.
        return {"type": "http.request", "body": bytes(CHUNK), "more_body": self.left > 0}

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self.headers = {k.decode(): v.decode() for k, v in message["headers"]}
        elif message["type"] == "http.response.body":
            self.body += message.get("body", b"")
            if not message.get("more_body", False):
                self.answered.set()

    async def run(self, app: Callable[..., Awaitable[Any]], path: str,
                  headers: dict[str, str]) -> None:
        scope = {"type": "http", "method": "POST", "path": path, "raw_path": path.encode(),
                 "root_path": "", "scheme": "http", "query_string": b"", "http_version": "1.1",
                 "server": ("127.0.0.1", 11434), "client": ("127.0.0.1", 5000),
                 "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]}
        await app(scope, self.receive, self.send)


def test_an_unauthenticated_8_mib_upload_is_401_and_none_of_it_is_kept(tmp_path: Path) -> None:
    app = gateway(tmp_path)

    async def upload() -> Client:
        client = Client(UPLOAD // CHUNK)
        await client.run(app, "/v1/chat/completions", {
            "host": "127.0.0.1:11434", "content-type": "application/json",
            "content-length": str(UPLOAD)})
        return client

    before = BodyCounter.dropped
    tracemalloc.start()
    try:
        client = asyncio.run(upload())
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert client.status == 401
    assert json.loads(client.body)["error"]["code"] == "invalid_api_key"
    # NOTE: kept, the body alone is 8 MiB; read and dropped, a few chunks at most.
    assert peak < 2 * 1024 * 1024, peak
    assert BodyCounter.dropped - before == UPLOAD  # read to its end, so the 401 is seen


def test_a_refused_origin_drops_its_body_too(tmp_path: Path) -> None:
    app = gateway(tmp_path)
    client = Client(16)
    asyncio.run(client.run(app, "/api/chat", {
        "host": "127.0.0.1:11434", "origin": "https://evil.example",
        "content-length": str(16 * CHUNK)}))
    assert client.status == 403 and "origin" in json.loads(client.body)["error"]


def test_a_body_longer_than_the_drain_budget_is_answered_and_the_connection_closed(
        tmp_path: Path) -> None:
    app = gateway(tmp_path, max_drain_bytes=4 * CHUNK)
    client = Client(1000)
    asyncio.run(client.run(app, "/api/chat", {
        "host": "127.0.0.1:11434", "transfer-encoding": "chunked"}))
    assert client.status == 401 and client.headers["connection"] == "close"
    assert client.left > 900  # NOTE: not read to its end: the connection is closed instead


def test_bodies_beyond_the_cap_are_503_before_they_are_read(tmp_path: Path) -> None:
    app = gateway(tmp_path, max_receiving_bodies=2)
    auth = {"host": "127.0.0.1:11434", "authorization": f"Bearer {KEY}",
            "content-length": str(4 * CHUNK)}

    async def three() -> tuple[list[Client], Client]:
        stall = asyncio.Event()
        slow = [Client(4, stall) for _ in range(2)]
        tasks = [asyncio.create_task(c.run(app, "/v1/no-such-route", auth)) for c in slow]
        for c in slow:
            await c.sent_first.wait()
        extra = Client(4)
        await extra.run(app, "/v1/chat/completions", auth)
        stall.set()
        await asyncio.gather(*tasks)
        return slow, extra

    slow, extra = asyncio.run(three())
    assert extra.status == 503 and extra.headers["retry-after"] == "1"
    assert extra.left == 4  # not a byte of it read
    error = json.loads(extra.body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert "max_receiving_bodies" in error["message"]
    assert all(c.status not in (503, 0) for c in slow)  # read in full once they came


def test_a_body_that_stops_arriving_is_408(tmp_path: Path) -> None:
    app = gateway(tmp_path, body_read_timeout=0.2)
    client = Client(4, asyncio.Event())  # never set: the client stalls after one chunk
    asyncio.run(client.run(app, "/api/chat", {
        "host": "127.0.0.1:11434", "authorization": f"Bearer {KEY}",
        "content-length": str(4 * CHUNK)}))
    assert client.status == 408 and "body_read_timeout" in json.loads(client.body)["error"]


def test_a_trickling_body_gives_its_slot_to_a_new_request(tmp_path: Path) -> None:
    """Issue 43: connections sending a byte now and then held every body slot, and every
    other POST was a 503 for as long as they stayed. With the slots full, a new request takes
    the slot of the slowest body that has come at under 1 KiB/s for a second (it gets 408),
    and is served."""
    from npu_proxy.gateway.http.body_limit import SLOW_GRACE

    app = gateway(tmp_path, max_receiving_bodies=2)
    auth = {"host": "127.0.0.1:11434", "authorization": f"Bearer {KEY}"}

    class Trickle(Client):
        """One byte, then nothing until released."""

        async def receive(self) -> dict[str, Any]:
            if self.sent_first.is_set():
                assert self.stall is not None
                await self.stall.wait()
                return {"type": "http.disconnect"}
            self.sent_first.set()
            return {"type": "http.request", "body": b"{", "more_body": True}

    async def run() -> tuple[list[Client], Client]:
        release = asyncio.Event()
        slow = [Trickle(1, release) for _ in range(2)]
        tasks = [asyncio.create_task(c.run(app, "/v1/chat/completions",
                                           {**auth, "content-length": "1000"})) for c in slow]
        for c in slow:
            await c.sent_first.wait()
        # NOTE: the rule counts time since a body began: once past the grace, a byte in that
        # time is under the rate however slow the machine is.
        await asyncio.sleep(SLOW_GRACE * 1.1)
        fresh = Client(1)
        await fresh.run(app, "/v1/no-such-route", {**auth, "content-length": str(CHUNK)})
        release.set()
        await asyncio.gather(*tasks)
        return slow, fresh

    slow, fresh = asyncio.run(run())
    assert fresh.status == 404  # read and routed: a slot was had
    assert sorted(c.status for c in slow) == [0, 408]  # one evicted; the other left (499)
    evicted = next(c for c in slow if c.status == 408)
    assert "max_receiving_bodies" in json.loads(evicted.body)["error"]["message"]
