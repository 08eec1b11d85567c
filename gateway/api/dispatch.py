"""How the request path answers with what a worker sends: streamed or whole, every kind.

A generation (`Dispatch` + a dialect's `Reply`) and a speech request's frames (`Frames`: audio
in, audio out) are rendered here, once: a stream is framed and kept alive the dialect's way
(gateway/http/wire.py), a GatewayError after the first byte is the API's error event (raw
audio, which has no place for one, ends early and the log says why), a collected answer is
read under disconnect-watch, and the worker's stream is released however the response ended.
The request path (gateway/api/request_path.py) is the only caller.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from starlette.requests import Request
from starlette.responses import Response

from npu_proxy.gateway.content.ignored import Ignored
from npu_proxy.gateway.core.errors import GatewayError
from npu_proxy.gateway.core.generation import Frames, Generation
from npu_proxy.gateway.core.model_table import ServedModel
from npu_proxy.gateway.http.util import dumps, request_id, unless_disconnected
from npu_proxy.gateway.http.wire import Dialect, StreamResponse
from npu_proxy.protocol.messages import Generate

log = logging.getLogger(__name__)

T = TypeVar("T")


class Reply(Protocol):
    """How one API renders a generation: as stream events, or as one body."""

    def events(self, gen: Generation) -> AsyncIterator[dict[str, Any]]: ...

    def body(self, gen: Generation, parts: list[str]) -> dict[str, Any]:
        """The whole answer from the text pieces in the order the worker sent them."""
        ...


@dataclass
class Dispatch:
    """A request translated: what to dispatch, and how to answer with the output."""

    model: ServedModel
    msg: Generate
    stream: bool
    reply: Reply
    # Called once the generation ended, however it ended (Ollama's keep_alive counts from it).
    ended: Callable[[], None] | None = None
    # What the request sent that the server left out (gateway/content/ignored.py): a header.
    ignored: Ignored | None = None
    # A silent stream's keep-alive as an event of the API's own, for clients whose idle timer
    # only an event resets (Codex: not an SSE comment); else the dialect's (http/wire.py).
    keepalive: Callable[[], dict[str, Any]] | None = None

    def headers(self, gen: Generation) -> dict[str, str]:
        return gen.headers() | (self.ignored.headers() if self.ignored is not None else {})

    def end(self) -> None:
        if self.ended is not None:
            self.ended()


# --- a generation ---------------------------------------------------------------------------


def streamed(dialect: Dialect, turn: Dispatch, gen: Generation, every: float) -> Response:
    """The generation as the dialect's stream, kept alive every `every` seconds of silence."""
    every = every if dialect.keepalive else 0.0
    own = turn.keepalive
    keepalive = dialect.keepalive if own is None else lambda: dialect.frame(own())
    return StreamResponse(_stream(dialect, turn, gen), dialect.media_type, turn.headers(gen),
                          keepalive, every)


async def _stream(dialect: Dialect, turn: Dispatch, gen: Generation) -> AsyncIterator[bytes]:
    # NOTE: events whose frames were already there when they were made go out in one body
    # chunk with those after them (several SSE events or NDJSON lines in one write, as
    # clients parse any chunking): a stream that fell behind its worker catches up in one
    # write and one pass through the ASGI send chain, where each write cost ~0.1 ms of the
    # gateway's CPU (bench/gateway_cpu.py). A lone event is never held back: the chunk goes
    # out as soon as the next event would have to wait. A silent stream's keep-alive is the
    # response's (http/wire.py StreamResponse).
    held: list[bytes] = []
    try:
        async for event in turn.reply.events(gen):
            held.append(dialect.frame(event))
            if not gen.ready():
                yield b"".join(held) if len(held) > 1 else held[0]
                held.clear()
    except GatewayError as exc:
        held.append(dialect.error_event(exc))
        yield b"".join(held)
        return
    finally:
        turn.end()
    if dialect.end:
        held.append(dialect.end)
    if held:
        yield b"".join(held)


async def whole(request: Request, dialect: Dialect, turn: Dispatch, gen: Generation) -> Response:
    """The generation collected under disconnect-watch, as one JSON body."""
    try:
        parts = await unless_disconnected(request, _collect(gen))
    except GatewayError as exc:
        return dialect.error_response(exc, turn.headers(gen))
    finally:
        turn.end()
    # NOTE: made once the answer is whole: they say where it ended (a resumption's worker)
    # and how it went on if its worker died (X-NPU-Proxy-Resumed).
    return Response(dumps(turn.reply.body(gen, parts)), media_type="application/json",
                    headers=turn.headers(gen))


async def _collect(gen: Generation) -> list[str]:
    return [delta.text async for delta in gen]


# --- a speech request's frames --------------------------------------------------------------


async def frames_events(dialect: Dialect, frames: Frames[Any, Any],
                        events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    """The events framed the dialect's way, its error event last if the worker failed."""
    try:
        async for event in events:
            yield dialect.frame(event)
    except GatewayError as exc:
        yield dialect.error_event(exc)
    finally:
        frames.close()


async def frames_bytes(request: Request, frames: Frames[Any, Any],
                       chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The chunks as they come. NOTE: a failure after the first bytes can only end the body
    early (no error shape fits inside audio; the status line has gone): the log says why."""
    try:
        async for chunk in chunks:
            if chunk:
                yield chunk
    except GatewayError as exc:
        log.warning("request_id=%s the stream ended early: %s", request_id(request),
                    exc.message)
    finally:
        frames.close()


async def frames_whole(request: Request, frames: Frames[Any, Any], work: Awaitable[T]) -> T:
    """`work` (which reads the frames) under disconnect-watch; the frames released after."""
    try:
        return await unless_disconnected(request, work)
    finally:
        frames.close()
