"""`SerialSpeechEngine`: the speech engines' request bookkeeping, one request at a time.

The asr and tts engines each run one pipeline call after another for one request; what is
around it is the same: a bounded inbox, the ids queued or running (an abort names one of
them, or comes late and is dropped), the cancelled ones, the current request's sequence
numbers, and the run loop that turns a `Cancelled` or an unexpected error into `Failed`.
A subclass loads its model and serves one request (`_serve`).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, TypeVar

from npu_proxy.protocol.config import WorkerSpec
from npu_proxy.protocol.messages import Abort, ErrorCode, Failed
from npu_proxy.protocol.speech import Synthesize, Transcribe
from npu_proxy.workers.engine import Emit, InboxEngine
from npu_proxy.workers.faults import FaultInjector

log = logging.getLogger(__name__)

Req = TypeVar("Req", Transcribe, Synthesize)


class Cancelled(Exception):
    """The current request ends with this code (aborted, past its deadline, bad input)."""

    def __init__(self, code: ErrorCode, message: str, retry_elsewhere: bool = False) -> None:
        super().__init__(message)
        self.code = code
        # Before any frame only: another worker of the model may serve it (UNSUPPORTED).
        self.retry_elsewhere = retry_elsewhere


class SerialSpeechEngine(InboxEngine[Req]):
    """One request at a time from a bounded inbox; the others wait there."""

    # The message this engine serves, what it refuses others with, and what a request is
    # called in its errors ("transcription", "speech").
    serves: type[Req]
    refusal: str
    task: str

    def __init__(self, spec: WorkerSpec, emit: Emit) -> None:
        super().__init__(spec, emit)
        self.faults = FaultInjector(spec)
        self._cancelled: set[str] = set()
        # Ids of the requests queued or running: an abort names one of them, or is late.
        self._pending: set[str] = set()
        self._current = ""
        # The sequence number of the current request's next frame.
        self._seq = 0

    # --- the worker process's side ------------------------------------------------------

    def submit(self, msg: Any) -> None:
        if isinstance(msg, self.serves):
            self._pending.add(msg.id)
            self._inbox.put((time.time(), msg))
        elif isinstance(msg, Abort):
            # NOTE: the gateway also aborts after the last frame; such an id is not kept.
            if msg.id in self._pending:
                self._cancelled.add(msg.id)
        else:
            # NOTE: the gateway routes only what this worker serves here; the rest is answered.
            self.emit(Failed(id=msg.id, seq=0, code=ErrorCode.BAD_REQUEST,
                             message=f"worker {self.spec.name} {self.refusal}"))

    @property
    def blocking(self) -> bool:
        # NOTE: one pipeline call (a Whisper window, a sentence's inference) may hold the GIL
        # for its length; silence while busy then counts against stall_timeout, not
        # heartbeat_timeout.
        return bool(self._busy)

    def abort_all(self, reason: str) -> None:
        if self._current:
            self._cancelled.add(self._current)

    def run(self, stop: threading.Event) -> None:
        for arrived, req in self._arrivals(stop):
            if req.id in self._cancelled:
                self._cancelled.discard(req.id)
                self._pending.discard(req.id)
                continue
            self._busy, self._current, self._seq = 1, req.id, 0
            self.announce()
            try:
                self._serve(arrived, req)
            except Cancelled as exc:
                first = self._seq == 0
                self.emit(Failed(id=req.id, seq=self._next(), code=exc.code, message=str(exc),
                                 retry_elsewhere=exc.retry_elsewhere and first))
            except Exception as exc:
                log.exception("%s %s failed", self.task, req.log_id or req.id)
                self.emit(Failed(id=req.id, seq=self._next(), code=ErrorCode.INTERNAL,
                                 message=f"{self.task} failed: {exc}"))
            finally:
                self._busy, self._current = 0, ""
                self._pending.discard(req.id)
                self._cancelled.discard(req.id)

    # --- one request ---------------------------------------------------------------------

    def _serve(self, arrived: float, req: Req) -> None:
        """Answer one request (on the engine thread); `arrived` is when submit() took it."""
        raise NotImplementedError

    def _next(self) -> int:
        """The current request's next sequence number (its frames count from 0)."""
        self._seq += 1
        return self._seq - 1

    def _check(self, req: Req) -> None:
        """Stop here if the request was aborted or ran past its deadline."""
        if req.id in self._cancelled:
            raise Cancelled(ErrorCode.ABORTED, "aborted")
        if time.time() > req.deadline:
            raise Cancelled(ErrorCode.DEADLINE_EXCEEDED,
                            f"the {self.task} ran past its deadline")
