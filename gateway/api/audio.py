"""POST /v1/audio/transcriptions and /v1/audio/translations: speech to text in OpenAI's shape.

The body is multipart/form-data, as the OpenAI SDKs send it: `file` (the audio), `model`,
and optionally `language`, `prompt`, `temperature`, `response_format` (json, text, srt, vtt,
verbose_json), `timestamp_granularities[]` and `stream`. The gateway decodes the audio
(gateway/content/audio.py, in a thread) and an `asr` worker transcribes it (one Transcribe
request, answered by Delta frames when streamed and one Transcription). `stream=true` is
SSE: `transcript.text.delta` events, then `transcript.text.done`. Errors are OpenAI's shape;
an unreadable file is a 400 naming `file`, a file over max_audio_bytes a 413.

A translation is a transcription into English: an English-only model (the embedded
whisper:tiny.en) hears English, so for it the two routes are the same. Word timestamps
(`timestamp_granularities[]=word`) come with verbose_json, as OpenAI's `words`; with another
format they are left out, with the `X-NPU-Proxy-Ignored` header and a log line.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from starlette.datastructures import FormData, UploadFile
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from npu_proxy.gateway.api.request_path import DialectRoutes, Frames, invalid
from npu_proxy.gateway.content import transcript
from npu_proxy.gateway.content.audio import AudioLimits, decode, too_large
from npu_proxy.gateway.http.util import dumps, request_id, request_key
from npu_proxy.protocol.messages import Delta
from npu_proxy.protocol.speech import Transcribe, Transcription

log = logging.getLogger(__name__)

# The characters of a prompt kept for the worker: far more than the 223 tokens Whisper reads
# of it (a token of its vocabulary is at most a few dozen characters of text).
PROMPT_CHARS = 8192

PATHS = {"/v1/audio/transcriptions": "transcribe", "/v1/audio/translations": "translate"}
# The form, for the OpenAPI document (gateway/pages/openapi.py).
FORM_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["file", "model"],
    "properties": {
        "file": {"type": "string", "format": "binary"}, "model": {"type": "string"},
        "language": {"type": "string"}, "prompt": {"type": "string"},
        "temperature": {"type": "number"},
        "response_format": {"type": "string", "enum": list(transcript.FORMATS)},
        "timestamp_granularities[]": {"type": "array", "items": {
            "type": "string", "enum": ["segment", "word"]}},
        "stream": {"type": "boolean"}}}
_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off", "")


def _text(form: FormData, name: str) -> str:
    value = form.get(name)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise invalid(f"'{name}' must be a text field, not a file", param=name)
    return value.strip()


def _flag(form: FormData, name: str) -> bool:
    value = _text(form, name).lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise invalid(f"'{name}' must be true or false, got {value!r}", param=name)


def _temperature(form: FormData) -> float:
    raw = _text(form, "temperature")
    try:
        value = float(raw) if raw else 0.0
    except ValueError:
        raise invalid(f"'temperature' must be a number, got {raw!r}",
                      param="temperature") from None
    if not 0.0 <= value <= 1.0:
        raise invalid(f"'temperature' must be between 0 and 1, got {value:g}",
                      param="temperature")
    return value


def _granularities(form: FormData) -> list[str]:
    values = [*form.getlist("timestamp_granularities[]"), *form.getlist(
        "timestamp_granularities")]
    found = [v.strip() for v in values if isinstance(v, str) and v.strip()]
    wrong = [v for v in found if v not in ("segment", "word")]
    if wrong:
        raise invalid(f"'timestamp_granularities[]' takes segment and word, got {wrong[0]!r}",
                      param="timestamp_granularities[]")
    return found


class AudioRoutes(DialectRoutes):
    def routes(self) -> list[Route]:
        return [self.requests.form(path, self.transcribe, f"audio_{task}")
                for path, task in PATHS.items()]

    @property
    def limits(self) -> AudioLimits:
        return AudioLimits(self.config.max_audio_bytes, self.config.max_audio_seconds)

    async def transcribe(self, request: Request, form: FormData) -> Response:
        task = PATHS[request.url.path]
        upload = form.get("file")
        if not isinstance(upload, UploadFile):
            raise invalid("'file' is required: the audio file to transcribe", param="file")
        model = self.requests.resolve(_text(form, "model"), kind="asr")
        response_format = _text(form, "response_format") or "json"
        if response_format not in transcript.FORMATS:
            raise invalid(f"'response_format' must be one of {', '.join(transcript.FORMATS)}, "
                          f"got {response_format!r}", param="response_format")
        stream = _flag(form, "stream")
        if stream and response_format not in ("json", "text"):
            raise invalid("'stream' takes response_format json or text", param="stream")
        temperature = _temperature(form)
        language = _text(form, "language").lower()
        if language and not (2 <= len(language) <= 3 and language.isalpha()):
            raise invalid(f"'language' must be an ISO-639-1 code such as 'en', got "
                          f"{language!r}", param="language")
        headers: dict[str, str] = {}
        granularities = frozenset(_granularities(form))
        words = "word" in granularities and response_format == "verbose_json"
        if "word" in granularities and not words:
            # NOTE: OpenAI times words in verbose_json only; json, text, srt and vtt have
            # no place for them.
            log.info("request_id=%s timestamp_granularities word ignored: response_format %s",
                     request_id(request), response_format)
            headers["X-NPU-Proxy-Ignored"] = "timestamp_granularities[]=word"
        # Segments' times: for srt, vtt and verbose_json, unless it asked words alone.
        timed = response_format in transcript.TIMED and not (words and granularities == {"word"})
        limits = self.limits
        if upload.size is not None and upload.size > limits.max_bytes:
            raise too_large(upload.size, limits)
        data = await upload.read(limits.max_bytes + 1)
        audio = await asyncio.to_thread(decode, data, limits)
        prompt = _text(form, "prompt")
        if len(prompt) > PROMPT_CHARS:
            # NOTE: Whisper reads at most the last 223 tokens of a prompt (the worker keeps
            # those); a longer text is cut here first, so no worker tokenizes megabytes.
            log.info("request_id=%s: prompt of %d characters, its last %d kept",
                     request_id(request), len(prompt), PROMPT_CHARS)
            headers["X-NPU-Proxy-Truncated-Prompt"] = str(len(prompt) - PROMPT_CHARS)
            prompt = prompt[-PROMPT_CHARS:]
        msg = Transcribe(id=request_key(request), model=model.name, audio=audio.pcm(),
                         deadline=self.requests.deadline(), task=task, language=language,
                         prompt=prompt, temperature=temperature,
                         timestamps=timed, stream=stream, log_id=request_id(request),
                         words=words)
        frames = await self.requests.transcribe(request, model, msg)
        headers.update(frames.headers)
        if stream:
            return self.requests.events(request, frames, _events(frames), headers)
        done = await self.requests.read(request, frames, _final(frames))
        result = transcript.body(done, response_format, task, temperature, granularities)
        if isinstance(result, str):
            return Response(result, media_type=transcript.MEDIA[response_format],
                            headers=headers)
        return Response(dumps(result), media_type="application/json", headers=headers)


async def _final(frames: Frames[Delta, Transcription]) -> Transcription:
    done = await frames.final()
    frames.count_audio(done.duration)
    return done


async def _events(frames: Frames[Delta, Transcription]) -> AsyncIterator[dict[str, Any]]:
    async for frame in frames:
        if isinstance(frame, Delta):
            yield transcript.delta_event(frame.text)
        else:
            frames.count_audio(frame.duration)
            yield transcript.done_event(frame)
