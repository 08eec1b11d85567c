"""`Generation`: a request a worker accepted, as the gateway sees it: its route (the response
headers), then its Delta frames and the Finished one as one async iterator, with the timing
every API and /metrics read, and the abort sent when it is left before its end. `Frames` is
the same for a request answered by several frames and one last one (speech in and out).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from npu_proxy.gateway.core.broker import Broker
from npu_proxy.gateway.core.errors import GatewayError, from_failed
from npu_proxy.gateway.core.request_stream import RequestStream
from npu_proxy.gateway.core.resume import Diverged, Replay, Resumption
from npu_proxy.protocol.messages import (
    Accepted,
    Delta,
    Embeddings,
    ErrorCode,
    Failed,
    Finished,
    RequestFrame,
    Reranked,
    TokenLogprob,
)
from npu_proxy.protocol.timings import Timings

log = logging.getLogger(__name__)

# Past a request's deadline, how long a worker may still send before it counts as stalled.
STALL_GRACE_S = 5.0


def route_headers(device: str, worker: str, reason: str, tokens: int) -> dict[str, str]:
    """What every inference response says about where it ran and why."""
    return {
        "X-NPU-Proxy-Device": device,
        "X-NPU-Proxy-Worker": worker,
        "X-NPU-Proxy-Route-Reason": reason,
        "X-NPU-Proxy-Token-Count": str(tokens),
    }


@dataclass
class Embedded:
    """An embedding request's one answer, with its route."""

    frame: Embeddings
    headers: dict[str, str]
    # Nanoseconds the request waited in the gateway for a load or a switch (Router._loaded).
    load_wait_ns: int = 0


@dataclass
class Scored:
    """A rerank request's one answer, with its route."""

    frame: Reranked
    headers: dict[str, str]


class GenerationObserver(Protocol):
    """Told each routing decision and what every generation yields (see gateway/core/metrics.py)."""

    def on_route(self, request_id: str, worker: str, reason: str) -> None: ...

    def on_tokens(self, gen: Generation, new: int, gap: float, first: bool) -> None: ...

    def on_done(self, gen: Generation) -> None: ...

    def on_audio(self, worker: str, seconds: float) -> None: ...

    def on_resume(self, gen: Generation) -> None: ...


def _give_up_at(deadline: float, accepted: Accepted) -> float:
    """When a generation's gateway stops waiting: the request's deadline, or the later one
    its worker holds it to (the prompt's reading on top: WorkerSpec.min_prefill_rate), plus
    the grace."""
    return max(deadline, accepted.deadline) + STALL_GRACE_S


