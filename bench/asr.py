"""Real-time factor of speech to text on CPU: seconds of work per second of audio, through the
server (POST /v1/audio/transcriptions) and with the in-process WhisperPipeline.

    python bench/asr.py [--url URL] [--rounds 3] [--seconds 3 30 60]

Without --url a private server is started with one asr worker (the embedded Whisper tiny.en,
built into the test model cache first if missing, as tests/test_audio.py does). The audio is
espeak-ng speaking a sentence, repeated with pauses up to each length, sent as WAV. Both sides
take turns per round, so load from other processes falls on both alike; the figures are
medians over the rounds. RTF < 1 is faster than real time; HTTP / in-process is the server's
cost (upload, decoding, resampling, the worker hop).
"""

from __future__ import annotations

import argparse
import io
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import openvino_genai as ov_genai
import soundfile
from _rtf import rtf_table
from serverctl import MODEL_CACHE, Server

from npu_proxy.gateway.content.audio import AudioLimits, decode
from npu_proxy.models.locate import WHISPER_IR_FOLDER

SENTENCE = "Hello world. The capital of France is Paris. The weather is fine today."
RATE = 16_000


def speech(seconds: float) -> bytes:
    """A WAV of espeak-ng's sentence, repeated with a short pause, `seconds` long."""
    espeak = shutil.which("espeak-ng")
    if espeak is None:
        sys.exit("espeak-ng is not installed (Debian package espeak-ng)")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "s.wav"
        subprocess.run([espeak, "-w", str(out), SENTENCE], check=True)
        one = decode(out.read_bytes(), AudioLimits(1 << 30, 3600)).samples
    unit = np.concatenate([one, np.zeros(RATE // 2, np.float32)])
    reps = int(np.ceil(seconds * RATE / len(unit)))
    samples = np.tile(unit, reps)[:int(seconds * RATE)]
    buffer = io.BytesIO()
    soundfile.write(buffer, samples, RATE, format="WAV", subtype="PCM_16")
    return buffer.getvalue()


def in_process(pipe: ov_genai.WhisperPipeline, data: bytes) -> float:
    started = time.perf_counter()
    samples = decode(data, AudioLimits(1 << 30, 3600)).samples
    window = 30 * RATE
    for at in range(0, len(samples), window):
        pipe.generate(samples[at:at + window])
    return time.perf_counter() - started


def over_http(url: str, data: bytes) -> float:
    started = time.perf_counter()
    r = httpx.post(url + "/v1/audio/transcriptions", files={"file": ("a.wav", data)},
                   data={"model": "whisper-1"}, timeout=600)
    r.raise_for_status()
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, nargs="+", default=[3.0, 30.0, 60.0])
    args = parser.parse_args()
    folder = MODEL_CACHE / WHISPER_IR_FOLDER
    from npu_proxy.workers.speech.whisper_ir import ensure_whisper_ir

    ensure_whisper_ir(folder)
    server = None
    url = args.url
    if url is None:
        server = Server(Path(tempfile.mkdtemp(prefix="bench-asr-")),
                        workers=[{"name": "asr", "role": "asr"}]).start()
        url = server.url
    try:
        pipe = ov_genai.WhisperPipeline(str(folder), "CPU")
        audio = {seconds: speech(seconds) for seconds in args.seconds}
        rtf_table(args.seconds, args.rounds,
                  lambda seconds: (over_http(url, audio[seconds]), seconds),
                  lambda seconds: (in_process(pipe, audio[seconds]), seconds))
    finally:
        if server is not None:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
