"""models/locate.py: one precedence order for where a model's files are."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from npu_proxy.models.locate import (
    MINILM_IR_FOLDER,
    NotLocated,
    Origin,
    locate,
    minilm_ir_folder,
)
from npu_proxy.models.registry import ModelSourceMissing
from npu_proxy.models.store import Manifest, ManifestFile, ModelStore
from npu_proxy.protocol.config import Config, ModelSource


def _config(tmp_path: Path, **fields: Any) -> Config:
    return Config(model_cache=str(tmp_path / "cache"), **fields)


def _pull(config: Config, name: str, entry: str = "model.gguf") -> Path:
    """A model in the store, as a pull leaves it."""
    store = ModelStore(config.model_cache_path())
    staging = store.staging_dir(name)
    staging.mkdir(parents=True)
    (staging / "model.gguf").write_bytes(b"GGUF")
    store.install(staging, Manifest(name=name, kind="llm", format="gguf", source="test",
                                    files=[ManifestFile(path="model.gguf", size=4)],
                                    entry=entry))
    return store.model_dir(name) / "model.gguf"


def test_embedded_models_by_any_name(tmp_path: Path) -> None:
    config = _config(tmp_path, model_aliases={"mine": "smollm2"})
    for name in ("smollm2", "SmolLM2:135m", "mine"):
        found = locate(config, name)
        assert found.origin is Origin.PACKAGED
        assert found.path.name.endswith(".gguf") and found.path.is_file()


def test_minilm_is_named_not_prepared(tmp_path: Path) -> None:
    config = _config(tmp_path)
    found = locate(config, "all-minilm")
    assert found.origin is Origin.EMBEDDED_IR
    assert found.path == minilm_ir_folder(config) == config.model_cache_path() / MINILM_IR_FOLDER
    assert not found.path.exists()


def test_pulled_before_configured_before_embedded(tmp_path: Path) -> None:
    own = tmp_path / "own.gguf"
    own.write_bytes(b"GGUF")
    config = _config(tmp_path, models={"smollm2:135m": ModelSource(path=str(own))})
    assert locate(config, "smollm2") == locate(config, "smollm2:135m")
    assert locate(config, "smollm2").origin is Origin.CONFIGURED
    assert locate(config, "smollm2").path == own
    pulled = _pull(config, "smollm2:135m")
    assert locate(config, "smollm2").path == pulled
    assert locate(config, "smollm2").origin is Origin.PULLED


def test_copied_names_and_local_paths(tmp_path: Path) -> None:
    config = _config(tmp_path)
    pulled = _pull(config, "tinyllama:1.1b")
    ModelStore(config.model_cache_path()).add_alias("tiny:latest", "tinyllama:1.1b")
    assert locate(config, "tiny").path == pulled
    local = tmp_path / "Local.gguf"
    local.write_bytes(b"GGUF")
    assert locate(config, str(local)).path == local
    assert locate(config, str(local)).origin is Origin.LOCAL


def test_missing_and_broken(tmp_path: Path) -> None:
    config = _config(tmp_path)
    with pytest.raises(NotLocated):
        locate(config, "nothing:here")
    _pull(config, "tinyllama:1.1b", entry="../escape.gguf")
    with pytest.raises(ModelSourceMissing) as broken:
        locate(config, "tinyllama:1.1b")
    assert not isinstance(broken.value, NotLocated)
