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
from starlette.responses import Response
from starlette.routing import Route

from npu_proxy.gateway.api.request_path import DialectRoutes, Frames, GatewayError, invalid
from npu_proxy.gateway.content.speech import MEDIA, Encoder
from npu_proxy.gateway.http.preload import numpy_ready
from npu_proxy.gateway.http.util import request_id, request_key
from npu_proxy.protocol.config import speech_missing
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
        limit = self.config.max_speech_chars
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
            model = self.requests.resolve(req.model, kind="tts")
        except GatewayError as exc:
            missing = speech_missing() if exc.status == 404 and not any(
                spec.role == "tts" for spec in self.config.workers) else None
            if missing is not None:  # NOTE: say why, not a bare "not found"
                exc.message = f"{exc.message}: {missing}"
            raise
        msg = Synthesize(id=request_key(request), model=model.name, text=text,
                         deadline=self.requests.deadline(), speed=req.speed,
                         log_id=request_id(request))
        frames = await self.requests.speak(request, model, msg)
        headers = dict(frames.headers)
        if req.instructions:
            headers["X-NPU-Proxy-Ignored"] = "instructions"
        await numpy_ready()  # NOTE: the encoder uses numpy, in a thread (preload.py)
        encoder = Encoder(req.response_format, streamed=req.stream_format is not None)
        media = MEDIA[req.response_format]
        if req.stream_format == "sse":
            return self.requests.events(request, frames, _events(frames, encoder), headers)
        if req.stream_format == "audio":
            return self.requests.chunks(request, frames, _bytes(frames, encoder), media,
                                        headers)
        body = await self.requests.read(request, frames, _whole(frames, encoder))
        return Response(body, media_type=media, headers=headers)


# --- the worker's frames, encoded ---------------------------------------------------------


async def _pieces(frames: Frames[SpeechChunk, Speech],
                  encoder: Encoder) -> AsyncIterator[tuple[bytes, Speech | None]]:
    spoken = 0.0
    async for frame in frames:
        # NOTE: encoding (resampling, Opus, FLAC, MP3) is CPU work: in a thread, never on the
        # event loop (opus of 1,000 characters at speed 0.5 froze every API 9.7 s).
        if isinstance(frame, SpeechChunk):
            spoken += len(frame.pcm) / 2 / frame.sample_rate  # NOTE: int16 samples
            yield await asyncio.to_thread(encoder.feed, frame.pcm, frame.sample_rate), None
        else:
            frames.count_audio(spoken)
            yield await asyncio.to_thread(encoder.finish, frame.sample_rate), frame


async def _whole(frames: Frames[SpeechChunk, Speech], encoder: Encoder) -> bytes:
    return b"".join([piece async for piece, _ in _pieces(frames, encoder)])


async def _bytes(frames: Frames[SpeechChunk, Speech], encoder: Encoder) -> AsyncIterator[bytes]:
    async for piece, _ in _pieces(frames, encoder):
        yield piece


async def _events(frames: Frames[SpeechChunk, Speech],
                  encoder: Encoder) -> AsyncIterator[dict[str, Any]]:
    async for piece, done in _pieces(frames, encoder):
        if piece:
            yield {"type": "speech.audio.delta", "audio": base64.b64encode(piece).decode()}
        if done is not None:
            yield {"type": "speech.audio.done", "usage": {
                "input_tokens": done.phonemes, "output_tokens": 0,
                "total_tokens": done.phonemes}}
