"""The tts engine: one Piper (VITS) voice compiled by OpenVINO, speaking one request at a time.

The voice is an ONNX file with its `.onnx.json` (sample rate, espeak-ng voice, inference
scales, phoneme id map); OpenVINO reads the ONNX directly. Text is phonemized by espeak-ng
sentence by sentence (workers/speech/phonemes.py); each sentence is one inference whose audio
is sent at once as a `SpeechChunk` (mono int16), so the gateway can stream it while the next
sentence is made; a `Speech` frame ends the request.

Inputs of Piper's export: `input` (ids, [1, n]), `input_lengths` ([n]), `scales`
([noise_scale, length_scale, noise_w]) and, for voices with several speakers, `sid`.

The same text, voice and speed give the same audio: VITS samples its noise inside the graph
(RandomNormalLike, which OpenVINO turns into RandomUniform pairs), and `fix_noise` seeds it.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import openvino as ov

from npu_proxy.protocol.config import WorkerSpec
from npu_proxy.protocol.messages import ErrorCode
from npu_proxy.protocol.speech import Speech, SpeechChunk, Synthesize
from npu_proxy.protocol.timings import Timings
from npu_proxy.workers.engine import Emit
from npu_proxy.workers.speech.phonemes import Phonemizer, phoneme_ids
from npu_proxy.workers.speech.serial_base import Cancelled, SerialSpeechEngine

log = logging.getLogger(__name__)


class Voice:
    """A Piper voice's `.onnx.json`: what the engine needs of it."""

    def __init__(self, onnx: Path) -> None:
        config_path = onnx.with_name(onnx.name + ".json")
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise RuntimeError(f"the voice's config {config_path} cannot be read: {exc}"
                               ) from exc
        self.sample_rate = int(config["audio"]["sample_rate"])
        self.espeak_voice = str(config.get("espeak", {}).get("voice", "en-us"))
        inference = config.get("inference", {})
        self.noise_scale = float(inference.get("noise_scale", 0.667))
        self.length_scale = float(inference.get("length_scale", 1.0))
        self.noise_w = float(inference.get("noise_w", 0.8))
        self.speakers = int(config.get("num_speakers", 1))
        self.id_map: dict[str, list[int]] = config["phoneme_id_map"]


NOISE_SEED = 22050  # any fixed number; each random node gets its own seed from it
# NOTE: one inference's phonemes: 4,096 emoji (16 KB) are one sentence of some 60,000
# phonemes when espeak-ng reads their names, which took the worker past 6 GiB in one
# inference (issue 43). A sentence is spoken in pieces of at most 400 phonemes (some 30 s),
# cut between words; a request's are bounded by max_speech_phonemes.
PIECE_PHONEMES = 400


def fix_noise(model: ov.Model) -> int:
    """Make the graph's noise the same on every inference; returns the random nodes fixed.

    NOTE: ONNX's RandomNormalLike arrives as Box-Muller over two RandomUniform nodes with
    seeds 0/0 (a new sequence per run) and TensorFlow's Philox alignment, whose counter the
    CPU plugin carries from one inference to the next even when seeded, so a seed alone only
    repeats the first sentence after a compile. With PyTorch's alignment the plugin starts
    its Mersenne Twister from `global_seed` on every inference (`op_seed` is unused there):
    each node needs a seed of its own, or a Box-Muller pair draws the same numbers twice."""
    nodes = [op for op in model.get_ops() if op.get_type_name() == "RandomUniform"]
    for index, node in enumerate(nodes):
        node.set_attribute("alignment", "pytorch")
        node.set_attribute("global_seed", NOISE_SEED + index)
        node.set_attribute("op_seed", NOISE_SEED + index)
    return len(nodes)


