"""sha256 digests of model files, kept in a small JSON cache keyed by size and mtime, so a
model's files are hashed once per change, not once per start.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path

import msgspec

logger = logging.getLogger(__name__)


class _CacheEntry(msgspec.Struct):
    size: int
    mtime_ns: int
    sha256: str


class _CacheFile(msgspec.Struct):
    version: int = 1
    entries: dict[str, _CacheEntry] = msgspec.field(default_factory=dict)


StatKey = tuple[str, int, int]
_HASH_CHUNK = 4 * 1024 * 1024


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's content, read in chunks."""
    # NOTE: not hashlib.file_digest, which needs Python 3.11 (the project supports 3.10).
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


class DigestCache:
    """sha256 of files keyed by (absolute path, size, mtime_ns), in memory and, when given a
    `cache_dir`, in `<cache_dir>/digests.json` so a restart does not re-hash. Thread-safe."""

    FILE_NAME = "digests.json"

    def __init__(self, cache_dir: Path | None = None) -> None:
        self.cache_file = cache_dir / self.FILE_NAME if cache_dir is not None else None
        self._memory: dict[StatKey, str] = {}
        self._lock = threading.Lock()

    def file_sha256(self, path: Path) -> str:
        """Hex sha256 of `path`'s content, hashed at most once per (path, size, mtime)."""
        path = path.resolve()
        st = path.stat()
        key = (str(path), st.st_size, st.st_mtime_ns)
        with self._lock:
            if (hit := self._memory.get(key)) is not None:
                return hit
            if (hit := self._from_disk(key)) is not None:
                self._memory[key] = hit
                return hit
        hex_digest = sha256_file(path)
        logger.debug("hashed model file", extra={"path": key[0], "size": key[1]})
        with self._lock:
            self._memory[key] = hex_digest
            self._to_disk(key, hex_digest)
        return hex_digest

    def _load(self) -> _CacheFile:
        if self.cache_file is None:
            return _CacheFile()
        try:
            return msgspec.json.decode(self.cache_file.read_bytes(), type=_CacheFile)
        except FileNotFoundError:
            return _CacheFile()
        except (OSError, msgspec.DecodeError) as exc:
            logger.warning(
                "ignoring digest cache", extra={"path": str(self.cache_file), "error": str(exc)}
            )
            return _CacheFile()

    def _from_disk(self, key: StatKey) -> str | None:
        entry = self._load().entries.get(key[0])
        if entry is not None and (entry.size, entry.mtime_ns) == key[1:]:
            return entry.sha256
        return None

    def _to_disk(self, key: StatKey, hex_digest: str) -> None:
        if self.cache_file is None:
            return
        # NOTE: re-read before writing so entries added by another process are kept.
        data = self._load()
        data.entries[key[0]] = _CacheEntry(key[1], key[2], hex_digest)
        tmp = self.cache_file.with_name(
            f"{self.FILE_NAME}.{os.getpid()}.{threading.get_ident()}.tmp"
        )
        try:
            self.cache_file.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_bytes(msgspec.json.encode(data))
            os.replace(tmp, self.cache_file)
        except OSError as exc:
            logger.warning(
                "cannot write digest cache", extra={"path": str(self.cache_file), "error": str(exc)}
            )
            tmp.unlink(missing_ok=True)

    def folder_sha256(self, folder: Path, files: list[Path]) -> str:
        """Hex sha256 of a manifest: one `<relative path>\\t<size>\\t<sha256>` line per file."""
        lines = [
            f"{f.relative_to(folder).as_posix()}\t{f.stat().st_size}\t{self.file_sha256(f)}\n"
            for f in files
        ]
        return hashlib.sha256("".join(lines).encode()).hexdigest()
