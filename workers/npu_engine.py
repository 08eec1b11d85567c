"""The stateful engine (role `npu`): one LLMPipeline, one request at a time, fixed limits.

An NPU pipeline is compiled for a fixed prompt length (MAX_PROMPT_LEN) plus a minimum
response length (MIN_RESPONSE_LEN) and serves one request at a time. Requests are checked
the moment they arrive (exact token count with the model's tokenizer) so a prompt that is too
long is refused at once with `retry_elsewhere`, even while another request is generating;
accepted ones wait in a bounded queue. The same role runs on CPU in tests, with the same
limits configured, to exercise this code where no NPU exists.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any

import openvino as ov
import openvino_genai as ov_genai

from protocol.config import WorkerSpec
from protocol.messages import Abort, Accepted, ErrorCode, Failed, Generate, Tokenize
from workers.llm_engine import Emit, EngineBase, Prompting, _Active

log = logging.getLogger(__name__)


class _Streamer(ov_genai.StreamerBase):  # type: ignore[misc]
    def __init__(self, engine: SerialEngine, active: _Active) -> None:
        super().__init__()
        self.engine = engine
        self.active = active

    def write(self, token: Any) -> ov_genai.StreamingStatus:
        ids = [int(token)] if isinstance(token, int) else [int(t) for t in token]
        active = self.active
        self.engine._on_tokens(active, ids, time.time())
        self.engine._flush(active)
        if not active.cancelled and time.time() > active.req.deadline:
            active.cancelled = "timeout"
        if active.cancelled:
            return ov_genai.StreamingStatus.CANCEL
        return ov_genai.StreamingStatus.RUNNING

    def end(self) -> None:
        pass


class SerialEngine(EngineBase):
    def __init__(self, spec: WorkerSpec, model_path: str, context_length: int, emit: Emit) -> None:
        super().__init__(spec, model_path, context_length, emit)
        self._lock = threading.Lock()
        self._queue: collections.deque[tuple[Generate, Any, Any, float]] = collections.deque()
        self._current: _Active | None = None

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def in_flight(self) -> int:
        return 1 if self._current is not None else 0

    def prompt_limit(self) -> tuple[int, bool]:
        return self.spec.max_prompt_len, True

    def room(self, prompt_tokens: int) -> int:
        # NOTE: the compiled KV cache holds MAX_PROMPT_LEN + MIN_RESPONSE_LEN tokens.
        return min(self.context_length,
                   self.spec.max_prompt_len + self.spec.min_response_len) - prompt_tokens

    def load(self, properties: dict[str, Any]) -> None:
        props = dict(properties)
        if self.spec.device.upper().startswith("NPU"):
            props["MAX_PROMPT_LEN"] = self.spec.max_prompt_len
            props["MIN_RESPONSE_LEN"] = self.spec.min_response_len
        self.pipe = ov_genai.LLMPipeline(self.model_path, self.spec.device, props)
        self.prompting = Prompting(self.pipe.get_tokenizer(), self.context_length)
        self.base_config = self.pipe.get_generation_config()

    def warm_up(self) -> None:
        cfg = ov_genai.GenerationConfig()
        cfg.max_new_tokens = 1
        self.pipe.generate("Hello", cfg)

    # --- receiver thread -----------------------------------------------------------------

    def submit(self, msg: Generate | Abort | Tokenize) -> None:
        if isinstance(msg, Tokenize):
            self._tokenize(msg)
        elif isinstance(msg, Abort):
            self._abort(msg.id)
        else:
            self._enqueue(msg)

    def _enqueue(self, req: Generate) -> None:
        received = time.time()
        prepared = self._prepare(req)
        if prepared is None:
            return
        ids, cfg = prepared
        # NOTE: the queue bound is checked by the worker process before submit().
        with self._lock:
            self._queue.append((req, ids, cfg, received))
        self.emit(Accepted(id=req.id, seq=0, worker=self.spec.name, device=self.spec.device,
                           prompt_tokens=int(ids.shape[1])))
        self._wake.set()

    def _abort(self, rid: str) -> None:
        current = self._current
        if current is not None and current.req.id == rid:
            log.info("abort request_id=%s after %d tokens", rid, current.completion_tokens,
                     extra={"request_id": rid})
            current.cancelled = "abort"
            return
        with self._lock:
            for item in list(self._queue):
                if item[0].id == rid:
                    self._queue.remove(item)
                    log.info("abort request_id=%s while queued", rid, extra={"request_id": rid})

    # --- engine thread -------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self.progress_at = time.monotonic()
            with self._lock:
                item = self._queue.popleft() if self._queue else None
            if item is None:
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            self._generate(*item)

    def _generate(self, req: Generate, ids: Any, cfg: Any, received: float) -> None:
        active = self._track(req, None, int(ids.shape[1]), received)
        self._current = active
        try:
            self.pipe.generate(ov.Tensor(ids), cfg, _Streamer(self, active))
        except Exception as exc:
            log.exception("generation failed", extra={"request_id": req.id})
            self._active.pop(req.id, None)
            self._current = None
            self.emit(Failed(id=req.id, seq=active.seq, code=ErrorCode.INTERNAL,
                             message=f"generation failed: {exc}"))
            return
        if not active.cancelled and active.completion_tokens >= cfg.max_new_tokens:
            active.finish_reason = "length"
        self._active.pop(req.id, None)
        self._current = None
        self._finish(active)

    def abort_all(self, reason: str) -> None:
        current = self._current
        if current is not None:
            current.cancelled = reason
        with self._lock:
            queued = list(self._queue)
            self._queue.clear()
        for req, *_ in queued:
            self.emit(Failed(id=req.id, seq=1, code=ErrorCode.NOT_READY,
                             message=f"worker {self.spec.name} is stopping", retry_elsewhere=True))
