"""The body's size (`max_body_bytes`), held outside every route.

`BodyLimitMiddleware` answers a larger body with 413 in the caller's API's own shape, found
by its Content-Length up front or, for a body sent without one (chunked), by counting its
chunks; it never keeps more than the limit, and it reads at most
`max_receiving_bodies` bodies at once, each chunk within `body_read_timeout`. When all of
those are taken, a new request takes the slot of the slowest body in progress, if that one
has come at less than MIN_RATE for SLOW_GRACE or longer (answered 408): connections trickling
a byte every few seconds held every slot and turned every other POST into a 503 (issue 43). A
client that leaves mid-body is logged as a 499, never handed to a route. Blob uploads
(gateway/admin/create.py) stream to disk instead, under `max_blob_bytes`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from npu_proxy.gateway.core.errors import GatewayError
from npu_proxy.gateway.http.drain import DrainBudget, refuse
from npu_proxy.gateway.http.wire import dialect_for

log = logging.getLogger(__name__)

# A body in progress that has come at less than MIN_RATE bytes a second for SLOW_GRACE seconds
# or more gives its slot to a new request when none is free. NOTE: 1 KiB/s is far below any
# real client's link; a trickle is an attack or a stalled client.
MIN_RATE = 1024.0
SLOW_GRACE = 1.0


@dataclass(eq=False)  # NOTE: kept in a set, by identity
class _Receiving:
    """A body being read: when it began, what came, and its current read's deadline."""

    started: float = field(default_factory=time.monotonic)
    size: int = 0
    read: asyncio.Timeout | None = None
    evicted: bool = False

    def slow(self, now: float) -> float | None:
        """Its rate when it counts as slow now (bytes a second), else None."""
        elapsed = now - self.started
        rate = self.size / elapsed if elapsed > 0 else float("inf")
        return rate if elapsed >= SLOW_GRACE and rate < MIN_RATE else None


def _content_length(scope: Scope) -> int | None:
    for key, value in scope.get("headers", ()):
        if key == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _has_body(scope: Scope) -> bool:
    for key, value in scope.get("headers", ()):
        if key == b"transfer-encoding" or (key == b"content-length" and value.strip() != b"0"):
            return True
    return False


class BodyLimitMiddleware:
    """Refuses a request body over `max_bytes` with 413; passes the others on unchanged.

    A body within the limit is read here and handed to the app as the same messages (the
    app reads the whole body anyway); the client's later messages (its disconnect) follow.
    It sits inside the Host, Origin and key checks (gateway/app.py), so only a request they
    let through has a byte of its body kept.

    At most `max_receiving` bodies are read at once: one more is 503 with Retry-After before a
    byte of it is read. Each chunk must come within the budget's read timeout, or the request
    ends with 408. A refused body is read and dropped within the budget (gateway/http/drain.py).
    """

    def __init__(self, app: ASGIApp, max_bytes: int, exempt: tuple[str, ...] = (), *,
                 max_receiving: int = 64, budget: DrainBudget | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        # Path prefixes whose routes stream their body and hold it to a limit of their own.
        self.exempt = exempt
        self.max_receiving = max_receiving
        self.receiving: set[_Receiving] = set()
        self.budget = budget or DrainBudget()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or str(scope.get("path", "")).startswith(self.exempt):
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._refuse(scope, receive, send, 413, "request_too_large",
                               f"the request body is {declared} bytes; {self._limit()}")
            return
        if not _has_body(scope):
            await self.app(scope, receive, send)
            return
        if len(self.receiving) >= self.max_receiving and not self._evict_slowest():
            error = GatewayError(503, "unavailable", f"{self.max_receiving} request bodies are "
                                 "being received (max_receiving_bodies); retry shortly",
                                 retry_after=1)
            await refuse(dialect_for(scope).error_response(error), scope, receive, send,
                         self.budget, read_first=False)
            return
        mine = _Receiving()
        self.receiving.add(mine)
        try:
            messages = await self._read(scope, receive, send, mine)
        finally:
            self.receiving.discard(mine)
        if messages is None:
            return

        async def replay() -> Message:
            if messages:
                return messages.popleft()
            return await receive()

        await self.app(scope, replay, send)

    def _evict_slowest(self) -> bool:
        """End the slowest slow body in progress (its read times out now); False if none."""
        now = time.monotonic()
        slow = [(rate, body) for body in self.receiving
                if body.read is not None and not body.evicted
                and (rate := body.slow(now)) is not None]
        if not slow:
            return False
        _, body = min(slow, key=lambda pair: pair[0])
        body.evicted = True
        assert body.read is not None
        body.read.reschedule(asyncio.get_running_loop().time())
        return True

    async def _read(self, scope: Scope, receive: Receive, send: Send,
                    mine: _Receiving) -> deque[Message] | None:
        """The body's messages, or None once it has been refused (or its client left)."""
        messages: deque[Message] = deque()
        while True:
            try:
                async with asyncio.timeout(self.budget.read_timeout) as mine.read:
                    message = await receive()
            except TimeoutError:
                mine.read = None
                messages.clear()
                rate = mine.size / max(time.monotonic() - mine.started, 1e-9)
                why = (f"the request body came at {rate:.0f} bytes a second, under "
                       f"{MIN_RATE:.0f}, and another request needed its slot "
                       "(max_receiving_bodies)" if mine.evicted else
                       "the request body stopped arriving for "
                       f"{self.budget.read_timeout:g} s (body_read_timeout)")
                await refuse(dialect_for(scope).error_response(GatewayError(408, "timeout", why)),
                             scope, receive, send, self.budget, read_first=False)
                return None
            mine.read = None  # NOTE: between reads nothing is evicted (_evict_slowest)
            if message["type"] != "http.request":
                # NOTE: the client left before its body was whole: nothing to answer, and no
                # route should see half a body (it made a traceback and a 500 per connection).
                log.info("499 %s %s: the client closed the connection after %d bytes of its "
                         "body", scope.get("method", ""), scope.get("path", ""), mine.size)
                return None
            messages.append(message)
            mine.size += len(message.get("body", b""))
            if mine.size > self.max_bytes:
                messages.clear()
                await self._refuse(scope, receive, send, 413, "request_too_large",
                                   f"the request body is over {self.max_bytes} bytes; "
                                   f"{self._limit()}")
                return None
            if not message.get("more_body", False):
                return messages

    def _limit(self) -> str:
        mib = self.max_bytes / (1024 * 1024)
        return f"the limit is {self.max_bytes} bytes ({mib:g} MiB, max_body_bytes)"

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, status: int,
                      kind: str, message: str) -> None:
        exc = GatewayError(status, kind, message)
        await refuse(dialect_for(scope).error_response(exc), scope, receive, send, self.budget)