def pieces(sentence: list[str], most: int = PIECE_PHONEMES) -> list[list[str]]:
    """A sentence's phonemes in pieces of at most `most`, cut after a space where there is
    one in the second half of a piece."""
    out = []
    while len(sentence) > most:
        cut = next((i + 1 for i in range(most - 1, most // 2, -1) if sentence[i] == " "), most)
        out.append(sentence[:cut])
        sentence = sentence[cut:]
    return [*out, sentence] if sentence else out


def to_int16(audio: np.ndarray[Any, Any]) -> bytes:
    """Piper's conversion: each sentence scaled to full range, then 16-bit.
    NOTE: VITS output has no fixed level; Piper normalises every sentence the same way."""
    peak = max(0.01, float(np.max(np.abs(audio))) if audio.size else 0.01)
    scaled = np.clip(audio * (32767.0 / peak), -32767, 32767)
    return scaled.astype("<i2").tobytes()


class TtsEngine(SerialSpeechEngine[Synthesize]):
    serves = Synthesize
    refusal = "only synthesizes speech"
    task = "speech"

    def __init__(self, spec: WorkerSpec, model_path: str, emit: Emit,
                 max_phonemes: int = 16_384) -> None:
        super().__init__(spec, emit)
        self.max_phonemes = max_phonemes
        self.model_path = Path(model_path)
        self.voice: Voice | None = None
        self.phonemizer: Phonemizer | None = None
        self.request: Any = None  # ov.InferRequest

    def load(self, properties: dict[str, Any]) -> None:
        voice = Voice(self.model_path)
        self.phonemizer = Phonemizer(voice.espeak_voice)
        core = ov.Core()
        model = core.read_model(str(self.model_path))
        log.info("tts: %d random nodes seeded", fix_noise(model))
        # NOTE: on CPUs with AMX/AVX512-BF16 the CPU plugin runs bf16 by default; then the
        # duration predictor's exp() now and then overflows and the Range node that expands
        # the durations fails (1 request in 60 here). f32 never did, and was not slower.
        properties = {"INFERENCE_PRECISION_HINT": "f32", **properties}
        compiled = core.compile_model(model, self.spec.device, properties)
        self.request = compiled.create_infer_request()
        self.voice = voice

    def warm_up(self) -> None:
        self._infer(phoneme_ids(["h", "a"], self._voice().id_map), 1.0)

    # --- one request ---------------------------------------------------------------------

    def _voice(self) -> Voice:
        if self.voice is None:
            raise RuntimeError("the voice is not loaded")
        return self.voice

    def _infer(self, ids: list[int], speed: float) -> np.ndarray[Any, Any]:
        voice = self._voice()
        inputs: dict[str, Any] = {
            "input": np.array([ids], dtype=np.int64),
            "input_lengths": np.array([len(ids)], dtype=np.int64),
            "scales": np.array([voice.noise_scale, voice.length_scale / speed, voice.noise_w],
                               dtype=np.float32)}
        if voice.speakers > 1:
            inputs["sid"] = np.array([0], dtype=np.int64)
        result = self.request.infer(inputs)
        return np.asarray(result[self.request.model_outputs[0]]).reshape(-1)

    def _serve(self, arrived: float, req: Synthesize) -> None:
        voice = self._voice()
        if not 0.25 <= req.speed <= 4.0:
            raise Cancelled(ErrorCode.BAD_REQUEST, "speed must be between 0.25 and 4.0")
        started = time.time()
        assert self.phonemizer is not None
        sentences = self.phonemizer.sentences(req.text)
        total = sum(len(sentence) for sentence in sentences)
        if total > self.max_phonemes:
            raise Cancelled(ErrorCode.BAD_REQUEST,
                            f"the input is {total} phonemes when spoken, more than "
                            f"{self.max_phonemes} (max_speech_phonemes): send it in parts")
        samples = phonemes = 0
        for sentence in (piece for whole in sentences for piece in pieces(whole)):
            self._check(req)
            ids = phoneme_ids(sentence, voice.id_map)
            audio = self._infer(ids, req.speed)
            self.progress_at = time.monotonic()
            self.faults.on_tokens(1)
            self._check(req)
            samples += audio.size
            phonemes += len(ids)
            self.emit(SpeechChunk(id=req.id, seq=self._next(), pcm=to_int16(audio),
                                  sample_rate=voice.sample_rate))
        self.served += 1
        done = time.time()
        self.emit(Speech(id=req.id, seq=self._next(), sample_rate=voice.sample_rate,
                         samples=samples, phonemes=phonemes,
                         timings=Timings(queue_ns=int((started - arrived) * 1e9),
                                         decode_ns=int((done - started) * 1e9),
                                         total_ns=int((done - arrived) * 1e9))))
