"""Where a model's files are: the one lookup the workers and the gateway both use.

`locate()` takes a model by any of its names: config aliases and then /api/copy aliases are
resolved first. The first of these that has the model wins:

1. a model pulled into the model cache (the store), or made by /api/create: its own GGUF
   file, or the files of the model it was made from (models/created.py);
2. a `[models]` entry of the config file with a local `path`;
3. an embedded default shipped as a file inside a PyPI package (SmolLM2's GGUF);
4. the embedded embedding model: its IR folder in the model cache, `MINILM_IR_FOLDER` (and
   the embedded reranker made from it, `MINILM_RERANK_FOLDER`), and the embedded Whisper's
   (`WHISPER_IR_FOLDER`);
5. a local file or folder named by the name itself.

What the user pulled or configured comes before the built-in defaults, so a name is never
quietly taken over by an embedded model the user meant to replace; a bare path comes last, as
a name that matched nothing else.

It never imports OpenVINO and never prepares anything, so the gateway may call it: the MiniLM
folder (4) is only named here, and built by the embedding worker that loads it
(workers/embed_engine.py with workers/embed_model.py), before it exists.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from pathlib import Path

from npu_proxy.models.registry import (
    ModelSourceMissing,
    alias_table,
    embedded,
    normalize,
    package_file,
)
from npu_proxy.models.store import ModelStore, StoreError
from npu_proxy.protocol.config import Config

# The folder in the model cache that the embedded all-MiniLM-L6-v2 is converted into.
MINILM_IR_FOLDER = "all-minilm-l6-v2"
# The folder the embedded reranker built from the same MiniLM files is converted into.
MINILM_RERANK_FOLDER = "all-minilm-l6-v2-rerank"
# The folder the embedded Whisper tiny.en is built into (workers/speech/whisper_ir.py).
WHISPER_IR_FOLDER = "whisper-tiny-en"
# The file a finished build of an embedded IR folder writes last: how long it took (JSON).
BUILD_RECORD = "npu_proxy_build.json"


def build_seconds(folder: Path) -> float | None:
    """How long the embedded IR in `folder` took to build, from its `BUILD_RECORD`."""
    try:
        seconds = json.loads((folder / BUILD_RECORD).read_text())["build_seconds"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return float(seconds) if isinstance(seconds, int | float) else None


class Origin(enum.Enum):
    """Which rule of `locate()` found the files."""

    PULLED = "pulled"
    CREATED = "created"
    CONFIGURED = "configured"
    PACKAGED = "packaged"
    # The embedded MiniLM's IR folder: may not exist yet; its worker builds it when loading.
    EMBEDDED_IR = "embedded-ir"
    LOCAL = "local"


class NotLocated(ModelSourceMissing):
    """No rule of `locate()` has the model (its other errors mean a rule's files are broken)."""


@dataclass(frozen=True)
class Location:
    path: Path
    origin: Origin


def minilm_ir_folder(config: Config) -> Path:
    """Where the embedded embedding model's IR folder is (or will be, once built)."""
    return config.model_cache_path() / MINILM_IR_FOLDER


def locate(config: Config, name: str, store: ModelStore | None = None,
           allow_path: bool = True) -> Location:
    """The file or folder of the model `name`, by the precedence in this module's docstring.

    `allow_path=False` leaves out rule 5 (a bare path): for names that come from a socket
    (the supervisor's `Load`), which may only name models the registry knows.

    `store` is the caller's ModelStore of the model cache, when it keeps one (it re-reads the
    cache only when it changed). Raises NotLocated when no rule has the model, and
    ModelSourceMissing when the rule that has it is broken (a pulled model whose entry leaves
    the cache, an embedded model whose package is not installed).
    """
    store = store if store is not None else ModelStore(config.model_cache_path())
    wanted = alias_table(config.model_aliases).get(normalize(name), name)
    key = normalize(wanted)
    key = store.aliases().get(key, key)
    manifest = store.get(key)
    if manifest is not None:
        try:
            return Location(store.entry_path(manifest), Origin.PULLED)
        except StoreError as exc:
            raise ModelSourceMissing(str(exc)) from exc
    created = store.created()
    record = created.get(key)
    if record is not None and record.base:
        if record.base in created:  # NOTE: never written so; a hand-edited record could loop
            raise ModelSourceMissing(f"model {name!r} is made from the created model "
                                     f"{record.base!r}, not from a model with files")
        return locate(config, record.base, store)
    if record is not None:
        try:
            return Location(store.weights_path(record), Origin.CREATED)
        except StoreError as exc:
            raise ModelSourceMissing(str(exc)) from exc
    for user_name, source in config.models.items():
        if source.path and normalize(user_name) == key:
            return Location(Path(source.path).expanduser(), Origin.CONFIGURED)
    entry = embedded(key)
    if entry is not None and entry.package:
        return Location(package_file(entry.package, entry.package_file), Origin.PACKAGED)
    if entry is not None and entry.kind == "embed":
        return Location(minilm_ir_folder(config), Origin.EMBEDDED_IR)
    if entry is not None and entry.kind == "rerank":
        return Location(config.model_cache_path() / MINILM_RERANK_FOLDER, Origin.EMBEDDED_IR)
    if entry is not None and entry.kind == "asr":
        return Location(config.model_cache_path() / WHISPER_IR_FOLDER, Origin.EMBEDDED_IR)
    path = Path(wanted).expanduser()
    if allow_path and path.exists():
        return Location(path, Origin.LOCAL)
    raise NotLocated(f"model {name!r} is not available locally")


def configured_template(config: Config, name: str) -> str:
    """The chat template a `[models."name"]` entry of the config sets in place of the model's
    own (`chat_template`), or "": the worker renders prompts with it and the gateway reads the
    model's capabilities from it."""
    key = normalize(alias_table(config.model_aliases).get(normalize(name), name))
    for user_name, source in config.models.items():
        if source.chat_template and normalize(user_name) == key:
            return source.chat_template
    return ""
