"""What every engine is, and what the two LLM engines share.

An engine holds one OpenVINO GenAI pipeline and the logic around it; the worker process
(workers/process.py) wraps it with sockets, threads and signals, as `Engine` describes. The
engines, one module each:
- workers/batch_engine.py `BatchEngine`: role `llm` (GPU/CPU), a ContinuousBatchingPipeline
  stepped by one engine thread, many requests at once;
- workers/serial_engine.py `SerialEngine`: role `npu`, a stateful LLMPipeline with the NPU's
  fixed prompt limit, one request at a time;
- workers/embed_engine.py `EmbedEngine`: role `embed`, a TextEmbeddingPipeline.

The LLM engines derive from `EngineBase` here: the inbox, admission (the requests a worker has
taken and their bounded wait queue), the prompt checks (`Prompting`), the test fault hooks
(`FaultInjector`), and turning an `Active` request's tokens into frames.
"""

from __future__ import annotations

import collections
import ctypes
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import msgspec
import numpy as np
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
    Finished,
    Generate,
    RequestFrame,
    Timings,
    TokenCount,
    Tokenize,
    TokenLogprob,
)
from npu_proxy.workers.detok import ByteDetokenizer, Detokenizer, TokenBytes, byte_pieces
from npu_proxy.workers.sampling import generation_config, reply_reserve, trim_history

log = logging.getLogger(__name__)

# How an engine publishes a frame (the worker process's PUB socket, or a list in tests).
Emit = Callable[[RequestFrame], None]
# What an LLM engine is sent.
Request = Generate | Abort | Tokenize | Detokenize


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


@dataclass
class TokenizedRequest:
    """A request that passed the checks, tokenized, with its generation config."""

    req: Generate
    ids: np.ndarray[Any, Any]
    config: Any  # ov_genai.GenerationConfig
    received: float
    context: int = 0  # the context it runs in (Accepted.context)
    dropped: int = 0  # messages dropped to fit it (Accepted.dropped)

    @property
    def prompt_tokens(self) -> int:
        return int(self.ids.shape[1])


@dataclass
class Active:
    """One request being generated: its pipeline handle, text not yet sent, and counters."""

    req: Generate
    # The ContinuousBatchingPipeline's GenerationHandle; None in the serial engine, whose
    # streamer callback stops a cancelled request on its next token.
    handle: Any
    streamer: ByteDetokenizer | Detokenizer
    prompt_tokens: int
    received: float
    added: float
    seq: int = 1
    completion_tokens: int = 0
    first: float = 0.0
    text: list[str] = field(default_factory=list)
    finish_reason: str = "stop"
    # Why it was stopped early ("abort", "timeout"); "" while it runs to its end.
    cancelled: str = ""
    # Tokens not sent yet with their logprobs, when the request asked (else None); the last
    # ones wait while their character is incomplete.
    logprobs: list[TokenLogprob] | None = None

    def cancel(self, reason: str) -> None:
        self.cancelled = reason
        if self.handle is not None:
            self.handle.cancel()

    def cancel_if_late(self, now: float) -> None:
        if not self.cancelled and now > self.req.deadline:
            self.cancel("timeout")


# NOTE: the most characters one token may stand for when the vocabulary cannot be read; no
# tokenizer in use comes near it (SmolLM2's longest entry is 81 bytes).
FALLBACK_TOKEN_CHARS = 256


def longest_token(tokenizer: ov_genai.Tokenizer) -> int:
    """The most characters one token of this vocabulary stands for: its longest entry's length
    in bytes (a UTF-8 character takes at least one), or FALLBACK_TOKEN_CHARS."""
    try:
        vocab = tokenizer.get_vocab()
        return max(len(entry) for entry in vocab) or FALLBACK_TOKEN_CHARS
    except Exception as exc:  # NOTE: only makes the check on characters looser
        log.info("vocabulary not readable (%s); assuming a token is at most %d characters",
                 exc, FALLBACK_TOKEN_CHARS)
        return FALLBACK_TOKEN_CHARS


