"""What every route handler does with Starlette's request: its ids, its JSON body, the client
leaving, and the JSON it answers."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import Any, TypeVar

import msgspec
from starlette.requests import Request

from npu_proxy.gateway.core.errors import GatewayError, invalid
from npu_proxy.protocol.ids import new_id

T = TypeVar("T")


def accept_request_id(sent: str) -> str:
    """The X-Request-ID the client sent when it is short and printable, else a new one."""
    return sent if sent and len(sent) <= 128 and sent.isprintable() else new_id("req-")


def request_id(request: Request) -> str:
    """The id the client sent in X-Request-ID, else a new one; echoed back in the response."""
    rid = getattr(request.state, "request_id", None)
    if rid is None:
        rid = accept_request_id(request.headers.get("x-request-id", ""))
        request.state.request_id = rid
    return str(rid)


def request_key(request: Request) -> str:
    """The gateway's own id for the request: the key of its frames, aborts and route.

    NOTE: never the client's X-Request-ID: a retrying proxy or a load balancer that sends one
    fixed id would make two requests share a key and cross-wire or hang them (issue 14).
    """
    key = getattr(request.state, "key", None)
    if key is None:
        key = request.state.key = new_id("r-")
    return str(key)


async def decode_body(request: Request, kind: type[T], strict: bool = True,
                      max_objects: int = 0) -> T:
    """The body decoded as `kind`; with `max_objects`, refused first when it holds more `{`
    bytes than that (a count at memchr speed, where decoding builds every object)."""
    body = await request.body()
    if not body:
        raise invalid("the request body is empty; a JSON object is required")
    if max_objects and (objects := body.count(b"{")) > max_objects:
        raise invalid(f"the request body holds {objects} JSON objects ('{{' counted, in "
                      f"strings too); the limit is {max_objects} (max_json_objects)")
    try:
        return msgspec.json.decode(body, type=kind, strict=strict)
    except msgspec.ValidationError as exc:
        text = str(exc)
        param = text.rsplit("`$.", 1)[-1].rstrip("`") if "`$." in text else None
        raise invalid(f"invalid request: {text}", param=param) from exc
    except msgspec.DecodeError as exc:
        raise invalid(f"the request body is not valid JSON: {exc}") from exc
    except UnicodeDecodeError as exc:
        # NOTE: msgspec raises this (not DecodeError) for bytes that are not UTF-8.
        raise invalid(f"the request body is not valid UTF-8 JSON: {exc.reason} at byte "
                      f"{exc.start}") from exc
    except RecursionError:
        # NOTE: msgspec raises this for arrays or objects nested about 1,000 deep.
        raise invalid("the request body nests arrays or objects too deeply") from None


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (and so aborting the worker) if the client goes away."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watch
    if not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, GatewayError):
            await task
        raise GatewayError(499, "aborted", "client disconnected")
    return task.result()


def dumps(obj: Any) -> bytes:
    return msgspec.json.encode(obj)


def wants_html(request: Request) -> bool:
    """A browser's navigation: a GET whose Accept names text/html (not with q=0)."""
    if request.method != "GET":
        return False
    for part in request.headers.get("accept", "").split(","):
        media, *params = (p.strip().lower() for p in part.split(";"))
        if media == "text/html":
            q = next((p[2:] for p in params if p.startswith("q=")), "1")
            try:
                return float(q) > 0
            except ValueError:
                return False
    return False
