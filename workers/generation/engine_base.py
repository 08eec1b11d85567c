"""`EngineBase`: what the generating engines (workers/batch_engine.py, serial_engine.py,
vlm_engine.py) share: the inbox, admission (the requests a worker has taken and their bounded
wait queue), each request checked and given its GenerationConfig, and an `Active` request's
tokens turned into frames. The prompt's checks are in prompt_fit.py, the request's record in
active.py, the test fault hooks in workers/faults.py.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import openvino_genai as ov_genai

from npu_proxy.protocol.config import WorkerSpec
from npu_proxy.protocol.messages import (
    Abort,
    Accepted,
    Delta,
    Detokenize,
    Detokenized,
    ErrorCode,
    Failed,
    Generate,
    TokenCount,
    Tokenize,
    TokenLogprob,
)
from npu_proxy.workers.engine import Emit
from npu_proxy.workers.faults import FaultInjector
from npu_proxy.workers.generation import prompt_fit
from npu_proxy.workers.generation.active import Active, TokenizedRequest
from npu_proxy.workers.generation.prompting import Prompting
from npu_proxy.workers.generation.sampling import generation_config

log = logging.getLogger(__name__)

# What a generating engine is sent.
Request = Generate | Abort | Tokenize | Detokenize


class EngineBase:
    """What the generating engines share: the inbox, admission, prompt checks, frame emission.

    Admission: every Generate and Tokenize the worker takes holds a slot (`_held`, by request
    id) from submit() until its last frame; a worker holds at most max_running + max_queue.
    A request that passed the checks is accepted and waits in `_queue` until the engine starts
    it (`_step`): at most max_running run at once, the rest wait in that queue.

    A subclass loads its pipeline (`load`, `warm_up`) and does one round of work in `_step`;
    `run` calls `_step` on the engine thread until told to stop.
    """

    # Does the pipeline give each token's log-probability (SamplingParams.logprobs), and
    # every prompt token's (SamplingParams.prompt_logprobs)?
    gives_logprobs = True
    gives_prompt_logprobs = False

    def __init__(self, spec: WorkerSpec, model_path: str, context_length: int, emit: Emit) -> None:
        self.spec = spec
        self.model_path = model_path
        self.context_length = context_length
        self.emit = emit
        self.faults = FaultInjector(spec)
        self._inbox: queue.Queue[Request] = queue.Queue()  # NOTE: see InboxEngine's
        self._wake = threading.Event()
        self._active: dict[str, Active] = {}
        # NOTE: ids, not a count: a request ends on one of several threads and paths (finish,
        # refusal, abort while queued, drain), and releasing an id twice is harmless where
        # decrementing a count twice would leak room.
        self._held: set[str] = set()
        self._held_lock = threading.Lock()
        # Accepted requests waiting for their turn; _lock also covers moving one from here
        # into _active, so an abort finds it in one of the two.
        self._queue: collections.deque[TokenizedRequest] = collections.deque()
        self._lock = threading.Lock()
        self.generated_tokens = 0
        self.served = 0
        self.pipe: Any = None
        self.prompting: Prompting | None = None
        self.base_config: Any = None
        # A chat template configured for the model ([models."name"] chat_template), or "".
        self.chat_template = ""
        self.progress_at = time.monotonic()
        self.announce: Callable[[], None] = lambda: None

    @property
    def blocking(self) -> bool:
        return False

    # --- admission -----------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return self.spec.max_running + self.spec.max_queue

    def has_room(self) -> bool:
        return len(self._held) < self.capacity

    def _take(self, msg: Request) -> None:
        if not isinstance(msg, Abort):
            with self._held_lock:
                self._held.add(msg.id)

    def _release(self, rid: str) -> None:
        """The request's slot is free again: called before its last frame is emitted, so a
        client that sends its next request on seeing that frame finds the room."""
        with self._held_lock:
            self._held.discard(rid)

    def _refuse(self, failed: Failed) -> None:
        self._release(failed.id)
        self.emit(failed)

    def submit(self, msg: Request) -> None:
        self._take(msg)
        self._inbox.put(msg)
        self._wake.set()

    @property
    def queue_depth(self) -> int:
        """Requests taken but not generating: in the inbox, being checked, or waiting."""
        return max(0, len(self._held) - len(self._active))

    @property
    def in_flight(self) -> int:
        return len(self._active)

    def prompt_limit(self) -> tuple[int, bool]:
        """The longest prompt this worker takes, and whether another worker may take more."""
        return self.context_length - 1, False

    def room(self, prompt_tokens: int) -> int:
        return self.context_length - prompt_tokens

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            began = self.progress_at = time.monotonic()
            if not self._step():
                self._wake.wait(0.05)
                self._wake.clear()
            elif time.monotonic() - began > 1.0:
                # NOTE: the heartbeat thread, which waited for the GIL the whole step, takes
                # it as soon as the step returns, before the line after it: its stalled_for
                # then counts the step just done as time without progress, and the next long
                # step was killed at busy_limit minus this one (two 90 s steps of an agent's
                # prefill on a loaded machine). This heartbeat says the step ended.
                self.progress_at = time.monotonic()
                self.announce()

    def _step(self) -> bool:
        """One round of work on the engine thread; False when there was none to do."""
        raise NotImplementedError

    def _admit(self, ready: TokenizedRequest) -> None:
        """Accept a request that passed the checks; it waits in the queue for its turn."""
        with self._lock:
            self._queue.append(ready)
        self._accept(ready)
        self._wake.set()

    def _next(self) -> tuple[TokenizedRequest, Active | None] | None:
        """The oldest waiting request, tracked as active (None: none waits). A request whose
        deadline passed while it waited ends here with reason timeout (Active None) instead
        of paying for a prompt nobody waits for."""
        with self._lock:
            if not self._queue:
                return None
            ready = self._queue.popleft()
            active = self._track(ready, None)
        if time.time() > ready.req.deadline:
            active.cancelled = "timeout"
            self._active.pop(ready.req.id, None)
            self._finish(active)
            return ready, None
        self.faults.hold_start(ready.req.log_id or ready.req.id)
        return ready, active

    def _dispatch(self, msg: Request) -> None:
        """Act on one message from the gateway."""
        if isinstance(msg, Abort):
            self._abort(msg.id)
        elif isinstance(msg, Tokenize):
            self._tokenize(msg)
        elif isinstance(msg, Detokenize):
            self._detokenize(msg)
        else:
            self.faults.hold_accept()
            ready = self._prepare(msg)
            if ready is not None:
                self._admit(ready)

    def abort_all(self, reason: str) -> None:
        for active in list(self._active.values()):
            active.cancel(reason)
        with self._lock:
            queued = list(self._queue)
            self._queue.clear()
        for ready in queued:
            self._refuse(Failed(id=ready.req.id, seq=1, code=ErrorCode.NOT_READY,
                                message=f"worker {self.spec.name} is stopping",
                                retry_elsewhere=True))

    def _abort(self, rid: str) -> bool:
        """Stop a request that is generating or waiting; False when it is neither."""
        # NOTE: under the lock that _next holds from dequeue to tracking, so an abort that
        # arrives in between finds the request in one of the two, never in neither.
        with self._lock:
            active = self._active.get(rid)
            if active is not None:
                shown = active.req.log_id or rid
                log.info("abort request_id=%s after %d tokens", shown, active.completion_tokens,
                         extra={"request_id": shown})
                active.cancel("abort")
                return True
            queued = [ready for ready in self._queue if ready.req.id == rid]
            for ready in queued:
                self._queue.remove(ready)
        if queued:
            # NOTE: the gateway closed the stream when it sent the abort: no frame is due.
            self._release(rid)
            shown = queued[0].req.log_id or rid
            log.info("abort request_id=%s while queued", shown, extra={"request_id": shown})
        return bool(queued)

    def _tokenize(self, msg: Tokenize) -> None:
        assert self.prompting is not None
        self._answer(msg.id, prompt_fit.token_count(self.prompting, msg))

    def _detokenize(self, msg: Detokenize) -> None:
        assert self.prompting is not None
        self._answer(msg.id, prompt_fit.detokenized(self.prompting, msg))

    def _answer(self, rid: str, reply: TokenCount | Detokenized | Failed) -> None:
        """A request's one and only frame."""
        if isinstance(reply, Failed):
            self._refuse(reply)
            return
        self._release(rid)
        self.emit(reply)

    def _prepare(self, req: Generate) -> TokenizedRequest | None:
        """Template, tokenize and check one request (fitting its history to the context
        when it asks to be truncated); emits Failed and returns None if it cannot run here."""
        assert self.prompting is not None
        received = time.time()
        if received > req.deadline:
            self._refuse(Failed(id=req.id, seq=0, code=ErrorCode.DEADLINE_EXCEEDED,
                                message="request expired before it started",
                                retry_elsewhere=True))
            return None
        if req.params.logprobs and not self.gives_logprobs:
            self._refuse(Failed(id=req.id, seq=0, code=ErrorCode.UNSUPPORTED,
                                message=f"worker {self.spec.name} gives no logprobs",
                                retry_elsewhere=True))
            return None
        if req.params.prompt_logprobs and not self.gives_prompt_logprobs and not req.resume:
            self._refuse(Failed(
                id=req.id, seq=0, code=ErrorCode.UNSUPPORTED, retry_elsewhere=True,
                message=f"worker {self.spec.name} gives no prompt log-probabilities: "
                "they need an llm worker that reads every prompt whole (prefix_caching = "
                "false or deterministic = true in its settings)"))
            return None
        limit, elsewhere = self.prompt_limit()
        context = prompt_fit.context_for(req, self.context_length)
        limit = min(limit, context - 1)
        try:
            fitted = prompt_fit.fit(self.prompting, req, limit, context, elsewhere)
        except Exception as exc:  # a template or tokenizer error is the request's fault
            self._refuse(Failed(id=req.id, seq=0, code=ErrorCode.BAD_REQUEST, message=str(exc)))
            return None
        if isinstance(fitted, Failed):
            self._refuse(fitted)
            return None
        req, ids, dropped = fitted
        params = req.params
        if req.resume:
            # NOTE: the client has the prompt's logprobs from the first run.
            params = msgspec.structs.replace(params, prompt_logprobs=False)
            ids, params = prompt_fit.resumed(ids, req.resume, params, limit)
            if ids is None:
                self._refuse(Failed(id=req.id, seq=0, code=ErrorCode.PROMPT_TOO_LONG,
                                    message="the prompt and the tokens generated before the "
                                    "worker died no longer fit the context"))
                return None
        n = int(ids.shape[1])
        if self.spec.min_prefill_rate > 0:  # reading the prompt gets time of its own
            req = msgspec.structs.replace(
                req, deadline=req.deadline + n / self.spec.min_prefill_rate)
        forced = self.spec.faults.force_regex
        if forced and params.json_schema is None and params.regex is None:
            log.warning("fault hook: request_id=%s constrained to %r", req.log_id, forced)
            params = msgspec.structs.replace(params, regex=forced)
        try:
            cfg = generation_config(params, self.base_config, min(self.room(n), context - n))
        except Exception as exc:
            self._refuse(Failed(id=req.id, seq=0, code=ErrorCode.BAD_REQUEST, message=str(exc)))
            return None
        return TokenizedRequest(req=req, ids=ids, config=cfg, received=received, context=context,
                                dropped=dropped, resumed=len(req.resume))

    def _accept(self, ready: TokenizedRequest) -> None:
        """Tell the gateway the request will run here, before its first token."""
        self.emit(Accepted(id=ready.req.id, seq=0, worker=self.spec.name,
                           device=self.spec.device, prompt_tokens=ready.prompt_tokens,
                           context=ready.context, dropped=ready.dropped,
                           deadline=ready.req.deadline))

    def _track(self, ready: TokenizedRequest, handle: Any) -> Active:
        assert self.prompting is not None
        active = Active(req=ready.req, handle=handle,
                        streamer=self.prompting.detokenizer(),
                        prompt_tokens=ready.prompt_tokens, received=ready.received,
                        added=time.time(),
                        logprobs=[] if ready.req.params.logprobs else None)
        if ready.resumed:
            active.resume(ready.req.resume)
        elif ready.req.params.prompt_logprobs:
            active.echo = ready.prompt_tokens
            active.prompt_streamer = self.prompting.detokenizer()
        self._active[ready.req.id] = active
        return active

    def _on_tokens(self, active: Active, ids: list[int], now: float,
                   logprobs: list[float] | None = None) -> None:
        """Take new tokens; `logprobs` (one per token) when the request asked for them."""
        assert self.prompting is not None
        self.progress_at = time.monotonic()
        self.generated_tokens += len(ids)
        active.take(ids, now, logprobs, self.prompting.token_bytes)
        self.faults.on_tokens(len(ids), active.req.log_id)

    def _on_prompt(self, active: Active, ids: list[int],
                   logprobs: list[float]) -> tuple[list[int], list[float]]:
        """Take the echoed prompt's tokens at the start of `ids`, sent in a frame of their
        own once all have come; the generated tokens after them are returned."""
        assert self.prompting is not None
        ids, logprobs = active.take_prompt(ids, logprobs, self.prompting.token_bytes)
        if not active.echo:
            self.emit(Delta(id=active.req.id, seq=active.seq, text="", tokens=0,
                            ids=active.prompt_ids, prompt=active.prompt))
            active.seq += 1
            active.prompt, active.prompt_ids = [], []
        return ids, logprobs

    def _flush(self, active: Active) -> None:
        """Send what of the request's text (and logprobs) is ready."""
        pending = active.pending()
        if pending is not None:
            self._emit_delta(active, *pending)

    def _emit_delta(self, active: Active, text: str, tokens: int,
                    logprobs: list[TokenLogprob] | None, ids: list[int]) -> None:
        if self.faults.gap_due(active.req.id, active.completion_tokens):
            active.seq += 1
        self.emit(Delta(id=active.req.id, seq=active.seq, text=text, tokens=tokens,
                        logprobs=logprobs, ids=ids))
        active.seq += 1

    def _finish(self, active: Active) -> None:
        active.close()
        self._flush(active)
        finished = active.finished()
        self.served += 1
        self._release(active.req.id)
        shown = active.req.log_id or active.req.id
        log.info("finished request_id=%s reason=%s prompt_tokens=%d completion_tokens=%d",
                 shown, finished.finish_reason, active.prompt_tokens, active.completion_tokens,
                 extra={"request_id": shown})
        self.emit(finished)


class TokenStreamer(ov_genai.StreamerBase):  # type: ignore[misc]
    """Token ids from a pipeline's generate() into an engine (the one-request-at-a-time paths:
    LLMPipeline on the npu role, VLMPipeline on a vlm worker's NPU)."""

    def __init__(self, engine: EngineBase, active: Active) -> None:
        super().__init__()
        self.engine = engine
        self.active = active

    def write(self, token: Any) -> ov_genai.StreamingStatus:
        ids = [int(token)] if isinstance(token, int) else [int(t) for t in token]
        active = self.active
        self.engine._on_tokens(active, ids, time.time())
        self.engine._flush(active)
        active.cancel_if_late(time.time())
        if active.cancelled:
            return ov_genai.StreamingStatus.CANCEL
        return ov_genai.StreamingStatus.RUNNING

    def end(self) -> None:
        pass
