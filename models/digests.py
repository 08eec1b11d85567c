"""sha256 digests of model files, kept in a small JSON cache keyed by each file's stat (path,
size, mtime, inode, ctime), so a model's files are hashed once per change, not once per start.

The model cache's record (`<model cache>/digests.json`) serves both /api/show's digests
(models/facts.py) and the key of a GGUF's converted IR (workers/gguf_ir.py): one hash of a
file for both. Entries whose file is gone or changed are dropped whenever it is written.
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
    # NOTE: 0 in records written before these were kept: such an entry is hashed again once.
    inode: int = 0
    ctime_ns: int = 0


class _CacheFile(msgspec.Struct):
    version: int = 1
    entries: dict[str, _CacheEntry] = msgspec.field(default_factory=dict)


# (resolved path, size, mtime_ns, inode, ctime_ns): a file rewritten in place keeps its path
# and may keep its size and (set back) mtime, but never its ctime; a copy has another inode.
StatKey = tuple[str, int, int, int, int]
_HASH_CHUNK = 4 * 1024 * 1024


def stat_key(path: Path) -> StatKey:
    """`path`'s StatKey (`path` resolved by the caller)."""
    st = path.stat()
    return (str(path), st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns)


def _entry_key(path: str, entry: _CacheEntry) -> StatKey:
    return (path, entry.size, entry.mtime_ns, entry.inode, entry.ctime_ns)


def _unchanged(key: StatKey) -> bool:
    """Whether the file of a recorded StatKey is still there, as it was."""
    try:
        return stat_key(Path(key[0])) == key
    except OSError:
        return False


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's content, read in chunks."""
    # NOTE: not hashlib.file_digest, which needs Python 3.11 (the project supports 3.10).
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


class DigestCache:
    """sha256 of files keyed by their StatKey, in memory and, when given a `cache_dir`, in
    `<cache_dir>/digests.json` so a restart does not re-hash. Thread-safe."""

    FILE_NAME = "digests.json"

    def __init__(self, cache_dir: Path | None = None) -> None:
        self.cache_file = cache_dir / self.FILE_NAME if cache_dir is not None else None
        self._memory: dict[StatKey, str] = {}
        self._lock = threading.Lock()

    def file_sha256(self, path: Path) -> str:
        """Hex sha256 of `path`'s content, hashed at most once per StatKey (a change, a copy)."""
        key = stat_key(path.resolve())
        with self._lock:
            if (hit := self._memory.get(key)) is not None:
                return hit
            if (hit := self._from_disk(key)) is not None:
                self._memory[key] = hit
                return hit
        hex_digest = sha256_file(Path(key[0]))
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
        if entry is not None and _entry_key(key[0], entry) == key:
            return entry.sha256
        return None

    def recorded(self) -> dict[str, str]:
        """The record on disk: digest by resolved path, whether or not the file still is."""
        return {path: entry.sha256 for path, entry in self._load().entries.items()}

    def live(self) -> dict[str, str]:
        """The record's entries whose file is still there as it was hashed (a stat each)."""
        return {path: entry.sha256 for path, entry in self._load().entries.items()
                if _unchanged(_entry_key(path, entry))}

    def _to_disk(self, key: StatKey, hex_digest: str) -> None:
        if self.cache_file is None:
            return
        import filelock

        # NOTE: re-read before writing, under a lock shared by every process of this cache, so
        # entries other processes add meanwhile are kept: a lost entry makes the IR prune
        # (workers/gguf_ir.py) judge a folder in use by the file its COMPLETE names alone.
        try:
            self.cache_file.parent.mkdir(parents=True, exist_ok=True)
            with filelock.FileLock(f"{self.cache_file}.lock", timeout=30):
                self._write(self.cache_file, key, hex_digest)
        except (filelock.Timeout, OSError) as exc:
            logger.warning(
                "cannot write digest cache", extra={"path": str(self.cache_file), "error": str(exc)}
            )

    def _write(self, cache_file: Path, key: StatKey, hex_digest: str) -> None:
        data = self._load()
        # NOTE: bounded: an entry whose file is gone or changed can never be hit again.
        data.entries = {path: entry for path, entry in data.entries.items()
                        if path != key[0] and _unchanged(_entry_key(path, entry))}
        data.entries[key[0]] = _CacheEntry(key[1], key[2], hex_digest, key[3], key[4])
        tmp = cache_file.with_name(f"{self.FILE_NAME}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            tmp.write_bytes(msgspec.json.encode(data))
            os.replace(tmp, cache_file)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise

    def folder_sha256(self, folder: Path, files: list[Path]) -> str:
        """Hex sha256 of a manifest: one `<relative path>\\t<size>\\t<sha256>` line per file."""
        lines = [
            f"{f.relative_to(folder).as_posix()}\t{f.stat().st_size}\t{self.file_sha256(f)}\n"
            for f in files
        ]
        return hashlib.sha256("".join(lines).encode()).hexdigest()