class Generation:
    """A request accepted by a worker: its route, then its Delta frames and the Finished one.

    Iterating is the one place every API sees the tokens, so it also keeps the timing:
    `gap` is the time since dispatch for the first tokens, else since the previous ones.
    """

    def __init__(self, broker: Broker, stream: RequestStream, accepted: Accepted,
                 reason: str, started: float | None = None,
                 observers: Sequence[GenerationObserver] = (),
                 deadline: float = float("inf"), load_wait_ns: int = 0,
                 resumption: Resumption | None = None) -> None:
        self.broker = broker
        self.resumption = resumption
        # The ids and text delivered so far, which a resumption continues from.
        self.ids: list[int] = []
        self.text: list[str] = []
        self.replay: Replay | None = None
        # Nanoseconds the request waited in the gateway for a load or a switch before
        # dispatch (Router._loaded): Ollama's load_duration counts it.
        self.load_wait_ns = load_wait_ns
        # NOTE: the worker ends a request at its deadline itself; this later one only
        # catches a worker that stalled (still heartbeating, no longer generating).
        self.give_up_at = _give_up_at(deadline, accepted)
        self.stream = stream
        # The request as the client sent it, which a crash quarantines (a resumed stream's
        # own fingerprint has its resumed tokens).
        self.sent = stream
        self.accepted = accepted
        self.reason = reason
        self.finished: Finished | None = None
        self.started = time.monotonic() if started is None else started
        self.observers = observers
        self.tokens = 0
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        # Every token's logprob so far, when the request asked (Delta.logprobs).
        self.logprobs: list[TokenLogprob] = []
        # The prompt's tokens with their logprobs, when the request asked (Delta.prompt):
        # the first run's, a replay's are not read again.
        self.prompt: list[TokenLogprob] | None = None
        self.prompt_ids: list[int] = []
        # The output's token count at the end of each Delta (to count a part of the output's
        # tokens: a thinking model's reasoning_tokens).
        self.ends: list[int] = []
        # How it went on after each death of its worker ("continued after 40 tokens"): a
        # whole (non-streamed) answer says it in X-NPU-Proxy-Resumed.
        self.resumed: list[str] = []
        self._done = False

    def headers(self) -> dict[str, str]:
        accepted = self.accepted
        headers = route_headers(accepted.device, accepted.worker, self.reason,
                                accepted.prompt_tokens)
        # NOTE: what the request ran in: a num_ctx above the model's is not had, and a
        # truncated history (Ollama's chat, Responses truncation "auto") says how much went.
        if accepted.context:
            headers["X-NPU-Proxy-Context-Length"] = str(accepted.context)
        if accepted.dropped:
            headers["X-NPU-Proxy-Truncated-Messages"] = str(accepted.dropped)
        if self.resumed:
            headers["X-NPU-Proxy-Resumed"] = "; ".join(self.resumed)
        return headers

    @property
    def cut(self) -> bool:
        """It ended at its max_tokens or its deadline, not where the model stopped."""
        return self.finished is not None and self.finished.finish_reason in ("length",
                                                                             "timeout")

    def ready(self) -> bool:
        """The next step of the iteration needs no wait: a frame is there, or the end."""
        return self.finished is not None or self.stream.ready()

    async def __aiter__(self) -> AsyncIterator[Delta]:
        try:
            while True:
                try:
                    frame = await self.stream.next_frame(
                        max(0.0, self.give_up_at - time.time()))
                except TimeoutError:
                    raise GatewayError(
                        504, "timeout", f"worker {self.stream.worker} stopped producing output "
                        "past the request's deadline") from None
                if isinstance(frame, Delta) and frame.prompt is not None:
                    if self.prompt is None:
                        self.prompt, self.prompt_ids = frame.prompt, frame.ids
                    continue
                if isinstance(frame, Delta) and self.replay is not None:
                    try:
                        trimmed = self.replay.take(frame)
                    except Diverged as exc:
                        await self._diverged(exc)
                        continue
                    if trimmed is None:
                        continue
                    frame = trimmed
                if isinstance(frame, Delta):
                    if self.resumption is not None:
                        self.ids += frame.ids
                        self.text.append(frame.text)
                    self._count(frame.tokens)
                    self.ends.append(frame.tokens)
                    if frame.logprobs:
                        self.logprobs.extend(frame.logprobs)
                    yield frame
                elif isinstance(frame, Finished):
                    if self.replay is not None:
                        try:
                            self.replay.check_end(frame)
                        except Diverged as exc:
                            await self._diverged(exc)
                            continue
                    self.finished = frame
                    self._count(frame.completion_tokens)
                    return
                elif isinstance(frame, Failed):
                    if frame.code == ErrorCode.WORKER_LOST and await self._resume(frame):
                        if self.finished is not None:
                            return
                        continue
                    if self.stream.crashed:
                        self.broker.quarantine.add([(self.stream.id, self.sent.fingerprint)],
                                                   self.stream.crashed)
                    raise from_failed(frame)
        finally:
            self.close()

    async def _resume(self, lost: Failed) -> bool:
        """Go on after the worker died (`lost`), if the request may: True once it runs again
        (or had nothing left to generate: `finished` is then set)."""
        plan = self.resumption
        text = "".join(self.text)
        if plan is None:
            return False
        # NOTE: resumptions used up, lost again in a crash that took others: once more,
        # alone (a poison among them then crashes its worker alone; gateway/core/resume.py).
        isolate = plan.left <= 0 and not plan.alone and self.stream.crashed_with > 1
        if plan.left <= 0 and not isolate:
            return False
        replay = plan.replays(self.stream.worker, self.ids, text)
        if not replay and not plan.allows(self.stream.worker, self.ids, text):
            return False
        if isolate:
            log.warning("request_id=%s was in flight at crashes with %d others: sent again "
                        "alone", self.stream.id, self.stream.crashed_with - 1)
            if not await plan.isolate(self.give_up_at - STALL_GRACE_S):
                return False
        else:
            plan.left -= 1
        how = "replayed" if replay else "continued"
        self.resumed.append(f"{how} after {len(self.ids)} tokens")
        log.warning("request_id=%s resumes (%s) after %d tokens: %s", self.stream.id, how,
                    len(self.ids), lost.message)
        for observer in self.observers:
            observer.on_resume(self)
        return await self._send_again(replay, text)

    async def _diverged(self, exc: Diverged) -> None:
        """A replay that did not give the client's tokens again: continued after them
        instead, if it can be; else the request fails."""
        log.warning("request_id=%s replay diverged (%s); continuing after its %d tokens "
                    "instead", self.stream.id, exc, len(self.ids))
        self.broker.release(self.stream)
        plan = self.resumption
        if plan is None or not plan.allows(self.stream.worker, self.ids, "".join(self.text)) or \
                not await self._send_again(False, ""):
            raise GatewayError(503, "worker_lost", "the worker died and the generation could "
                               f"not be resumed: its replay diverged ({exc})")

    async def _send_again(self, replay: bool, text: str) -> bool:
        """The request sent again (replayed or continued); False when it cannot be."""
        assert self.resumption is not None
        old = self.stream
        self.broker.close(old)
        try:
            again = await self.resumption(self.ids, replay)
        except GatewayError as exc:
            log.warning("request_id=%s cannot resume: %s", old.id, exc.message)
            return False
        self.replay = Replay(list(self.ids), len(text)) if replay and again else None
        if again is None:
            self.finished = self._ended_at_length()
            return True
        self.stream, self.accepted = again.stream, again.accepted
        self.stream.resumable = True
        self.give_up_at = _give_up_at(again.deadline, again.accepted)
        return True

    def _ended_at_length(self) -> Finished:
        """The end of a generation whose worker died after its last token (its max_tokens)
        but before its Finished frame: timed from what the gateway saw."""
        now = time.monotonic()
        first = self.first_token_at or now
        return Finished(id=self.stream.id, seq=self.stream.next_seq, finish_reason="length",
                        prompt_tokens=self.accepted.prompt_tokens, completion_tokens=self.tokens,
                        timings=Timings(prompt_ns=int((first - self.started) * 1e9),
                                        decode_ns=int((now - first) * 1e9),
                                        total_ns=int((now - self.started) * 1e9)))

    def _count(self, tokens: int) -> None:
        # NOTE: Delta.tokens and Finished.completion_tokens are cumulative counts.
        new = tokens - self.tokens
        if new <= 0:
            return
        now = time.monotonic()
        first = self.first_token_at is None
        gap = now - (self.last_token_at or self.started)
        if first:
            self.first_token_at = now
        self.last_token_at = now
        self.tokens = tokens
        for observer in self.observers:
            observer.on_tokens(self, new, gap, first)

    def close(self) -> None:
        """Stop listening; if the worker was still generating, tell it to stop."""
        if self._done:
            return
        self._done = True
        if self.resumption is not None:
            self.resumption.release()
        for observer in self.observers:
            observer.on_done(self)
        self.broker.release(self.stream, ended=self.finished is not None)


