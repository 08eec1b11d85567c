"""How the processes report that they live: a worker's `Heartbeat` (its state, load and
counters, on its PUB socket beside its frames) and the supervisor's events about each worker
(`WorkerStatus`, `WorkerExited`) to the gateway. Tagged msgspec Structs, as the message
catalogue (protocol/messages.py), whose worker decoder reads heartbeats too.
"""

from __future__ import annotations

import msgspec

from npu_proxy.protocol.states import ProcessState

# --- worker -> gateway, supervisor (with the worker's frames) ---------------------------


class Heartbeat(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    worker: str
    pid: int
    role: str
    device: str
    model: str
    state: ProcessState
    queue: int = 0
    in_flight: int = 0
    served: int = 0
    generated_tokens: int = 0
    load_seconds: float = 0.0
    cache_hits: int = 0
    cache_misses: int = 0
    error: str = ""
    sent_at: float = 0.0
    # Seconds since the engine last made progress while it had work (0 when idle): a
    # worker stuck in native code mid-generation still heartbeats, but this grows.
    stalled_for: float = 0.0
    # The engine thread steps a pipeline call that holds the GIL, so the next heartbeat may
    # wait for a whole step: silence counts against stall_timeout, not heartbeat_timeout
    # (protocol/states.py silence_allowed).
    blocking: bool = False
    # Embedding pipeline calls so far by their size class (EMBED_BATCH_CLASSES): how many
    # requests' texts the worker batched together.
    embed_batches: list[int] | None = None
    # The process replaces one that crashed (its supervisor's WorkerStatus.recovering, passed
    # as `--recovering`): what tells another host's gateway a first load, which its requests
    # wait for, from a crash's restart, which they get a 503 for (WorkerLink.first_load).
    recovering: bool = False


# Upper bounds of the size classes (texts per pipeline call) of Heartbeat.embed_batches.
EMBED_BATCH_CLASSES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def embed_batch_class(texts: int) -> int:
    """The index in EMBED_BATCH_CLASSES of a call of this many texts (the last: all above)."""
    for i, bound in enumerate(EMBED_BATCH_CLASSES):
        if texts <= bound:
            return i
    return len(EMBED_BATCH_CLASSES) - 1


def embed_batch_label(index: int) -> str:
    """A size class as a label: "1", "2", "3-4", ... "257-512"."""
    high = EMBED_BATCH_CLASSES[index]
    low = EMBED_BATCH_CLASSES[index - 1] + 1 if index else 1
    return str(high) if low == high else f"{low}-{high}"


# --- supervisor -> gateway (events socket) -----------------------------------------------


class WorkerExited(msgspec.Struct, tag=True, array_like=True):
    """Sent the moment the supervisor reaps a worker, faster than any heartbeat timeout."""

    worker: str
    pid: int
    returncode: int
    # The supervisor ended it (an operator's stop or restart, an unload, a shutdown): no
    # crash, so no request in flight is to blame (gateway/core/broker.py).
    expected: bool = False


class WorkerStatus(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    """The supervisor's state of a worker (protocol/states.py) and why, sent on every change
    and once a second, so a gateway (also a restarted one) knows it."""

    worker: str
    state: ProcessState
    pid: int = 0
    restarts: int = 0
    last_error: str = ""
    # Its process replaces one that crashed (the supervisor recovers it), not a first start
    # nor a restart it was told to do: the gateway does not wait for such a load.
    recovering: bool = False


SupervisorEvent = WorkerExited | WorkerStatus


def event_decoder() -> msgspec.msgpack.Decoder[SupervisorEvent]:
    return msgspec.msgpack.Decoder(SupervisorEvent)
