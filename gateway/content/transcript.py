"""A transcription in each of OpenAI's `response_format`s: json, text, srt, vtt and
verbose_json (with segments, words or both), and the streamed events (`transcript.text.delta`,
`transcript.text.done`). No Starlette: the route (gateway/api/audio.py) sends what this makes.
"""

from __future__ import annotations

from typing import Any

from npu_proxy.protocol.speech import Segment, Transcription

FORMATS = ("json", "text", "srt", "vtt", "verbose_json")
# The formats that need the segments' times from the worker.
TIMED = frozenset({"srt", "vtt", "verbose_json"})
MEDIA = {"json": "application/json", "verbose_json": "application/json",
         "text": "text/plain; charset=utf-8", "srt": "application/x-subrip; charset=utf-8",
         "vtt": "text/vtt; charset=utf-8"}
# NOTE: verbose_json names the language in full ("english"), as OpenAI's whisper-1 does.
LANGUAGES = {"en": "english", "de": "german", "fr": "french", "es": "spanish",
             "it": "italian", "pt": "portuguese", "nl": "dutch", "ru": "russian",
             "zh": "chinese", "ja": "japanese", "ko": "korean", "pl": "polish",
             "tr": "turkish", "uk": "ukrainian", "sv": "swedish", "ar": "arabic",
             "hi": "hindi", "cs": "czech", "fi": "finnish", "da": "danish"}


def _clock(seconds: float, separator: str) -> str:
    ms = max(0, round(seconds * 1000))
    hours, ms = divmod(ms, 3_600_000)
    minutes, ms = divmod(ms, 60_000)
    secs, ms = divmod(ms, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{separator}{ms:03d}"


def _segments(done: Transcription) -> list[Segment]:
    """The timed segments; one spanning the audio when the worker gave none (silence)."""
    if done.segments:
        return list(done.segments)
    return [Segment(start=0.0, end=round(done.duration, 2), text=done.text)] if done.text \
        else []


def srt(done: Transcription) -> str:
    return "".join(f"{i}\n{_clock(s.start, ',')} --> {_clock(s.end, ',')}\n{s.text}\n\n"
                   for i, s in enumerate(_segments(done), 1))


def vtt(done: Transcription) -> str:
    return "WEBVTT\n\n" + "".join(f"{_clock(s.start, '.')} --> {_clock(s.end, '.')}\n{s.text}\n\n"
                                  for s in _segments(done))


def usage(done: Transcription) -> dict[str, Any]:
    # NOTE: whisper-1's usage: billed by the second of audio, not by tokens.
    return {"type": "duration", "seconds": max(1, round(done.duration))}


def verbose_json(done: Transcription, task: str, temperature: float,
                 granularities: frozenset[str] = frozenset()) -> dict[str, Any]:
    """OpenAI's verbose_json: `segments` unless only words were asked, `words` when asked."""
    result: dict[str, Any] = {
        "task": task, "language": LANGUAGES.get(done.language, done.language or "english"),
        "duration": round(done.duration, 3), "text": done.text}
    # NOTE: as OpenAI's whisper-1: no granularity means segments; ["word"] alone, words only.
    if "segment" in granularities or not granularities:
        result["segments"] = _verbose_segments(done, temperature)
    if "word" in granularities:
        result["words"] = [{"word": w.word, "start": w.start, "end": w.end}
                           for w in done.words]
    result["usage"] = usage(done)
    return result


def _verbose_segments(done: Transcription, temperature: float) -> list[dict[str, Any]]:
    return [{"id": i, "seek": int(s.start * 100), "start": s.start, "end": s.end,
             "text": s.text, "tokens": [], "temperature": temperature,
             "avg_logprob": 0.0, "compression_ratio": 0.0, "no_speech_prob": 0.0}
            for i, s in enumerate(_segments(done))]


def body(done: Transcription, response_format: str, task: str, temperature: float,
         granularities: frozenset[str] = frozenset()) -> dict[str, Any] | str:
    """The response: a JSON object, or the text of the text, srt and vtt formats."""
    if response_format == "text":
        return done.text + "\n"
    if response_format == "srt":
        return srt(done)
    if response_format == "vtt":
        return vtt(done)
    if response_format == "verbose_json":
        return verbose_json(done, task, temperature, granularities)
    return {"text": done.text, "usage": usage(done)}


def delta_event(text: str) -> dict[str, Any]:
    return {"type": "transcript.text.delta", "delta": text, "logprobs": None}


def done_event(done: Transcription) -> dict[str, Any]:
    return {"type": "transcript.text.done", "text": done.text, "logprobs": None,
            "usage": usage(done)}
