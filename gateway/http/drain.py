"""A refused request's body: read and dropped, never kept, within a budget.

Hypercorn hands a body to the app through a queue of ten chunks; once the app has answered,
nothing takes them, and hypercorn's reader (and its put of the client's disconnect, made
while the answer's last byte is sent) waits on that queue for the server's life. So every
refusal made before the body is read (policy.py, auth.py, body_limit.py) answers through
`refuse`: it reads the body to its end and drops it, up to `max_drain_bytes`, each chunk
within `body_read_timeout` seconds, then answers; a body longer or slower than that is
answered with `Connection: close` while the rest is still read and dropped alongside, so the
queue never fills, hypercorn closes the connection after the answer and the reading ends
with it. NOTE: the client of such a body may see its write fail rather than the answer; a
client within the budget always sees the answer.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from npu_proxy.protocol.config import Config


@dataclass(frozen=True)
class DrainBudget:
    max_bytes: int = 64 * 1024 * 1024
    read_timeout: float = 30.0

    @classmethod
    def from_config(cls, config: Config) -> DrainBudget:
        return cls(config.max_drain_bytes, config.body_read_timeout)


class BodyCounter:
    """Bytes of bodies read by `drain` (dropped) — what a test can compare with what it sent."""

    dropped = 0


async def drain(receive: Receive, budget: DrainBudget) -> str:
    """Read the rest of a body and drop it: "done" at its end, "gone" when the client left,
    "over" when it is longer than the budget or a chunk comes too slowly."""
    left = budget.max_bytes
    while True:
        try:
            async with asyncio.timeout(budget.read_timeout):
                message = await receive()
        except TimeoutError:
            return "over"
        if message["type"] != "http.request":
            return "gone"
        size = len(message.get("body", b""))
        BodyCounter.dropped += size
        left -= size
        if not message.get("more_body", False):
            return "done"
        if left < 0:
            return "over"


async def _discard(receive: Receive) -> None:
    while (await receive())["type"] == "http.request":
        pass


async def refuse(response: Response, scope: Scope, receive: Receive, send: Send,
                 budget: DrainBudget, *, read_first: bool = True) -> None:
    """Answer `response` to a request whose body is not wanted (see the module's doc).

    `read_first=False` answers at once and closes the connection (a 503 for a body the
    server will not take now)."""
    if read_first:
        ended = await drain(receive, budget)
        if ended == "gone":
            return
        if ended == "done":
            await response(scope, receive, send)
            return
    response.headers["connection"] = "close"
    reader = asyncio.create_task(_discard(receive))
    try:
        await response(scope, receive, send)
        # NOTE: hypercorn puts the disconnect once the answer is sent and the connection
        # closed; a client that sends on regardless is cut off by the read timeout.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(budget.read_timeout):
                await asyncio.shield(reader)
    finally:
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await reader
