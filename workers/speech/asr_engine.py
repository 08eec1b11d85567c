"""The asr engine: one WhisperPipeline turning speech into text, one request at a time.

The gateway sends the audio decoded (mono 16 kHz float32, gateway/content/audio.py). The
engine cuts it into Whisper's 30 s windows and transcribes them in order, each window after
the first prompted with the end of the text so far (as Whisper's own long-form decoding
conditions on the previous text), and joins the texts. A streamed request gets each piece of
text as a `Delta` as the pipeline decodes it; every request ends with one `Transcription`
(the whole text, the segments and the words with their times when asked).

Word times come from a second pipeline, built with `word_timestamps=True` (cross-attention
on the model's `alignment_heads`, aligned by DTW) when the first request asks for them, and
kept for the next ones; the others go to the plain pipeline.

NOTE: WhisperPipeline streams only without timestamps (openvino-genai 2026.4: "Streamer
supported for short-form audio (< 30 seconds) with return_timestamps=False only"); with
timestamps, a streamed request gets each window's segments as they are done.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import openvino_genai as ov_genai

from npu_proxy.protocol.config import Config, WorkerSpec
from npu_proxy.protocol.messages import Delta, ErrorCode
from npu_proxy.protocol.speech import MAX_WORDS, Segment, Transcribe, Transcription, Word
from npu_proxy.protocol.timings import Timings
from npu_proxy.workers.engine import Emit
from npu_proxy.workers.speech.serial_base import Cancelled, SerialSpeechEngine
from npu_proxy.workers.speech.whisper_ir import ensure_whisper_ir

log = logging.getLogger(__name__)

SAMPLE_RATE = 16_000
# Whisper's window: the encoder reads 30 s of audio at a time.
WINDOW = 30 * SAMPLE_RATE
# NOTE: a last window shorter than this is mostly padding to Whisper, which then tends to
# invent words; it is left out unless it is the whole audio.
MIN_TAIL = SAMPLE_RATE // 10
# Characters of the text so far that prompt the next window.
CONTEXT_CHARS = 200
# NOTE: Whisper's prompt is at most half its 448-token text context, less the token that
# starts it, as OpenAI and faster-whisper keep it: the last 223 tokens of a longer one. A
# 48 KB prompt given whole took the worker to 3.1 GiB; a 500 KB one to 9.1 GiB and a crash.
PROMPT_TOKENS = 223
# NOTE: the pipeline's words carry the punctuation that follows them ("Paris."); OpenAI's
# `words` are bare ("Paris"), the punctuation is in `text`.
PUNCTUATION = ".,!?;:\"()[]{}¿¡…«»“”"


class AsrEngine(SerialSpeechEngine[Transcribe]):
    serves = Transcribe
    refusal = "only transcribes speech"
    task = "transcription"

    def __init__(self, config: Config, spec: WorkerSpec, model_path: str, emit: Emit,
                 build_embedded: bool = False) -> None:
        super().__init__(spec, emit)
        self.config = config
        self.model_path = model_path
        # The embedded Whisper: its folder at model_path is built on first load.
        self.build_embedded = build_embedded
        self.pipe: Any = None
        self.multilingual = False
        self._properties: dict[str, Any] = {}
        # The pipeline that times words: None until a request asks, False if it cannot be.
        self._word_pipe: Any = None

    def load(self, properties: dict[str, Any]) -> None:
        folder = Path(self.model_path)
        if self.build_embedded:
            ensure_whisper_ir(folder)
        self._properties = properties
        self.pipe = ov_genai.WhisperPipeline(str(folder), self.spec.device, **properties)
        self.multilingual = bool(self.pipe.get_generation_config().is_multilingual)
        log.info("worker %s: Whisper decodes %s at temperature 0 (streams greedy)",
                 self.spec.name,
                 f"by beam search of {self.spec.num_beams}" if self.spec.num_beams > 1
                 else "greedy")

    def warm_up(self) -> None:
        self.pipe.generate(np.zeros(SAMPLE_RATE, dtype=np.float32), max_new_tokens=4)

    # --- one request ---------------------------------------------------------------------

    def _pipe_for(self, req: Transcribe) -> Any:
        """The pipeline for the request: the one that times words if it asks for them.

        NOTE: measured in-process on CPU (tiny.en, openvino-genai 2026.4, 2 busy cores): a
        pipeline built with word_timestamps loads as fast (2.1-2.6 s both ways) but decodes
        a 27 s window about 12% slower (median of 30: 2121 vs 1896 ms) even when no words
        are asked, so only requests that ask for words pay it, after one load.
        """
        if not req.words:
            return self.pipe
        if self._word_pipe is None:
            try:
                self._word_pipe = ov_genai.WhisperPipeline(
                    self.model_path, self.spec.device,
                    **{**self._properties, "word_timestamps": True})
            except Exception as exc:
                # NOTE: e.g. a model without alignment_heads, or a device whose decoder
                # cannot expose its cross-attention; another worker may time words.
                log.warning("worker %s: no word timestamps: %s", self.spec.name, exc)
                self._word_pipe = False
            self.progress_at = time.monotonic()
        if self._word_pipe is False:
            raise Cancelled(ErrorCode.UNSUPPORTED, f"worker {self.spec.name} cannot time "
                            "words with this model", retry_elsewhere=True)
        return self._word_pipe

    def _prompt(self, pipe: Any, req: Transcribe) -> str:
        """The request's prompt, its last PROMPT_TOKENS tokens when longer (logged)."""
        if not req.prompt:
            return ""
        tokenizer = pipe.get_tokenizer()
        ids = [int(t) for t in tokenizer.encode(req.prompt, add_special_tokens=False)
               .input_ids.data[0]]
        if len(ids) <= PROMPT_TOKENS:
            return req.prompt
        log.info("request_id=%s: prompt of %d tokens, its last %d kept", req.log_id or req.id,
                 len(ids), PROMPT_TOKENS, extra={"request_id": req.log_id or req.id})
        return str(tokenizer.decode(ids[-PROMPT_TOKENS:], skip_special_tokens=True)).strip()

    def _config(self, pipe: Any, req: Transcribe) -> Any:
        config = pipe.get_generation_config()
        config.return_timestamps = req.timestamps
        if req.words:
            config.word_timestamps = True
        # NOTE: an English-only model hears English whatever the request says (and its
        # translation is its transcription).
        if self.multilingual:
            config.task = req.task
            if req.language:
                token = f"<|{req.language}|>"
                if token not in config.lang_to_id:
                    raise Cancelled(ErrorCode.BAD_REQUEST, f"language {req.language!r} is not "
                                                           "one this model knows")
                config.language = token
        if req.temperature > 0:
            config.do_sample = True
            config.temperature = req.temperature
        elif self.spec.num_beams > 1 and not req.stream:
            # NOTE: a stream decodes greedily: beam search streams the text of a beam that
            # may lose later ("world," then "world." in the final text), so the deltas would
            # not add up to the transcription.
            config.num_beams = self.spec.num_beams
        return config

    def _serve(self, arrived: float, req: Transcribe) -> None:
        if len(req.audio) % 4:
            raise Cancelled(ErrorCode.BAD_REQUEST, "audio must be float32 samples")
        samples = np.frombuffer(req.audio, dtype="<f4").astype(np.float32)
        started = time.time()
        pipe = self._pipe_for(req)
        config = self._config(pipe, req)
        texts: list[str] = []
        segments: list[Segment] = []
        words: list[Word] = []
        tokens = 0
        language = "" if self.multilingual else "en"
        starts = list(range(0, max(len(samples), 1), WINDOW))
        for at in starts:
            window = samples[at:at + WINDOW]
            if at and len(window) < MIN_TAIL:
                break
            self._check(req)
            so_far = " ".join(texts)
            prompt = so_far[-CONTEXT_CHARS:] if so_far else self._prompt(pipe, req)
            if prompt:
                config.initial_prompt = prompt
            pieces: list[str] = []

            def on_piece(piece: str, pieces: list[str] = pieces) -> ov_genai.StreamingStatus:
                self.progress_at = time.monotonic()
                self.faults.on_tokens(1)
                if req.stream and piece:
                    text = piece.lstrip() if self._seq == 0 else piece
                    if not pieces and texts and not text.startswith(" "):
                        text = " " + text
                    if text:
                        self.emit(Delta(id=req.id, seq=self._next(), text=text, tokens=1))
                pieces.append(piece)
                if req.id in self._cancelled or time.time() > req.deadline:
                    return ov_genai.StreamingStatus.CANCEL
                return ov_genai.StreamingStatus.RUNNING

            streamer = None if req.timestamps else on_piece
            result = pipe.generate(window, config, streamer)
            self.progress_at = time.monotonic()
            self._check(req)
            offset = at / SAMPLE_RATE
            if req.timestamps:
                for chunk in result.chunks:
                    n = len(getattr(chunk, "token_ids", []) or [])
                    tokens += n
                    self.faults.on_tokens(max(n, 1))
                    segment = Segment(start=round(offset + float(chunk.start_ts), 2),
                                      end=round(offset + float(max(chunk.end_ts,
                                                                   chunk.start_ts)), 2),
                                      text=chunk.text.strip())
                    segments.append(segment)
                    if req.stream and segment.text:
                        text = segment.text if self._seq == 0 else " " + segment.text
                        self.emit(Delta(id=req.id, seq=self._next(), text=text,
                                        tokens=max(n, 1)))
            else:
                tokens += len(pieces)
            if req.words:
                words.extend(_words(result, offset, len(window) / SAMPLE_RATE))
            if not language:
                # NOTE: the detected language's token (e.g. "<|de|>"), on multilingual models.
                language = str(getattr(result, "language", "") or "").strip("<|>")
            text = result.texts[0].strip() if result.texts else ""
            if text:
                texts.append(text)
        self.generated_tokens += tokens
        self.served += 1
        done = time.time()
        self.emit(Transcription(
            id=req.id, seq=self._next(), text=" ".join(texts), duration=len(samples) / SAMPLE_RATE,
            timings=Timings(queue_ns=int((started - arrived) * 1e9),
                            decode_ns=int((done - started) * 1e9),
                            total_ns=int((done - arrived) * 1e9)),
            language=language, segments=segments, tokens=tokens, words=words[:MAX_WORDS]))


def _words(result: Any, offset: float, length: float) -> list[Word]:
    """A window's words, in seconds from the start of the audio.

    NOTE: the pipeline times words within the window, which it pads to 30 s; a time past the
    window's own audio is in that padding, so it is held at the window's end.
    """
    found: list[Word] = []
    for timing in result.words or []:
        text = str(timing.word).strip().strip(PUNCTUATION)
        if not text:
            continue
        start = min(max(float(timing.start_ts), 0.0), length)
        end = min(max(float(timing.end_ts), start), length)
        found.append(Word(word=text, start=round(offset + start, 2),
                          end=round(offset + end, 2)))
    return found
