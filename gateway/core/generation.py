"""`Generation`: a request a worker accepted, as the gateway sees it: its route (the response
headers), then its Delta frames and the Finished one as one async iterator, with the timing
every API and /metrics read, and the abort sent when it is left before its end. `Frames` is
the same for a request answered by several frames and one last one (speech in and out).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from npu_proxy.gateway.core.broker import Broker
from npu_proxy.gateway.core.errors import GatewayError, from_failed
from npu_proxy.gateway.core.request_stream import RequestStream
from npu_proxy.protocol.messages import (
    Abort,
    Accepted,
    Delta,
    Embeddings,
    Failed,
    Finished,
    RequestFrame,
    Reranked,
    TokenLogprob,
)

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


class Generation:
    """A request accepted by a worker: its route, then its Delta frames and the Finished one.

    Iterating is the one place every API sees the tokens, so it also keeps the timing:
    `gap` is the time since dispatch for the first tokens, else since the previous ones.
    """

    def __init__(self, broker: Broker, stream: RequestStream, accepted: Accepted,
                 reason: str, started: float | None = None,
                 observers: Sequence[GenerationObserver] = (),
                 deadline: float = float("inf"), load_wait_ns: int = 0) -> None:
        self.broker = broker
        # Nanoseconds the request waited in the gateway for a load or a switch before
        # dispatch (Router._loaded): Ollama's load_duration counts it.
        self.load_wait_ns = load_wait_ns
        # NOTE: the worker ends a request at its deadline itself; this later one only
        # catches a worker that stalled (still heartbeating, no longer generating).
        self.give_up_at = deadline + STALL_GRACE_S
        self.stream = stream
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
        # The output's token count at the end of each Delta (to count a part of the output's
        # tokens: a thinking model's reasoning_tokens).
        self.ends: list[int] = []
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
                if isinstance(frame, Delta):
                    self._count(frame.tokens)
                    self.ends.append(frame.tokens)
                    if frame.logprobs:
                        self.logprobs.extend(frame.logprobs)
                    yield frame
                elif isinstance(frame, Finished):
                    self.finished = frame
                    self._count(frame.completion_tokens)
                    return
                elif isinstance(frame, Failed):
                    raise from_failed(frame)
        finally:
            self.close()

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
        for observer in self.observers:
            observer.on_done(self)
        # NOTE: also when the broker already gave the request up (a frame gap, a lost
        # heartbeat): the worker may still be generating it. A worker that knows no such
        # request ignores the abort.
        if self.finished is None:
            self.broker.send(self.stream.worker, Abort(id=self.stream.id))
        self.broker.close(self.stream)


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
        self.broker.send(self.stream.worker, Abort(id=self.stream.id))
        self.broker.close(self.stream)
