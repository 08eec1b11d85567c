"""LLM engines: one OpenVINO GenAI pipeline each, driven from a single engine thread.

`BatchEngine` (role `llm`, GPU/CPU) runs a ContinuousBatchingPipeline: its generate() refuses
concurrent callers, so the engine thread loops `step()` while requests arrive through
`add_request()` and their handles are read for new tokens after every step.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np
import openvino as ov
import openvino_genai as ov_genai

from protocol.config import WorkerSpec
from protocol.messages import (
    Abort,
    Accepted,
    Delta,
    ErrorCode,
    Failed,
    Finished,
    Generate,
    RequestFrame,
    Timings,
    TokenCount,
    Tokenize,
)
from workers.detok import Detokenizer
from workers.sampling import generation_config

log = logging.getLogger(__name__)

Emit = Callable[[RequestFrame], None]

_DONE = (
    ov_genai.GenerationStatus.FINISHED,
    ov_genai.GenerationStatus.CANCEL,
    ov_genai.GenerationStatus.STOP,
    ov_genai.GenerationStatus.IGNORED,
)


@dataclass
class _Active:
    req: Generate
    handle: Any
    streamer: Detokenizer
    prompt_tokens: int
    received: float
    added: float
    seq: int = 1
    completion_tokens: int = 0
    first: float = 0.0
    text: list[str] = field(default_factory=list)
    finish_reason: str = "stop"
    cancelled: str = ""


class Prompting:
    """Chat template and tokenizer of one model: the exact token counts used for routing."""

    def __init__(self, tokenizer: ov_genai.Tokenizer, context_length: int) -> None:
        self.tokenizer = tokenizer
        self.context_length = context_length

    def render(self, msg: Generate | Tokenize) -> str:
        if msg.messages is None:
            return msg.prompt or ""
        history = [msgspec.to_builtins(m) for m in msg.messages]
        if msg.tools:
            return str(
                self.tokenizer.apply_chat_template(
                    history, add_generation_prompt=True, tools=msg.tools
                )
            )
        return str(self.tokenizer.apply_chat_template(history, add_generation_prompt=True))

    def encode(self, text: str) -> np.ndarray[Any, Any]:
        # NOTE: the chat template already places the special tokens.
        ids = self.tokenizer.encode(text, add_special_tokens=False).input_ids.data
        return np.asarray(ids, dtype=np.int64).reshape(1, -1)


class FaultInjector:
    """Test hooks, switched on explicitly per worker in the configuration."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.faults = spec.faults
        self.tokens = 0

    def on_tokens(self, n: int) -> None:
        f = self.faults
        if f.exit_after_tokens is None and f.abort_after_tokens is None and (
            f.stall_after_tokens is None
        ):
            return
        self.tokens += n
        if f.exit_after_tokens is not None and self.tokens >= f.exit_after_tokens:
            log.error("fault hook: exiting after %d tokens", self.tokens)
            os._exit(3)
        if f.abort_after_tokens is not None and self.tokens >= f.abort_after_tokens:
            log.error("fault hook: aborting after %d tokens", self.tokens)
            os.abort()
        if f.stall_after_tokens is not None and self.tokens >= f.stall_after_tokens:
            log.error("fault hook: stalling after %d tokens", self.tokens)
            while True:
                time.sleep(3600)


