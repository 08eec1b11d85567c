"""Where a worker's model files are: embedded defaults, pulled models in the model cache,
`[models]` entries with a local path, local paths."""

from __future__ import annotations

from pathlib import Path

from models.registry import (
    ModelSourceMissing,
    alias_table,
    embedded,
    normalize,
    package_file,
)
from models.store import ModelStore
from protocol.config import Config, WorkerSpec


def model_path(config: Config, spec: WorkerSpec) -> Path:
    """The file or folder the worker loads, preparing embedded defaults on first use."""
    name = alias_table(config.model_aliases).get(normalize(spec.model_name), spec.model_name)
    entry = embedded(name)
    if entry is not None and entry.package:
        return package_file(entry.package, entry.package_file)
    if entry is not None and entry.kind == "embed":
        from workers.embed_model import ensure_minilm_ir

        return ensure_minilm_ir(config.model_cache_path() / "all-minilm-l6-v2")
    store = ModelStore(config.model_cache_path())
    key = normalize(name)
    pulled = store.get(store.aliases().get(key, key))
    if pulled is not None:
        return store.entry_path(pulled)
    for user_name, source in config.models.items():
        if source.path and normalize(user_name) == key:
            return Path(source.path).expanduser()
    path = Path(spec.model_name).expanduser()
    if path.exists():
        return path
    raise ModelSourceMissing(f"model {spec.model_name!r} is not available locally")

