"""What every engine is: the interface the worker process (workers/process.py) drives.

An engine holds one OpenVINO GenAI pipeline and the logic around it; the worker process
wraps it with sockets, threads and signals, as `Engine` describes. The engines, one module
each:
- workers/batch_engine.py `BatchEngine`: role `llm` (GPU/CPU), a ContinuousBatchingPipeline
  stepped by one engine thread, many requests at once;
- workers/serial_engine.py `SerialEngine`: role `npu`, a stateful LLMPipeline with the NPU's
  fixed prompt limit, one request at a time;
- workers/vlm_engine.py `VlmEngine`: role `vlm`, chat with images;
- workers/embed_engine.py `EmbedEngine`: role `embed`, a TextEmbeddingPipeline;
- workers/rerank_engine.py `RerankEngine`: role `rerank`, a TextRerankPipeline;
- workers/speech/: roles `asr` and `tts`.

The generating engines (batch, serial, vlm) derive from workers/generation/engine_base.py
`EngineBase`; the others from `InboxEngine` here, the bookkeeping of one inbox. The test fault
hooks are in workers/faults.py.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Generic, Protocol, TypeVar

from npu_proxy.protocol.config import WorkerSpec
from npu_proxy.protocol.messages import RequestFrame

# How an engine publishes a frame (the worker process's PUB socket, or a list in tests).
Emit = Callable[[RequestFrame], None]


class Engine(Protocol):
    """What the worker process needs of an engine."""

    generated_tokens: int
    served: int
    # time.monotonic() of the engine's last progress (set by the engine thread).
    progress_at: float
    # Publishes a heartbeat at once (set by the worker process): an engine calls it on the
    # engine thread right before it starts `blocking`, so the last heartbeat says so.
    announce: Callable[[], None]

    def load(self, properties: dict[str, Any]) -> None: ...
    def warm_up(self) -> None: ...
    def has_room(self) -> bool:
        """May the worker take one more request? Asked on the receiver thread, the only one
        that submits, right before submit()."""
        ...
    def submit(self, msg: Any) -> None: ...
    def run(self, stop: threading.Event) -> None: ...
    def abort_all(self, reason: str) -> None: ...
    @property
    def queue_depth(self) -> int: ...
    @property
    def in_flight(self) -> int: ...
    @property
    def blocking(self) -> bool:
        """Is the engine thread stepping a pipeline call that holds the GIL (so heartbeats
        may pause for a whole step)? See protocol/states.py silence_allowed."""
        ...


Msg = TypeVar("Msg")


class InboxEngine(Generic[Msg]):
    """An engine fed through one bounded inbox of (arrival time, request), served on the
    engine thread: the embed, rerank and speech engines. `_busy` counts the requests being
    served; the queue depth is what waits in the inbox."""

    def __init__(self, spec: WorkerSpec, emit: Emit) -> None:
        self.spec = spec
        self.emit = emit
        # (arrival time, message): queue time counts from arrival, not from serving.
        # NOTE: a Queue, not a SimpleQueue: CPython 3.11's SimpleQueue.get(timeout=...) waits
        # for ever when a signal handler (SIGTERM's, on this main thread) runs past the
        # deadline (it recomputes a negative timeout, which means none), so a worker told to
        # drain while idle never stopped and was killed at the grace period.
        self._inbox: queue.Queue[tuple[float, Msg]] = queue.Queue()
        self._busy = 0
        self.generated_tokens = 0
        self.served = 0
        self.progress_at = time.monotonic()
        self.announce: Callable[[], None] = lambda: None

    def has_room(self) -> bool:
        # NOTE: the inbox holds the requests waiting their turn; those being served (an
        # embedding batch, a rerank round) are not counted against max_queue.
        return self._inbox.qsize() < self.spec.max_queue

    @property
    def queue_depth(self) -> int:
        return self._inbox.qsize()

    @property
    def in_flight(self) -> int:
        return self._busy

    def _arrivals(self, stop: threading.Event) -> Iterator[tuple[float, Msg]]:
        """Each request as it is taken from the inbox, until told to stop; the engine counts
        as making progress while it waits."""
        while not stop.is_set():
            self.progress_at = time.monotonic()
            try:
                yield self._inbox.get(timeout=0.05)
            except queue.Empty:
                continue