class EngineBase:
    """What both LLM engines share: the inbox, prompt checks, frame emission, counters."""

    def __init__(self, spec: WorkerSpec, model_path: str, context_length: int, emit: Emit) -> None:
        self.spec = spec
        self.model_path = model_path
        self.context_length = context_length
        self.emit = emit
        self.faults = FaultInjector(spec)
        self._inbox: queue.SimpleQueue[Generate | Abort | Tokenize] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._active: dict[str, _Active] = {}
        self.generated_tokens = 0
        self.served = 0
        self.pipe: Any = None
        self.prompting: Prompting | None = None
        self.base_config: Any = None
        self.defaults: dict[str, float] = {}
        self.progress_at = time.monotonic()

    def submit(self, msg: Generate | Abort | Tokenize) -> None:
        self._inbox.put(msg)
        self._wake.set()

    @property
    def queue_depth(self) -> int:
        return self._inbox.qsize()

    @property
    def in_flight(self) -> int:
        return len(self._active)

    def prompt_limit(self) -> tuple[int, bool]:
        """The longest prompt this worker takes, and whether another worker may take more."""
        return self.context_length - 1, False

    def _tokenize(self, msg: Tokenize) -> None:
        assert self.prompting is not None
        n = int(self.prompting.encode(self.prompting.render(msg)).shape[1])
        self.emit(TokenCount(id=msg.id, seq=0, count=n))

    def _prepare(self, req: Generate) -> tuple[np.ndarray[Any, Any], Any] | None:
        """Template, tokenize and check one request; emits Failed and returns None if it
        cannot run here."""
        assert self.prompting is not None
        if time.time() > req.deadline:
            self.emit(Failed(id=req.id, seq=0, code=ErrorCode.DEADLINE_EXCEEDED,
                             message="request expired before it started", retry_elsewhere=True))
            return None
        try:
            ids = self.prompting.encode(self.prompting.render(req))
        except Exception as exc:  # a template or tokenizer error is the request's fault
            self.emit(Failed(id=req.id, seq=0, code=ErrorCode.BAD_REQUEST, message=str(exc)))
            return None
        n = int(ids.shape[1])
        limit, elsewhere = self.prompt_limit()
        if n > limit:
            self.emit(Failed(id=req.id, seq=0, code=ErrorCode.PROMPT_TOO_LONG,
                             message=f"prompt is {n} tokens, this worker takes at most {limit}",
                             retry_elsewhere=elsewhere, prompt_tokens=n, limit=limit))
            return None
        params = req.params
        unset = {k: v for k, v in self.defaults.items() if getattr(params, k, 0) is None}
        if unset:
            params = msgspec.structs.replace(params, **unset)
        try:
            cfg = generation_config(params, self.base_config, self.room(n))
        except Exception as exc:
            self.emit(Failed(id=req.id, seq=0, code=ErrorCode.BAD_REQUEST, message=str(exc)))
            return None
        return ids, cfg

    def room(self, prompt_tokens: int) -> int:
        return self.context_length - prompt_tokens

    def _track(self, req: Generate, handle: Any, prompt_tokens: int,
               received: float) -> _Active:
        assert self.prompting is not None
        active = _Active(req=req, handle=handle,
                         streamer=Detokenizer(self.prompting.tokenizer),
                         prompt_tokens=prompt_tokens, received=received, added=time.time())
        self._active[req.id] = active
        return active

    def _on_tokens(self, active: _Active, ids: list[int], now: float) -> None:
        self.progress_at = time.monotonic()
        if not active.first:
            active.first = now
        active.completion_tokens += len(ids)
        self.generated_tokens += len(ids)
        text = active.streamer.push(ids)
        if text:
            active.text.append(text)
        self.faults.on_tokens(len(ids))

    def _flush(self, active: _Active) -> None:
        if active.text:
            chunk = "".join(active.text)
            active.text.clear()
            self.emit(Delta(id=active.req.id, seq=active.seq, text=chunk,
                            tokens=active.completion_tokens))
            active.seq += 1

    def _finish(self, active: _Active) -> None:
        rest = active.streamer.flush()
        if rest:
            active.text.append(rest)
        self._flush(active)
        end = time.time()
        first = active.first or end
        reason = active.cancelled or active.finish_reason
        timings = Timings(
            queue_ns=int((active.added - active.received) * 1e9),
            prompt_ns=int((first - active.added) * 1e9),
            decode_ns=int((end - first) * 1e9),
            total_ns=int((end - active.received) * 1e9),
        )
        self.served += 1
        log.info("finished request_id=%s reason=%s prompt_tokens=%d completion_tokens=%d",
                 active.req.id, reason, active.prompt_tokens, active.completion_tokens,
                 extra={"request_id": active.req.id})
        self.emit(Finished(id=active.req.id, seq=active.seq, finish_reason=reason,
                           prompt_tokens=active.prompt_tokens,
                           completion_tokens=active.completion_tokens, timings=timings))


