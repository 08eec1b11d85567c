"""POST /v1/audio/speech: text to speech in OpenAI's shape.

The JSON body has `model`, `input` (at most max_speech_chars characters, OpenAI's 4096),
`voice`, `response_format` (mp3 by default, as OpenAI; opus, flac, wav, pcm; aac is a 400:
there is no encoder for it), `speed` (0.25-4.0) and `stream_format`. A `tts` worker speaks
the text sentence by sentence (one Synthesize request, answered by SpeechChunk frames and a
Speech frame); gateway/content/speech.py makes the file.

- No `stream_format`: the whole file, with its length (a wav's header holds its sizes).
- `stream_format: "audio"`: the file's bytes as each sentence is done (chunked); a wav then
  has 0xFFFFFFFF in its size fields, mp3/opus/flac come in one piece at the end.
- `stream_format: "sse"`: `speech.audio.delta` events (base64 of those same bytes), then
  `speech.audio.done` with `usage` (input tokens = phoneme ids, output tokens = 0).

`voice` takes OpenAI's names (alloy, ash, ballad, coral, echo, fable, nova, onyx, sage,
shimmer, verse, ...) or any other string: a Piper voice model has one speaker, so every name
is that voice. `instructions` is left out (the voice takes none), with the
`X-NPU-Proxy-Ignored` header. Errors are OpenAI's shape.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator
from typing import Any, Literal

import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from npu_proxy.gateway.api.request_path import DialectRoutes
from npu_proxy.gateway.content.speech import MEDIA, Encoder
from npu_proxy.gateway.core.errors import GatewayError, invalid
from npu_proxy.gateway.core.request_stream import RequestStream
from npu_proxy.gateway.core.router import frames_until, release
from npu_proxy.gateway.http.preload import numpy_ready
from npu_proxy.gateway.http.util import request_id, request_key, unless_disconnected
from npu_proxy.gateway.http.wire import OPENAI, SSE
from npu_proxy.protocol.config import speech_missing
from npu_proxy.protocol.messages import RequestFrame
from npu_proxy.protocol.speech import Speech, SpeechChunk, Synthesize

PATH = "/v1/audio/speech"


class SpeechRequest(msgspec.Struct):
    model: str = ""
    input: Any = None
    # NOTE: a string, or the object {"id": ...} OpenAI takes for custom voices.
    voice: Any = "alloy"
    response_format: str = "mp3"
    speed: float = 1.0
    stream_format: Literal["audio", "sse"] | None = None
    instructions: str | None = None


class SpeechRoutes(DialectRoutes):
    def routes(self) -> list[Route]:
        return [self.requests.post(PATH, SpeechRequest, self.speech)]

    def _check(self, req: SpeechRequest) -> str:
        if not isinstance(req.input, str):
            raise invalid("'input' is required: the text to speak", param="input")
        if not req.input.strip():
            raise invalid("'input' must not be empty", param="input")
        limit = self.router.config.max_speech_chars
        if len(req.input) > limit:
            raise invalid(f"'input' is {len(req.input)} characters; the limit is {limit} "
                          "(max_speech_chars)", param="input")
        if not isinstance(req.voice, str | dict):
            raise invalid("'voice' must be a voice name", param="voice")
        if req.response_format not in MEDIA:
            raise invalid(f"'response_format' must be one of {', '.join(MEDIA)}, got "
                          f"{req.response_format!r}", param="response_format")
        if not 0.25 <= req.speed <= 4.0:
            raise invalid(f"'speed' must be between 0.25 and 4.0, got {req.speed:g}",
                          param="speed")
        return req.input

    async def speech(self, request: Request, req: SpeechRequest) -> Response:
        text = self._check(req)
        try:
            model = self.router.resolve(req.model, kind="tts")
        except GatewayError as exc:
            missing = speech_missing() if exc.status == 404 and not any(
                spec.role == "tts" for spec in self.router.config.workers) else None
            if missing is not None:  # NOTE: say why, not a bare "not found"
                exc.message = f"{exc.message}: {missing}"
            raise
        msg = Synthesize(id=request_key(request), model=model.name, text=text,
                         deadline=self.router.deadline(), speed=req.speed,
                         log_id=request_id(request))
        stream, first, headers = await unless_disconnected(
            request, self.router.speak(model, msg))
        if req.instructions:
            headers["X-NPU-Proxy-Ignored"] = "instructions"
        await numpy_ready()  # NOTE: the encoder uses numpy, in a thread (preload.py)
        encoder = Encoder(req.response_format, streamed=req.stream_format is not None)
        if req.stream_format == "sse":
            return StreamingResponse(self._events(stream, first, msg, encoder),
                                     media_type=SSE, headers=headers)
        if req.stream_format == "audio":
            return StreamingResponse(self._bytes(stream, first, msg, encoder),
                                     media_type=MEDIA[req.response_format], headers=headers)
        try:
            body = await unless_disconnected(
                request, self._whole(stream, first, msg, encoder))
        finally:
            self._close(stream)
        return Response(body, media_type=MEDIA[req.response_format], headers=headers)

    # --- the worker's frames ---------------------------------------------------------------

    def _close(self, stream: RequestStream) -> None:
        release(self.router.broker, stream)

    async def _frames(self, stream: RequestStream, first: RequestFrame,
                      msg: Synthesize) -> AsyncIterator[SpeechChunk | Speech]:
        spoken = 0.0
        async for frame in frames_until(stream, first, msg.deadline, SpeechChunk, Speech,
                                        "the speech"):
            if isinstance(frame, SpeechChunk):
                spoken += len(frame.pcm) / 2 / frame.sample_rate  # NOTE: int16 samples
            else:
                self.router.count_audio(stream.worker, spoken)
            yield frame

    async def _pieces(self, stream: RequestStream, first: RequestFrame, msg: Synthesize,
                      encoder: Encoder) -> AsyncIterator[tuple[bytes, Speech | None]]:
        async for frame in self._frames(stream, first, msg):
            # NOTE: encoding (resampling, Opus, FLAC, MP3) is CPU work: in a thread, never on
            # the event loop (opus of 1,000 characters at speed 0.5 froze every API 9.7 s).
            if isinstance(frame, SpeechChunk):
                yield await asyncio.to_thread(encoder.feed, frame.pcm, frame.sample_rate), None
            else:
                yield await asyncio.to_thread(encoder.finish, frame.sample_rate), frame

    async def _whole(self, stream: RequestStream, first: RequestFrame, msg: Synthesize,
                     encoder: Encoder) -> bytes:
        return b"".join([piece async for piece, _ in self._pieces(stream, first, msg,
                                                                   encoder)])

    async def _bytes(self, stream: RequestStream, first: RequestFrame, msg: Synthesize,
                     encoder: Encoder) -> AsyncIterator[bytes]:
        # NOTE: a failure after the first bytes can only end the body early (no error shape
        # fits inside audio); the status line has already gone.
        try:
            async for piece, _ in self._pieces(stream, first, msg, encoder):
                if piece:
                    yield piece
        except GatewayError:
            return
        finally:
            self._close(stream)

    async def _events(self, stream: RequestStream, first: RequestFrame, msg: Synthesize,
                      encoder: Encoder) -> AsyncIterator[bytes]:
        try:
            async for piece, done in self._pieces(stream, first, msg, encoder):
                if piece:
                    yield OPENAI.frame({"type": "speech.audio.delta",
                                        "audio": base64.b64encode(piece).decode()})
                if done is not None:
                    yield OPENAI.frame({"type": "speech.audio.done", "usage": {
                        "input_tokens": done.phonemes, "output_tokens": 0,
                        "total_tokens": done.phonemes}})
        except GatewayError as exc:
            yield OPENAI.error_event(exc)
        finally:
            self._close(stream)
