"""Picks the worker for a request and turns the worker's frames into one async iterator.

Candidates for a model are the workers that serve it, NPU role first, then by device
preference. A worker that is not serving, whose queue is full, or that answers
`retry_elsewhere` (prompt too long for the NPU) is skipped and the next one is tried.

The served models are computed afresh (gateway/core/model_table.py): what the workers run now,
their configured models, pulled models and aliases. A request for a model no worker runs
switches a worker to it first (gateway/core/switching.py).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import TypeVar

import msgspec

from npu_proxy.gateway.core.broker import Broker
from npu_proxy.gateway.core.errors import (
    GatewayError,
    from_failed,
    model_not_found,
    overflow,
    unavailable,
)
from npu_proxy.gateway.core.generation import (
    Embedded,
    Frames,
    Generation,
    GenerationObserver,
    Last,
    Part,
    Scored,
    route_headers,
)
from npu_proxy.gateway.core.model_table import KIND_WHAT, ModelTable, ServedModel
from npu_proxy.gateway.core.request_stream import RequestStream
from npu_proxy.gateway.core.resume import Isolation, Resumed, Resumer
from npu_proxy.gateway.core.switching import Switcher
from npu_proxy.gateway.core.worker_link import WorkerLink, WorkerUnavailable
from npu_proxy.protocol.config import Config
from npu_proxy.protocol.messages import (
    Accepted,
    Delta,
    Detokenize,
    Detokenized,
    Embed,
    Embeddings,
    ErrorCode,
    Failed,
    Generate,
    RequestFrame,
    Rerank,
    Reranked,
    TokenCount,
    Tokenize,
)
from npu_proxy.protocol.speech import Speech, SpeechChunk, Synthesize, Transcribe, Transcription

log = logging.getLogger(__name__)

# Claude Code asks for claude-* names (see Router.claude_model and docs/clients.md).
CLAUDE_PREFIX = "claude-"
DEVICE_ORDER = ("NPU", "GPU", "CPU")


_Reply = TypeVar("_Reply", Embeddings, Reranked)


def _lookup(models: dict[str, ServedModel], name: str) -> ServedModel | None:
    model = models.get(name)
    if model is None:
        # NOTE: `x:latest` must also find a model served under the bare canonical name.
        bare = name.removesuffix(":latest")
        model = next((m for m in models.values() if m.name == bare), None)
    return model


class Router:
    def __init__(self, config: Config, broker: Broker) -> None:
        self.config = config
        self.broker = broker
        self.table = ModelTable(config, broker)
        self.aliases = self.table.aliases
        self.switcher = Switcher(config, broker, self.table)
        self.started = int(time.time())
        self.observers: list[GenerationObserver] = []
        # Per model: the turns of generations sent again alone (gateway/core/resume.py).
        self.isolation: dict[str, Isolation] = {}

    @property
    def models(self) -> dict[str, ServedModel]:
        return self.table.models()

    # --- names ---------------------------------------------------------------------------

    def resolve(self, requested: str, kind: str | None = None) -> ServedModel:
        if not isinstance(requested, str) or not requested.strip():
            raise GatewayError(400, "invalid_request", "model is required", param="model")
        name = self.table.canonical(requested)
        models = self.models
        model = _lookup(models, name)
        if model is None and name.startswith(CLAUDE_PREFIX):
            model = _lookup(models, self.claude_model())
        if model is None:
            raise model_not_found(requested)
        # NOTE: a vision-language model ("vlm") is a text-generation model too.
        if kind is not None and model.kind != kind and (kind, model.kind) != ("llm", "vlm"):
            what, use = KIND_WHAT.get(model.kind, KIND_WHAT["llm"])
            raise GatewayError(400, "invalid_request",
                               f"model '{requested}' is {what}; use the {use} API for it",
                               param="model")
        return model

    def claude_model(self) -> str:
        """What `claude-*` names stand for: `claude_model`, else the default LLM (the
        configured model of the first enabled llm/npu worker)."""
        if self.config.claude_model:
            return self.table.canonical(self.config.claude_model)
        return self.default_llm()

    def default_llm(self) -> str:
        """The configured model of the first enabled llm/npu worker ("" when none)."""
        for spec in self.config.workers:
            if spec.enabled and spec.role in ("llm", "npu"):
                return self.table.default_model(spec)
        return ""

    def candidates(self, model: ServedModel, images: bool = False) -> list[WorkerLink]:
        """The workers running `model`, best first; with `images`, only vision (vlm) ones."""
        links = [self.broker.links[w] for w in model.workers if w in self.broker.links
                 and (not images or self.broker.links[w].spec.role == "vlm")]

        def rank(link: WorkerLink) -> tuple[int, int]:
            device = link.spec.device.split(".")[0].upper()
            order = DEVICE_ORDER.index(device) if device in DEVICE_ORDER else len(DEVICE_ORDER)
            return (0 if link.spec.role == "npu" else 1, order)

        return sorted(links, key=rank)

    # --- dispatch ------------------------------------------------------------------------

    async def _first_frame(self, stream: RequestStream, deadline: float) -> RequestFrame:
        timeout = max(0.1, deadline - time.time())
        try:
            return await stream.next_frame(timeout)
        except TimeoutError:
            self.broker.release(stream)
            raise GatewayError(504, "timeout", "the worker did not accept the request in time")\
                from None
        except asyncio.CancelledError:
            # NOTE: the client went away before the worker accepted: free the slot on both
            # sides, or the worker generates to the deadline for nobody.
            self.broker.release(stream)
            raise

    async def _dispatch(
        self, model: ServedModel, request_id: str, msg: msgspec.Struct, deadline: float
    ) -> tuple[RequestStream, RequestFrame, str]:
        reason = "preferred"
        too_long: Failed | None = None
        unsupported: Failed | None = None
        busy = False
        down = False
        images = isinstance(msg, Generate | Tokenize) and any(
            m.images for m in msg.messages or [])
        unloading = self.switcher.residency.unloading
        for link in self.candidates(model, images):
            if not link.serving or link.name in unloading:
                down = True
                reason = reason if reason != "preferred" else "worker_unavailable"
                continue
            # NOTE: the queue bound is checked by the worker itself (QUEUE_FULL +
            # retry_elsewhere below); a heartbeat's queue depth is up to 0.5 s stale.
            try:
                stream = self.broker.open(link.name, request_id, msg)
            except WorkerUnavailable:
                down = True
                reason = reason if reason != "preferred" else "worker_unavailable"
                continue
            frame = await self._first_frame(stream, deadline)
            if isinstance(frame, Failed) and frame.retry_elsewhere:
                self.broker.close(stream)
                if frame.code == ErrorCode.PROMPT_TOO_LONG:
                    too_long = frame
                    reason = reason if reason != "preferred" else "prompt_too_long"
                elif frame.code == ErrorCode.UNSUPPORTED:
                    unsupported = frame
                    reason = reason if reason != "preferred" else "unsupported"
                else:
                    busy = busy or frame.code == ErrorCode.QUEUE_FULL
                    reason = reason if reason != "preferred" else (
                        "queue_full" if frame.code == ErrorCode.QUEUE_FULL
                        else "worker_unavailable")
                continue
            for observer in self.observers:
                observer.on_route(request_id, link.name, reason)
            return stream, frame, reason
        if too_long is not None and not busy:
            if too_long.prompt_tokens is not None:
                size = f"{too_long.prompt_tokens} tokens"
            else:  # NOTE: refused on its length in characters, never counted
                size = f"too long to count ({too_long.message})"
            raise overflow(too_long, _raw(msg),
                           f"the prompt is {size}, longer than any worker for "
                           f"'{model.name}' takes (limit {too_long.limit})")
        if unsupported is not None and not busy and not down:
            raise GatewayError(400, "invalid_request",
                               f"no worker for '{model.name}' can serve this request: "
                               f"{unsupported.message}")
        raise unavailable(f"no worker can take a request for '{model.name}' right now"
                          " (all busy, loading or down)")

    def deadline(self) -> float:
        return time.time() + self.config.inference_timeout

    async def _loaded(self, model: ServedModel, msg: Generate | Embed | Rerank | Transcribe
                      | Synthesize) -> tuple[ServedModel, int]:
        """The model with a worker serving it, and the nanoseconds the request waited for a
        load or a switch; that wait is added to the request's deadline.

        NOTE: inference_timeout bounds the inference; a load is bounded by its own
        load_timeout (a first NPU compile takes minutes), as Ollama does not count a load
        against a request either. The wait is what Ollama reports as load_duration.
        """
        began = time.monotonic_ns()
        model = await self.switcher.ensure(model)
        waited = time.monotonic_ns() - began
        msg.deadline += waited / 1e9
        return model, waited

    async def generate(self, model: ServedModel, msg: Generate) -> Generation:
        started = time.monotonic()
        model, waited = await self._loaded(model, msg)
        stream, frame, reason = await self._dispatch(model, msg.id, msg, msg.deadline)
        frame = self._accepted(stream, frame, msg)
        resumption = None
        if self.config.stream_resumes > 0:
            resumption = Resumer(functools.partial(self.send_again, model), self.broker, msg,
                                 self.config.stream_resumes,
                                 self.isolation.setdefault(model.name, Isolation()))
            stream.resumable = True
        return Generation(self.broker, stream, frame, reason, started, self.observers,
                          deadline=msg.deadline, load_wait_ns=waited, resumption=resumption)

    async def send_again(self, model: ServedModel, msg: Generate) -> Resumed:
        """A generation sent again after its worker died (gateway/core/resume.py), once a
        worker serves its model; the wait moves its deadline, as a load's does."""
        began = time.monotonic()
        await self.serving(model)
        msg.deadline += time.monotonic() - began
        stream, frame, _ = await self._dispatch(model, msg.id, msg, msg.deadline)
        return Resumed(stream, self._accepted(stream, frame, msg), msg.deadline)

    def _accepted(self, stream: RequestStream, frame: RequestFrame, msg: Generate) -> Accepted:
        """A generation's first frame, which must be its Accepted: else the stream is closed
        and the error raised (a prompt too long as the API's context-length error)."""
        if isinstance(frame, Accepted):
            return frame
        self.broker.close(stream)
        if isinstance(frame, Failed):
            if frame.code == ErrorCode.PROMPT_TOO_LONG:
                raise overflow(frame, _raw(msg))
            raise from_failed(frame)
        raise GatewayError(500, "internal", f"unexpected first frame {type(frame).__name__}")

    async def serving(self, model: ServedModel) -> None:
        """Wait until a worker of `model` serves (one restarting after a crash), within the
        longest load_timeout of its workers; a 503 after it."""
        links = [self.broker.links[w] for w in model.workers if w in self.broker.links]
        give_up = time.monotonic() + max((link.spec.load_timeout for link in links), default=0)
        # NOTE: polled, a tenth of a second at most: this waits for a process to restart.
        while not any(link.serving for link in links):
            if time.monotonic() > give_up:
                raise unavailable(f"no worker of '{model.name}' serves again in time")
            await asyncio.sleep(0.1)

    async def embed(self, model: ServedModel, msg: Embed) -> Embedded:
        frame, headers, waited = await self._one_reply(model, msg, Embeddings)
        return Embedded(frame, headers, waited)

    async def rerank(self, model: ServedModel, msg: Rerank) -> Scored:
        frame, headers, _ = await self._one_reply(model, msg, Reranked)
        return Scored(frame, headers)

    async def transcribe(self, model: ServedModel,
                         msg: Transcribe) -> Frames[Delta, Transcription]:
        """Dispatch speech to an asr worker: its Deltas (when streamed), then the
        Transcription."""
        return await self._frames(model, msg, (Delta, Transcription), "the transcription")

    async def speak(self, model: ServedModel, msg: Synthesize) -> Frames[SpeechChunk, Speech]:
        """Dispatch text to a tts worker: its SpeechChunks, then the Speech."""
        return await self._frames(model, msg, (SpeechChunk, Speech), "the speech")

    async def _frames(self, model: ServedModel, msg: Transcribe | Synthesize,
                      kinds: tuple[type[Part], type[Last]], task: str) -> Frames[Part, Last]:
        model, _ = await self._loaded(model, msg)
        stream, frame, reason = await self._dispatch(model, msg.id, msg, msg.deadline)
        device = self.broker.links[stream.worker].spec.device
        return Frames(self.broker, stream, frame, msg.deadline, kinds, task,
                      route_headers(device, stream.worker, reason, 0), self.observers)

    async def _one_reply(self, model: ServedModel, msg: Embed | Rerank,
                         expected: type[_Reply]) -> tuple[_Reply, dict[str, str], int]:
        """Dispatch a request answered by one frame (embeddings, scores) and check its kind;
        also the nanoseconds it waited for a load (Router._loaded)."""
        model, waited = await self._loaded(model, msg)
        stream, frame, reason = await self._dispatch(model, msg.id, msg, msg.deadline)
        self.broker.close(stream)
        if isinstance(frame, Failed):
            raise from_failed(frame)
        if not isinstance(frame, expected):
            raise GatewayError(500, "internal", f"unexpected frame {type(frame).__name__}")
        device = self.broker.links[stream.worker].spec.device
        return frame, route_headers(device, stream.worker, reason,
                                    sum(frame.prompt_tokens)), waited

    async def _ask(self, model: ServedModel, msg: Tokenize | Detokenize) -> RequestFrame:
        """One request answered with one frame (token counts, detokenizing)."""
        model = await self.switcher.ensure(model)
        stream, frame, _ = await self._dispatch(model, msg.id, msg, self.deadline())
        self.broker.close(stream)
        if isinstance(frame, Failed):
            raise from_failed(frame)
        return frame

    async def tokenize(self, model: ServedModel, msg: Tokenize) -> TokenCount:
        frame = await self._ask(model, msg)
        if not isinstance(frame, TokenCount):
            raise GatewayError(500, "internal", f"unexpected frame {type(frame).__name__}")
        return frame

    async def count_tokens(self, model: ServedModel, msg: Tokenize) -> int:
        return (await self.tokenize(model, msg)).count

    async def detokenize(self, model: ServedModel, msg: Detokenize) -> Detokenized:
        frame = await self._ask(model, msg)
        if not isinstance(frame, Detokenized):
            raise GatewayError(500, "internal", f"unexpected frame {type(frame).__name__}")
        return frame


def _raw(msg: object) -> bool:
    """A raw prompt (text or token ids), whose overflow names `prompt`, not `messages`."""
    return getattr(msg, "prompt", None) is not None \
        or getattr(msg, "prompt_ids", None) is not None