class Prompting:
    """Chat template and tokenizer of one model: the exact token counts used for routing."""

    def __init__(self, tokenizer: ov_genai.Tokenizer, context_length: int,
                 chat_template: str = "") -> None:
        self.tokenizer = tokenizer
        if chat_template:  # the configured one, in place of the model's own
            tokenizer.set_chat_template(chat_template)
        self.context_length = context_length
        self.token_chars = longest_token(tokenizer)
        # Each token's bytes, where joining them is exactly the tokenizer's decode.
        self.pieces = byte_pieces(tokenizer)
        self.token_bytes = TokenBytes(tokenizer, self.pieces)

    def detokenizer(self) -> ByteDetokenizer | Detokenizer:
        """A new request's incremental detokenizer."""
        if self.pieces is not None:
            return ByteDetokenizer(self.pieces)
        return Detokenizer(self.tokenizer)

    def render(self, msg: Generate | Tokenize) -> str:
        if msg.messages is None:
            return msg.prompt or ""
        history = [msgspec.to_builtins(m) for m in msg.messages]
        opening = msg.add_generation_prompt if isinstance(msg, Tokenize) else True
        return str(self.tokenizer.apply_chat_template(
            history, add_generation_prompt=opening, tools=msg.tools or None,
            extra_context=msg.template_vars or None))

    def encode(self, text: str, add_special_tokens: bool = False) -> np.ndarray[Any, Any]:
        # NOTE: the chat template already places the special tokens.
        ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens).input_ids.data
        return np.asarray(ids, dtype=np.int64).reshape(1, -1)

    def decode(self, tokens: list[int]) -> str:
        """Token ids back to text, special tokens included; a 400 for an id out of range."""
        size = self.token_bytes.vocab_size
        bad = next((t for t in tokens if not 0 <= t < size), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is not in the vocabulary (0 to {size - 1})")
        return str(self.tokenizer.decode(tokens, skip_special_tokens=False)) if tokens else ""

    def count_past_cap(self, text: str, capped: int) -> int:
        """The token count of a text whose encoding stopped at the tokenizer's cap.

        NOTE: the tokenizers converted from GGUF end in a Minimum with the model's context
        (8192 for SmolLM2), whatever max_length or truncation encode() gets, so a longer
        prompt counts as the cap. Counted here in pieces that cannot reach the cap (a
        character is at most 4 bytes, so at most 4 tokens) cut at whitespace, where byte-level
        BPE's pre-tokenizer cuts too: exact but for a token at a cut, which is what a client
        told "prompt is too long: N tokens" needs (Claude Code compacts by N).
        """
        size = max(1, self.context_length // 4 - 1)
        total, start = 0, 0
        while start < len(text):
            end = min(len(text), start + size)
            if end < len(text):
                cut = max(text.rfind(" ", start + size // 2, end),
                          text.rfind("\n", start + size // 2, end))
                end = cut if cut > start else end
            total += int(self.encode(text[start:end]).shape[1])
            start = end
        return max(total, capped)

    def fewest_tokens(self, text: str) -> int:
        """A lower bound of the text's token count, from its length alone: no token stands
        for more than `token_chars` characters.

        NOTE: tokenizing holds the GIL, so the worker's heartbeat thread waits for it: 4 MB of
        text took 3 s (one long word) to 6.5 s (CJK) here, for nothing when the prompt cannot
        fit anyway. A text with more than limit * token_chars characters is refused unread.
        (Characters alone bound the count from below only this way round: that every token
        stands for at least one character gives tokens <= characters, no refusal.)
        """
        return -(-len(text) // self.token_chars)


def _hold(gate: str) -> None:
    while gate and not Path(gate).exists():
        time.sleep(0.05)


class FaultInjector:
    """Test hooks, switched on explicitly per worker in the configuration."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.faults = spec.faults
        self.tokens = 0
        self._gapped: set[str] = set()
        self._spun = False

    def gap_due(self, rid: str, tokens: int) -> bool:
        """True once per request, when its frames should skip a sequence number."""
        limit = self.faults.gap_after_tokens
        if limit is None or tokens < limit or rid in self._gapped:
            return False
        self._gapped.add(rid)
        log.error("fault hook: skipping a frame of request %s", rid)
        return True

    def hold_accept(self) -> None:
        """Block until the hold_accept_until file exists (when set)."""
        _hold(self.faults.hold_accept_until)

    def hold_start(self, shown: str) -> None:
        """Block until the hold_start_until file exists (when set)."""
        gate = self.faults.hold_start_until
        if gate and not Path(gate).exists():
            log.warning("fault hook: holding request_id=%s before it starts", shown)
            _hold(gate)

    def on_tokens(self, n: int) -> None:
        f = self.faults
        if f.exit_after_tokens is None and f.abort_after_tokens is None and (
            f.stall_after_tokens is None and f.spin_after_tokens is None
            and f.freeze_after_tokens is None
        ):
            return
        self.tokens += n
        if f.spin_after_tokens is not None and self.tokens >= f.spin_after_tokens:
            self._spin_with_gil(f.spin_seconds)
        if f.freeze_after_tokens is not None and self.tokens >= f.freeze_after_tokens:
            log.error("fault hook: holding the GIL for good after %d tokens", self.tokens)
            # NOTE: a foreign call through PyDLL keeps the GIL: no other thread runs again.
            libc = ctypes.PyDLL(None)
            while True:
                libc.pause()
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


    def _spin_with_gil(self, seconds: float) -> None:
        """Busy on this thread for `seconds` with the GIL held throughout, once."""
        if self._spun:
            return
        self._spun = True
        log.error("fault hook: spinning %.1f s with the GIL held", seconds)
        # NOTE: a thread waiting for the GIL asks for it after one switch interval; with the
        # interval longer than the spin, none asks, so no heartbeat leaves, as in step().
        interval = sys.getswitchinterval()
        sys.setswitchinterval(seconds + 60.0)
        try:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                pass
        finally:
            sys.setswitchinterval(interval)


class EngineBase:
    """What both LLM engines share: the inbox, admission, prompt checks, frame emission.

    Admission: every Generate and Tokenize the worker takes holds a slot (`_held`, by request
    id) from submit() until its last frame; a worker holds at most max_running + max_queue.
    A request that passed the checks is accepted and waits in `_queue` until the engine starts
    it (`_step`): at most max_running run at once, the rest wait in that queue.

    A subclass loads its pipeline (`load`, `warm_up`) and does one round of work in `_step`;
    `run` calls `_step` on the engine thread until told to stop.
    """

    # Does the pipeline give each token's log-probability (SamplingParams.logprobs)?
    gives_logprobs = True

    def __init__(self, spec: WorkerSpec, model_path: str, context_length: int, emit: Emit) -> None:
        self.spec = spec
        self.model_path = model_path
        self.context_length = context_length
        self.emit = emit
        self.faults = FaultInjector(spec)
        self._inbox: queue.SimpleQueue[Request] = queue.SimpleQueue()
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
        self.defaults: dict[str, float] = {}
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
            self.progress_at = time.monotonic()
            if not self._step():
                self._wake.wait(0.05)
                self._wake.clear()

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
        try:
            text = self.prompting.render(msg)
            floor = self.prompting.fewest_tokens(text)
            if floor > self.context_length:
                self._refuse(self._too_long(msg.id, text, floor, self.context_length, False))
                return
            ids = self.prompting.encode(text, msg.add_special_tokens)
        except Exception as exc:  # a template or tokenizer error is the request's fault
            self._refuse(Failed(id=msg.id, seq=0, code=ErrorCode.BAD_REQUEST, message=str(exc)))
            return
        count = TokenCount(id=msg.id, seq=0, count=int(ids.shape[1]))
        if msg.want_tokens:
            count.tokens = [int(t) for t in ids[0]]
            entry = self.prompting.token_bytes.entry
            count.pieces = [entry(t).decode("utf-8", "replace") for t in count.tokens]
        self._release(msg.id)
        self.emit(count)

    def _detokenize(self, msg: Detokenize) -> None:
        assert self.prompting is not None
        try:
            text = self.prompting.decode(msg.tokens)
        except Exception as exc:  # an id out of range is the request's fault
            self._refuse(Failed(id=msg.id, seq=0, code=ErrorCode.BAD_REQUEST, message=str(exc)))
            return
        self._release(msg.id)
        self.emit(Detokenized(id=msg.id, seq=0, text=text))

    def _too_long(self, rid: str, text: str, floor: int, limit: int, elsewhere: bool) -> Failed:
        """A prompt refused on its length in characters, without tokenizing it."""
        # NOTE: prompt_tokens stays unset: the prompt was not counted, `floor` is a bound.
        return Failed(id=rid, seq=0, code=ErrorCode.PROMPT_TOO_LONG,
                      message=f"prompt is {len(text)} characters, so at least {floor} tokens; "
                              f"this worker takes at most {limit}",
                      retry_elsewhere=elsewhere, limit=limit, floor=floor)

    def _context(self, req: Generate) -> int:
        """The context this request runs in: the model's, or a smaller num_ctx."""
        asked = req.params.num_ctx
        if asked is None or asked <= 0 or asked == self.context_length:
            return self.context_length
        if asked > self.context_length:
            shown = req.log_id or req.id
            log.info("request_id=%s: num_ctx %d is more than the model's context, %d tokens: "
                     "using %d", shown, asked, self.context_length, self.context_length,
                     extra={"request_id": shown})
            return self.context_length
        return asked

    def _measure(self, req: Generate, limit: int) -> tuple[Any, Failed | None]:
        """The prompt's token ids, or the refusal of a prompt over `limit`."""
        assert self.prompting is not None
        text = self.prompting.render(req)
        floor = self.prompting.fewest_tokens(text)
        if floor > limit:
            return None, self._too_long(req.id, text, floor, limit, False)
        ids = self.prompting.encode(text)
        n = int(ids.shape[1])
        if n >= self.context_length > limit:
            # NOTE: the tokenizer stopped at its cap (count_past_cap).
            n = self.prompting.count_past_cap(text, n)
        if n > limit:
            return ids, Failed(id=req.id, seq=0, code=ErrorCode.PROMPT_TOO_LONG,
                               message=f"prompt is {n} tokens, this worker takes at most {limit}",
                               prompt_tokens=n, limit=limit)
        return ids, None

    def _fit(self, req: Generate, limit: int, context: int,
             elsewhere: bool) -> tuple[Generate, Any, int] | Failed:
        """The request, its prompt's ids and how many messages were dropped to fit the
        context with room for the reply (Generate.truncate); or why it cannot run here."""
        ids, failed = self._measure(req, limit)
        room = context - (limit + 1 if failed is not None else int(ids.shape[1]))
        reserve = reply_reserve(req.params.max_tokens, context)
        # NOTE: where another worker may take a longer prompt (the NPU's), it is sent there
        # whole rather than cut here.
        if req.truncate and req.messages and not elsewhere and room < reserve:
            def count(trial: Generate) -> int | None:
                probe, over = self._measure(trial, limit)
                return None if over is not None else int(probe.shape[1])

            cut, k = trim_history(req, count, context - reserve)
            cut_ids, over = self._measure(cut, limit) if k else (ids, failed)
            if k and over is None:  # NOTE: else as it came, or refused with its whole count
                shown = req.log_id or req.id
                log.info("request_id=%s: dropped the %d oldest of %d messages to fit the "
                         "context of %d tokens", shown, k, len(req.messages), context,
                         extra={"request_id": shown})
                return cut, cut_ids, k
        if failed is not None:
            failed.retry_elsewhere, failed.context = elsewhere, context
            return failed
        return req, ids, 0

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
        limit, elsewhere = self.prompt_limit()
        context = self._context(req)
        limit = min(limit, context - 1)
        try:
            fitted = self._fit(req, limit, context, elsewhere)
        except Exception as exc:  # a template or tokenizer error is the request's fault
            self._refuse(Failed(id=req.id, seq=0, code=ErrorCode.BAD_REQUEST, message=str(exc)))
            return None
        if isinstance(fitted, Failed):
            self._refuse(fitted)
            return None
        req, ids, dropped = fitted
        n = int(ids.shape[1])
        params = req.params
        forced = self.spec.faults.force_regex
        if forced and params.json_schema is None and params.regex is None:
            log.warning("fault hook: request_id=%s constrained to %r", req.log_id, forced)
            params = msgspec.structs.replace(params, regex=forced)
        unset = {k: v for k, v in self.defaults.items() if getattr(params, k, 0) is None}
        if unset:
            params = msgspec.structs.replace(params, **unset)
        try:
            cfg = generation_config(params, self.base_config, min(self.room(n), context - n))
        except Exception as exc:
            self._refuse(Failed(id=req.id, seq=0, code=ErrorCode.BAD_REQUEST, message=str(exc)))
            return None
        return TokenizedRequest(req=req, ids=ids, config=cfg, received=received, context=context,
                        dropped=dropped)

    def _accept(self, ready: TokenizedRequest) -> None:
        """Tell the gateway the request will run here, before its first token."""
        self.emit(Accepted(id=ready.req.id, seq=0, worker=self.spec.name,
                           device=self.spec.device, prompt_tokens=ready.prompt_tokens,
                           context=ready.context, dropped=ready.dropped))

    def _track(self, ready: TokenizedRequest, handle: Any) -> Active:
        assert self.prompting is not None
        active = Active(req=ready.req, handle=handle,
                        streamer=self.prompting.detokenizer(),
                        prompt_tokens=ready.prompt_tokens, received=ready.received,
                        added=time.time(),
                        logprobs=[] if ready.req.params.logprobs else None)
        self._active[ready.req.id] = active
        return active

    def _on_tokens(self, active: Active, ids: list[int], now: float,
                   logprobs: list[float] | None = None) -> None:
        """Take new tokens; `logprobs` (one per token) when the request asked for them."""
        self.progress_at = time.monotonic()
        if not active.first:
            active.first = now
        active.completion_tokens += len(ids)
        self.generated_tokens += len(ids)
        if active.logprobs is None:
            text = active.streamer.push(ids)
            if text:
                active.text.append(text)
        else:
            self._on_logprobs(active, ids, logprobs or [])
        self.faults.on_tokens(len(ids))

    def _on_logprobs(self, active: Active, ids: list[int], logprobs: list[float]) -> None:
        """One token at a time, so that each has its own piece of the text."""
        assert self.prompting is not None and active.logprobs is not None
        if len(logprobs) != len(ids):
            # NOTE: never seen (speculative steps included); a value is never made up, and
            # the engine thread must not raise: the request ends here instead.
            shown = active.req.log_id or active.req.id
            log.error("request_id=%s: %d log-probabilities for %d tokens; stopping it", shown,
                      len(logprobs), len(ids), extra={"request_id": shown})
            active.cancel("abort")
            return
        token_bytes = self.prompting.token_bytes
        for token, logprob in zip(ids, logprobs, strict=True):
            piece = active.streamer.push([token])
            active.logprobs.append(TokenLogprob(text=piece, data=token_bytes(token),
                                                logprob=float(logprob)))

    def _flush(self, active: Active) -> None:
        if active.logprobs is not None:
            self._flush_logprobs(active)
            return
        if active.text:
            chunk = "".join(active.text)
            active.text.clear()
            self._emit_delta(active, chunk, active.completion_tokens, None)

    def _flush_logprobs(self, active: Active) -> None:
        """Send the tokens whose text is out; the ones of an incomplete character wait."""
        assert active.logprobs is not None
        streamer = active.streamer
        waiting = len(streamer.ids) - streamer.released
        ready = len(active.logprobs) - waiting
        if ready <= 0:
            return
        entries, active.logprobs = active.logprobs[:ready], active.logprobs[ready:]
        self._emit_delta(active, "".join(e.text for e in entries),
                         active.completion_tokens - waiting, entries)

    def _emit_delta(self, active: Active, text: str, tokens: int,
                    logprobs: list[TokenLogprob] | None) -> None:
        if self.faults.gap_due(active.req.id, active.completion_tokens):
            active.seq += 1
        self.emit(Delta(id=active.req.id, seq=active.seq, text=text, tokens=tokens,
                        logprobs=logprobs))
        active.seq += 1

    def _finish(self, active: Active) -> None:
        rest = active.streamer.flush()
        if rest and active.logprobs:
            last = active.logprobs[-1]
            active.logprobs[-1] = TokenLogprob(last.text + rest, last.data, last.logprob)
        elif rest:
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
        self._release(active.req.id)
        shown = active.req.log_id or active.req.id
        log.info("finished request_id=%s reason=%s prompt_tokens=%d completion_tokens=%d",
                 shown, reason, active.prompt_tokens, active.completion_tokens,
                 extra={"request_id": shown})
        self.emit(Finished(id=active.req.id, seq=active.seq, finish_reason=reason,
                           prompt_tokens=active.prompt_tokens,
                           completion_tokens=active.completion_tokens, timings=timings))


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