class BatchEngine(EngineBase):
    """Continuous batching on GPU or CPU: many requests at once, prefix caching on."""

    def __init__(self, spec: WorkerSpec, model_path: str, context_length: int, emit: Emit) -> None:
        super().__init__(spec, model_path, context_length, emit)
        self._next_handle_id = 0

    def load(self, properties: dict[str, Any]) -> None:
        sched = ov_genai.SchedulerConfig()
        sched.enable_prefix_caching = True
        sched.cache_size = max(1, int(self.spec.kv_cache_gb))
        sched.max_num_batched_tokens = max(self.spec.max_batch_tokens, self.context_length)
        self.pipe = ov_genai.ContinuousBatchingPipeline(
            self.model_path, sched, self.spec.device, properties
        )
        self.prompting = Prompting(self.pipe.get_tokenizer(), self.context_length)
        self.base_config = self.pipe.get_config()

    def warm_up(self) -> None:
        """A one-token generation, so the first real request does not pay for compilation."""
        assert self.prompting is not None
        cfg = ov_genai.GenerationConfig()
        cfg.max_new_tokens = 1
        ids = self.prompting.encode("Hello")
        handle = self.pipe.add_request(self._handle_id(), ov.Tensor(ids), cfg)
        while self.pipe.has_non_finished_requests():
            self.pipe.step()
        handle.read_all()

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            self.progress_at = time.monotonic()
            self._drain_inbox()
            if not self._active:
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            self.pipe.step()
            self._collect()

    def abort_all(self, reason: str) -> None:
        for active in self._active.values():
            active.cancelled = reason
            active.handle.cancel()

    def _handle_id(self) -> int:
        self._next_handle_id += 1
        return self._next_handle_id

    def _drain_inbox(self) -> None:
        while True:
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(msg, Abort):
                active = self._active.get(msg.id)
                if active is not None:
                    log.info("abort request_id=%s after %d tokens", msg.id,
                             active.completion_tokens, extra={"request_id": msg.id})
                    active.cancelled = "abort"
                    active.handle.cancel()
            elif isinstance(msg, Tokenize):
                self._tokenize(msg)
            else:
                self._start(msg)

    def _start(self, req: Generate) -> None:
        received = time.time()
        prepared = self._prepare(req)
        if prepared is None:
            return
        ids, cfg = prepared
        try:
            handle = self.pipe.add_request(self._handle_id(), ov.Tensor(ids), cfg)
        except Exception as exc:
            self.emit(Failed(id=req.id, seq=0, code=ErrorCode.BAD_REQUEST, message=str(exc)))
            return
        self._track(req, handle, int(ids.shape[1]), received)
        self.emit(Accepted(id=req.id, seq=0, worker=self.spec.name, device=self.spec.device,
                           prompt_tokens=int(ids.shape[1])))

    def _collect(self) -> None:
        now = time.time()
        done: list[str] = []
        for rid, active in self._active.items():
            handle = active.handle
            status = handle.get_status()
            if handle.can_read():
                for out in handle.read().values():
                    ids = list(out.generated_ids)
                    if ids:
                        self._on_tokens(active, ids, now)
                    if out.finish_reason == ov_genai.GenerationFinishReason.LENGTH:
                        active.finish_reason = "length"
            if status in _DONE:
                done.append(rid)
            elif not active.cancelled and now > active.req.deadline:
                active.cancelled = "timeout"
                handle.cancel()
            self._flush(active)
        for rid in done:
            self._finish(self._active.pop(rid))
