"""`RequestStream`: the frames of one request, in order, as the broker's reader delivers
them (gateway/core/broker.py), waited for by the request's handler; and the request's
`fingerprint`, what identifies it across retries (the crash quarantine's key)."""

from __future__ import annotations

import asyncio
import hashlib
from collections import deque

import msgspec

from npu_proxy.protocol.messages import RequestFrame, encode

# A request's fields that differ between two sends of the same request.
_PER_SEND = ("id", "log_id", "deadline")


def fingerprint(msg: msgspec.Struct) -> str:
    """What identifies a request across retries: the message without its ids, deadline and
    (for a generation) seed, which the gateway draws afresh for each send."""
    fields = {f: "" if f != "deadline" else 0.0 for f in _PER_SEND if hasattr(msg, f)}
    params = getattr(msg, "params", None)
    if params is not None and getattr(params, "seed", None) is not None:
        fields["params"] = msgspec.structs.replace(params, seed=None)
    return hashlib.blake2b(encode(msgspec.structs.replace(msg, **fields)),
                           digest_size=12).hexdigest()


class RequestStream:
    """The frames of one request, in order, as the broker's reader delivers them.

    NOTE: measured per streamed token (bench/gateway_cpu.py), an asyncio.Queue's get and an
    asyncio.timeout around every wait cost more than the rest of the wait: here a frame
    already there is taken at once, a wait is one Future, and the timeout is one timer per
    request, armed again only when the caller's deadline moves.
    """

    __slots__ = ("_fingerprint", "_frames", "_timer", "_timer_at", "_waiter", "crashed",
                 "crashed_with", "id", "msg", "next_seq", "resumable", "worker")

    def __init__(self, id: str, worker: str, msg: msgspec.Struct | None = None,
                 fingerprint: str = "") -> None:
        self.id = id
        self.worker = worker
        # The request sent, and its fingerprint once known (computed when first asked for).
        self.msg = msg
        self._fingerprint = fingerprint
        # A generation that resumes if its worker dies (gateway/core/generation.py): a crash
        # quarantines it only if it gives up (`crashed` then says why).
        self.resumable = False
        self.crashed = ""
        # How many requests were in flight on the worker when it crashed, this one included.
        self.crashed_with = 0
        self.next_seq = 0
        self._frames: deque[RequestFrame] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0

    @property
    def fingerprint(self) -> str:
        """What identifies the request across retries (`fingerprint`)."""
        if not self._fingerprint and self.msg is not None:
            self._fingerprint = fingerprint(self.msg)
        return self._fingerprint

    def put(self, frame: RequestFrame) -> None:
        self._frames.append(frame)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def ready(self) -> bool:
        """A frame is there: the next `next_frame` returns without waiting."""
        return bool(self._frames)

    async def next_frame(self, timeout: float) -> RequestFrame:
        """The next frame from the worker; TimeoutError after `timeout` s without one."""
        frames = self._frames
        if frames:
            return frames.popleft()
        loop = asyncio.get_running_loop()
        now = loop.time()
        if timeout <= 0:
            raise TimeoutError
        at = now + timeout
        if self._timer is None or abs(at - self._timer_at) > 0.5:
            self.cancel_timer()
            self._timer = loop.call_at(at, self._expire)
            self._timer_at = at
        waiter = self._waiter = loop.create_future()
        try:
            await waiter
        finally:
            self._waiter = None
        return frames.popleft()

    def _expire(self) -> None:
        self._timer = None
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(TimeoutError())

    def cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
