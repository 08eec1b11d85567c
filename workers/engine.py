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
`EngineBase`; the test fault hooks every engine honours are in workers/faults.py.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol

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
