"""The body's size (`max_body_bytes`), held outside every route.

`BodyLimitMiddleware` answers a larger body with 413 in the caller's API's own shape, found
by its Content-Length up front or, for a body sent without one (chunked), by counting its
chunks; it never keeps more than the limit. Blob uploads (gateway/admin/create.py) stream to
disk instead, under `max_blob_bytes`.
"""

from __future__ import annotations

from collections import deque

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from npu_proxy.gateway.core.errors import GatewayError
from npu_proxy.gateway.http.wire import dialect_for


def _content_length(scope: Scope) -> int | None:
    for key, value in scope.get("headers", ()):
        if key == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _drain(receive: Receive) -> bool:
    """Read the rest of a refused body, keeping none of it; False if the client went away."""
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return False
        if not message.get("more_body", False):
            return True


class BodyLimitMiddleware:
    """Refuses a request body over `max_bytes` with 413; passes the others on unchanged.

    A body within the limit is read here and handed to the app as the same messages (the
    app reads the whole body anyway); the client's later messages (its disconnect) follow.

    NOTE: a refused body is still read to its end (and dropped) before the 413 is sent.
    Hypercorn keeps queueing a body's chunks for the app, and nothing takes them once the app
    has answered. Tried with 50 MB uploads: answered without reading, a chunked upload ended
    in a client write timeout (the client, still writing, never read the 413) 16 times in
    20; answered part-way, every 413 arrived but Hypercorn's reader of about one connection
    in four stayed blocked for the server's life. Read to the end, every 413 arrives, nothing
    is left behind and the connection stays usable. A client that sends without end is read
    without end, keeping nothing, as it could hold a connection open anyway.
    """

    def __init__(self, app: ASGIApp, max_bytes: int, exempt: tuple[str, ...] = ()) -> None:
        self.app = app
        self.max_bytes = max_bytes
        # Path prefixes whose routes stream their body and hold it to a limit of their own.
        self.exempt = exempt

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or str(scope.get("path", "")).startswith(self.exempt):
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            if await _drain(receive):
                await self._refuse(scope, receive, send, f"is {declared} bytes")
            return
        messages: deque[Message] = deque()
        size = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break  # a disconnect: the app sees it where it would have
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                messages.clear()
                if await _drain(receive):
                    await self._refuse(scope, receive, send, f"is over {self.max_bytes} bytes")
                return
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            if messages:
                return messages.popleft()
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, size: str) -> None:
        mib = self.max_bytes / (1024 * 1024)
        exc = GatewayError(413, "request_too_large",
                           f"the request body {size}; the limit is {self.max_bytes} bytes "
                           f"({mib:g} MiB, max_body_bytes)")
        await dialect_for(scope).error_response(exc)(scope, receive, send)
