"""The body's size (`max_body_bytes`), held outside every route.

`BodyLimitMiddleware` answers a larger body with 413 in the caller's API's own shape, found
by its Content-Length up front or, for a body sent without one (chunked), by counting its
chunks; it never keeps more than the limit, and it reads at most
`max_receiving_bodies` bodies at once, each chunk within `body_read_timeout`. Blob uploads
(gateway/admin/create.py) stream to disk instead, under `max_blob_bytes`.
"""

from __future__ import annotations

import asyncio
from collections import deque

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from npu_proxy.gateway.core.errors import GatewayError
from npu_proxy.gateway.http.drain import DrainBudget, refuse
from npu_proxy.gateway.http.wire import dialect_for


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
        self.receiving = 0
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
        if self.receiving >= self.max_receiving:
            error = GatewayError(503, "unavailable", f"{self.max_receiving} request bodies are "
                                 "being received (max_receiving_bodies); retry shortly",
                                 retry_after=1)
            await refuse(dialect_for(scope).error_response(error), scope, receive, send,
                         self.budget, read_first=False)
            return
        self.receiving += 1
        try:
            messages = await self._read(scope, receive, send)
        finally:
            self.receiving -= 1
        if messages is None:
            return

        async def replay() -> Message:
            if messages:
                return messages.popleft()
            return await receive()

        await self.app(scope, replay, send)

    async def _read(self, scope: Scope, receive: Receive, send: Send) -> deque[Message] | None:
        """The body's messages, or None once it has been refused."""
        messages: deque[Message] = deque()
        size = 0
        while True:
            try:
                async with asyncio.timeout(self.budget.read_timeout):
                    message = await receive()
            except TimeoutError:
                messages.clear()
                error = GatewayError(408, "timeout", "the request body stopped arriving for "
                                     f"{self.budget.read_timeout:g} s (body_read_timeout)")
                await refuse(dialect_for(scope).error_response(error), scope, receive, send,
                             self.budget, read_first=False)
                return None
            messages.append(message)
            if message["type"] != "http.request":
                return messages  # a disconnect: the app sees it where it would have
            size += len(message.get("body", b""))
            if size > self.max_bytes:
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
