"""`RequestStream`: the frames of one request, in order, as the broker's reader delivers
them (gateway/core/broker.py), waited for by the request's handler."""

from __future__ import annotations

import asyncio
from collections import deque

from npu_proxy.protocol.messages import RequestFrame


class RequestStream:
    """The frames of one request, in order, as the broker's reader delivers them.

    NOTE: measured per streamed token (bench/gateway_cpu.py), an asyncio.Queue's get and an
    asyncio.timeout around every wait cost more than the rest of the wait: here a frame
    already there is taken at once, a wait is one Future, and the timeout is one timer per
    request, armed again only when the caller's deadline moves.
    """

    __slots__ = ("_frames", "_timer", "_timer_at", "_waiter", "crashed", "fingerprint", "id",
                 "next_seq", "resumable", "worker")

    def __init__(self, id: str, worker: str, fingerprint: str = "") -> None:
        self.id = id
        self.worker = worker
        # What identifies the request across retries (gateway/core/broker.py fingerprint).
        self.fingerprint = fingerprint
        # A generation that resumes if its worker dies (gateway/core/generation.py): a crash
        # quarantines it only if it gives up (`crashed` then says why).
        self.resumable = False
        self.crashed = ""
        self.next_seq = 0
        self._frames: deque[RequestFrame] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = 0.0

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
