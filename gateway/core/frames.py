"""A request answered by several frames and one last one (speech: `Delta`s then a
`Transcription`, `SpeechChunk`s then a `Speech`): its frames read up to the last, and the
stream released.

`Generation` (generation.py) is this for the generating requests, with their timing and
metrics; the speech routes need only the loop.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import TypeVar

from npu_proxy.gateway.core.broker import Broker
from npu_proxy.gateway.core.errors import GatewayError, from_failed
from npu_proxy.gateway.core.request_stream import RequestStream
from npu_proxy.protocol.messages import Abort, Failed, RequestFrame

Part = TypeVar("Part")
Last = TypeVar("Last")

# NOTE: a frame later than the deadline by this much means a stalled worker.
GRACE_S = 5.0


async def frames_until(stream: RequestStream, first: RequestFrame, deadline: float,
                       part: type[Part], last: type[Last],
                       task: str) -> AsyncIterator[Part | Last]:
    """The frames from `first` on, ending with the `last` one.

    A `Failed` frame is raised as its GatewayError, a frame of another kind is a 500, and no
    frame by `deadline` (plus the grace) a 504 naming `task` ("the transcription").
    """
    frame = first
    while True:
        if isinstance(frame, Failed):
            raise from_failed(frame)
        if isinstance(frame, last):
            yield frame
            return
        if not isinstance(frame, part):
            raise GatewayError(500, "internal", f"unexpected frame {type(frame).__name__}")
        yield frame
        try:
            frame = await stream.next_frame(max(0.1, deadline + GRACE_S - time.time()))
        except TimeoutError:
            raise GatewayError(504, "timeout", f"{task} did not finish in time") from None


def release(broker: Broker, stream: RequestStream) -> None:
    """Stop listening to the stream, and the worker working on it.

    NOTE: an abort after the last frame is a no-op in the worker; before it, it stops work
    nobody waits for.
    """
    broker.send(stream.worker, Abort(id=stream.id))
    broker.close(stream)