Part = TypeVar("Part")
Last = TypeVar("Last")


class Frames(Generic[Part, Last]):
    """A request answered by several frames and one last one (speech: Deltas then a
    Transcription, SpeechChunks then a Speech), from the first frame on, with its route.

    A `Failed` frame is raised as its GatewayError, a frame of another kind is a 500, and no
    frame by the deadline (plus the grace) a 504 naming `task` ("the transcription").
    `close` (idempotent; the request path calls it however the response ended) stops
    listening, and the worker working on it: an abort after the last frame is a no-op there.
    """

    def __init__(self, broker: Broker, stream: RequestStream, first: RequestFrame,
                 deadline: float, kinds: tuple[type[Part], type[Last]], task: str,
                 headers: dict[str, str], observers: Sequence[GenerationObserver] = ()) -> None:
        self.broker = broker
        self.stream = stream
        self.first: RequestFrame | None = first
        self.give_up_at = deadline + STALL_GRACE_S
        self.part, self.last = kinds
        self.task = task
        self.headers = headers
        self.observers = observers
        self._closed = False

    async def __aiter__(self) -> AsyncIterator[Part | Last]:
        frame, self.first = self.first, None
        while True:
            if frame is None:
                try:
                    frame = await self.stream.next_frame(max(0.1, self.give_up_at - time.time()))
                except TimeoutError:
                    raise GatewayError(504, "timeout",
                                       f"{self.task} did not finish in time") from None
            if isinstance(frame, Failed):
                raise from_failed(frame)
            if isinstance(frame, self.last):
                yield frame
                return
            if not isinstance(frame, self.part):
                raise GatewayError(500, "internal", f"unexpected frame {type(frame).__name__}")
            yield frame
            frame = None

    async def final(self) -> Last:
        """The last frame, the others read past."""
        async for frame in self:
            if isinstance(frame, self.last):
                return frame
        raise GatewayError(500, "internal", f"the worker ended {self.task} without its end")

    def count_audio(self, seconds: float) -> None:
        """Seconds of audio the worker heard (asr) or spoke (tts), for the metrics."""
        for observer in self.observers:
            observer.on_audio(self.stream.worker, seconds)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.broker.release(self.stream)
