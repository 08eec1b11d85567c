"""The model cache on disk: pulled models, their manifests, and the alias store.

Layout under `Config.model_cache_path()`:
- `<folder>/` one pulled model, `<folder>` being its canonical name with `/` -> `+` and
  `:` -> `@` (characters no model name contains, so two names never share a folder);
  `<folder>/.npu-proxy-manifest.json` records name, source, files and digests. A folder
  without a manifest is not a model.
- `.staging/<folder>/` a pull in progress (partial files end in `.incomplete`); renamed into
  place only when every file is complete and verified, so a partial pull is never listed.
- `aliases.json` names made by /api/copy: alias -> canonical name, no files copied.
- `created/<folder>.json` a model made by /api/create (models/created.py), and
  `created/<folder>.gguf` its weights when it has its own: a hard link to its blob.
- `blobs/sha256-<hex>` files uploaded for /api/create (models/blobs.py); an upload in
  progress is a `.staging/upload-*.partial` file until its digest is verified.

Pure stdlib and msgspec, so the gateway, the workers and the CLI all read the same store.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path

import msgspec

from npu_proxy.models.blobs import parse_digest
from npu_proxy.models.created import CreatedModel
from npu_proxy.models.digests import DigestCache
from npu_proxy.models.portable import path_problem
from npu_proxy.models.registry import ModelNameError, canonical

log = logging.getLogger(__name__)

MANIFEST = ".npu-proxy-manifest.json"
STAGING = ".staging"
ALIASES = "aliases.json"
# GGUF models converted to OpenVINO IR once, so that restarts skip the conversion; a folder
# per GGUF content, whose CONVERTED_FROM file names the GGUF it was converted from and that
# file's sha256 (see workers/gguf_ir.py).
GGUF_IR = ".gguf-ir"
CONVERTED_FROM = "converted-from.txt"
CREATED = "created"
BLOBS = "blobs"


class ManifestFile(msgspec.Struct, omit_defaults=True):
    path: str  # relative to the model folder, `/`-separated
    size: int
    sha256: str = ""  # hex, when the hub gave it (LFS files) or it was computed
    git_oid: str = ""  # the hub's git blob id (sha1), for files stored in git


class Manifest(msgspec.Struct, omit_defaults=True):
    name: str  # canonical: `[namespace/]name:tag`
    kind: str  # "llm", "vlm" (text generation that also takes images) or "embed"
    format: str  # "gguf" or "openvino"
    source: str  # what was pulled, e.g. "hf.co/OpenVINO/TinyLlama-1.1B-Chat-v1.0-int4-ov"
    files: list[ManifestFile]
    repo: str = ""
    revision: str = ""
    commit: str = ""
    # What a worker loads, relative to the folder: a .gguf file, or "" for the IR folder.
    entry: str = ""
    npu_ready: bool = False
    pulled_at: float = 0.0

    @property
    def size(self) -> int:
        return sum(f.size for f in self.files)


class StoreError(Exception):
    pass


def folder_name(name: str) -> str:
    """The folder of a canonical name; refuses anything that is not one."""
    if canonical(name) != name:
        raise ModelNameError(f"not a canonical model name: {name!r}")
    return name.replace("/", "+").replace(":", "@")


def safe_relative(path: str) -> bool:
    """A repository file path that stays inside the folder it is written to, and names the
    same file on every platform (models/portable.py: no device names, streams, ...)."""
    if not path or path.startswith(("/", "\\")) or "\\" in path or "\x00" in path:
        return False
    if len(path) > 2 and path[1] == ":":
        return False  # a drive letter
    parts = path.split("/")
    return all(p not in ("", ".", "..") for p in parts) and path_problem(path) is None


def inside(root: Path, path: Path) -> bool:
    """`path` (symlinks resolved) is `root` or below it."""
    try:
        path.resolve().relative_to(root.resolve())
    except ValueError:
        return False
    return True


def converted_from(ir: Path) -> tuple[Path, str] | None:
    """The GGUF a converted folder was made from and its sha256 ("" for a folder made before
    the folders were keyed by content); None while the folder is not complete."""
    try:
        lines = (ir / CONVERTED_FROM).read_text().splitlines()
    except OSError:
        return None
    return (Path(lines[0]), lines[1] if len(lines) > 1 else "") if lines else None


def _mtime(path: str) -> int:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return 0


class ModelStore:
    """Pulled models and aliases of one cache folder, re-read only when it changed."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._seen: tuple[int, int, int] | None = None
        # Counts re-reads, so callers can cache what they derive from the store.
        self._version = 0
        self._manifests: dict[str, Manifest] = {}
        self._aliases: dict[str, str] = {}
        self._created: dict[str, CreatedModel] = {}
        # NOTE: what _stamp() looks at, as strings: every request resolves a model name and
        # so stats these three; building the paths each time cost more than the stats.
        self._watched = (str(root), str(root / ALIASES), str(root / CREATED))

    # --- paths ---------------------------------------------------------------------------

    def model_dir(self, name: str) -> Path:
        return self.root / folder_name(name)

    def staging_dir(self, name: str) -> Path:
        return self.root / STAGING / folder_name(name)

    def lock_path(self, name: str) -> Path:
        return self.root / STAGING / f"{folder_name(name)}.lock"

    def blob_path(self, digest: str) -> Path:
        """Where the blob `sha256:<hex>` is kept; a BlobError for anything not a digest."""
        return self.root / BLOBS / f"sha256-{parse_digest(digest)}"

    def created_path(self, name: str, suffix: str = ".json") -> Path:
        """A created model's record (`.json`) or its own weights (`.gguf`)."""
        return self.root / CREATED / f"{folder_name(name)}{suffix}"

    def entry_path(self, manifest: Manifest) -> Path:
        """The file or folder a worker loads; refuses a path that leaves the cache."""
        folder = self.model_dir(manifest.name)
        path = folder / manifest.entry if manifest.entry else folder
        if not safe_relative(manifest.entry or "x") or not inside(folder, path) \
                or folder.is_symlink():
            raise StoreError(f"model {manifest.name}: {path} is outside the model cache")
        return path

    # --- reading -------------------------------------------------------------------------

    def _stamp(self) -> tuple[int, int, int]:
        root, aliases, created = (_mtime(path) for path in self._watched)
        return root, aliases, created

    def _refresh(self) -> None:
        stamp = self._stamp()
        if stamp == self._seen:
            return
        self._seen = stamp
        self._version += 1
        manifests: dict[str, Manifest] = {}
        with contextlib.suppress(OSError):
            for folder in self.root.iterdir():
                if folder.name.startswith(".") or folder.is_symlink() or not folder.is_dir():
                    continue
                found = self._read_manifest(folder)
                if found is not None:
                    manifests[found.name] = found
        self._manifests = manifests
        try:
            raw = msgspec.json.decode((self.root / ALIASES).read_bytes(), type=dict[str, str])
        except (OSError, msgspec.DecodeError):
            raw = {}
        self._aliases = raw
        self._created = self._read_created()

    def _read_created(self) -> dict[str, CreatedModel]:
        found: dict[str, CreatedModel] = {}
        with contextlib.suppress(OSError):
            for path in (self.root / CREATED).glob("*.json"):
                if path.is_symlink() or not path.is_file():
                    continue
                try:
                    record = msgspec.json.decode(path.read_bytes(), type=CreatedModel)
                    if f"{folder_name(record.name)}.json" != path.name:
                        raise StoreError(f"the record names {record.name!r}")
                except (OSError, msgspec.DecodeError, ModelNameError, StoreError) as exc:
                    log.warning("ignoring created model %s: %s", path, exc)
                    continue
                found[record.name] = record
        return found

    def _read_manifest(self, folder: Path) -> Manifest | None:
        path = folder / MANIFEST
        if not path.is_file() or path.is_symlink():
            return None
        try:
            found = msgspec.json.decode(path.read_bytes(), type=Manifest)
            if folder_name(found.name) != folder.name:
                raise StoreError(f"manifest names {found.name!r}")
        except (OSError, msgspec.DecodeError, ModelNameError, StoreError) as exc:
            log.warning("ignoring model folder %s: %s", folder, exc)
            return None
        return found

    def version(self) -> int:
        """Changes whenever the store's contents may have changed (after a re-read)."""
        self._refresh()
        return self._version

    def manifests(self) -> dict[str, Manifest]:
        self._refresh()
        return dict(self._manifests)

    def get(self, name: str) -> Manifest | None:
        self._refresh()
        return self._manifests.get(name)

    def aliases(self) -> dict[str, str]:
        self._refresh()
        return dict(self._aliases)

    def created(self) -> dict[str, CreatedModel]:
        """Models made by /api/create, by canonical name."""
        self._refresh()
        return dict(self._created)

    def weights_path(self, record: CreatedModel) -> Path:
        """The GGUF file a created model with its own weights runs."""
        path = self.created_path(record.name, ".gguf")
        if path.is_symlink() or not inside(self.root / CREATED, path):
            raise StoreError(f"model {record.name}: {path} is outside the model cache")
        return path

    # --- writing -------------------------------------------------------------------------

    def install(self, staging: Path, manifest: Manifest) -> Path:
        """Write the manifest into a complete staging folder and rename it into place."""
        (staging / MANIFEST).write_bytes(msgspec.json.format(msgspec.json.encode(manifest)))
        target = self.model_dir(manifest.name)
        old = None
        if target.exists() or target.is_symlink():
            old = self.root / STAGING / f"old-{uuid.uuid4().hex[:8]}"
            os.replace(target, old)
        os.replace(staging, target)
        if old is not None:
            _remove(old)
        # NOTE: a copy (/api/copy) made onto this name before it was pulled would shadow the
        # pulled model for ever; as in Ollama, where a pull overwrites a copy, the pull wins.
        self.remove_alias(manifest.name)
        self._seen = None
        return target

    def remove(self, name: str) -> bool:
        """Delete a pulled model (and aliases pointing at it); False when there is none."""
        target = self.model_dir(name)
        if self.get(name) is None:
            return False
        trash = self.root / STAGING / f"deleted-{uuid.uuid4().hex[:8]}"
        trash.parent.mkdir(parents=True, exist_ok=True)
        os.replace(target, trash)  # NOTE: gone from listings at once, even if rmtree is slow
        _remove(trash)
        self._remove_converted(target)
        aliases = {a: t for a, t in self.aliases().items() if t != name}
        self._write_aliases(aliases)
        return True

    def _remove_converted(self, folder: Path) -> None:
        """Drop the IR converted from any GGUF file that was in `folder`, unless another GGUF
        file of the same content is still there (the model cache's digest record lists it)."""
        record = DigestCache(self.root)
        folder = folder.resolve()
        gone = {d for path, d in record.recorded().items() if inside(folder, Path(path))}
        live = set(record.live().values())
        with contextlib.suppress(OSError):
            for ir in (self.root / GGUF_IR).iterdir():
                made = converted_from(ir)
                if made is not None and made[1] not in live and (
                        inside(folder, made[0]) or made[1] in gone):
                    _remove(ir)

    def add_alias(self, alias: str, target: str) -> None:
        folder_name(alias)  # validates
        aliases = self.aliases()
        aliases[alias] = target
        self._write_aliases(aliases)

    def remove_alias(self, alias: str) -> bool:
        aliases = self.aliases()
        if aliases.pop(alias, None) is None:
            return False
        self._write_aliases(aliases)
        return True

    def add_created(self, record: CreatedModel,
                    before_copy: Callable[[int], None] | None = None) -> None:
        """Write a created model's record (replacing one of the same name); a model with its
        own weights gets them as a hard link to its blob (a copy where links fail, after
        `before_copy` was told the bytes it adds and raised nothing)."""
        folder = self.root / CREATED
        folder.mkdir(parents=True, exist_ok=True)
        old = self.created().get(record.name)
        tag = uuid.uuid4().hex[:8]
        if record.blob:
            weights = self.created_path(record.name, ".gguf")
            tmp = folder / f".{weights.name}.{tag}"
            try:
                try:
                    os.link(self.blob_path(record.blob), tmp)
                except OSError:
                    # NOTE: a cache (or its created/ folder) where links fail (another
                    # device, FAT, some network shares) takes a second copy of the weights,
                    # which the quota must allow like a pull or an upload.
                    if before_copy is not None:
                        before_copy(self.blob_path(record.blob).stat().st_size)
                    shutil.copyfile(self.blob_path(record.blob), tmp)
                os.replace(tmp, weights)
            finally:
                tmp.unlink(missing_ok=True)
        else:
            self.created_path(record.name, ".gguf").unlink(missing_ok=True)
        path = self.created_path(record.name)
        tmp = folder / f".{path.name}.{tag}"
        tmp.write_bytes(msgspec.json.format(msgspec.json.encode(record)))
        os.replace(tmp, path)
        self._seen = None
        if old is not None:
            self._prune(old.blob)

    def remove_created(self, name: str) -> bool:
        """Delete a created model, the aliases to it, and its blob once no model uses it."""
        record = self.created().get(name)
        if record is None:
            return False
        self.created_path(name).unlink(missing_ok=True)
        self.created_path(name, ".gguf").unlink(missing_ok=True)
        self._seen = None
        self._prune(record.blob)
        aliases = {a: t for a, t in self.aliases().items() if t != name}
        if aliases != self.aliases():
            self._write_aliases(aliases)
        return True

    def _prune(self, blob: str) -> None:
        """Delete a blob no created model uses any more (as Ollama prunes unused layers)."""
        if blob and all(r.blob != blob for r in self.created().values()):
            self.blob_path(blob).unlink(missing_ok=True)

    def _write_aliases(self, aliases: dict[str, str]) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / ALIASES
        tmp = path.with_name(f".{ALIASES}.{uuid.uuid4().hex[:8]}")
        tmp.write_bytes(msgspec.json.format(msgspec.json.encode(dict(sorted(aliases.items())))))
        os.replace(tmp, path)
        self._seen = None


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)
