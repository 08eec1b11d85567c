"""Blobs a client uploads for /api/create (Ollama's `POST /api/blobs/sha256:<hex>`).

An upload is written to a temporary file in the model cache's staging folder while its
sha256 is computed and its bytes counted; only a complete upload whose digest is the one
named is synced and renamed (atomically) to its place, `blobs/sha256-<hex>` (the layout is
models/store.py's). Anything else - a wrong digest, more bytes than the limit, a client gone
mid-way, a failed write - removes the temporary file, so a partial blob is never seen.

The digest in the URL is the only name a blob has: 64 hex digits after `sha256:` (or
Ollama's file spelling `sha256-`), nothing else, so it can never name a path.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

_DIGEST = re.compile(r"sha256[:-]([0-9a-fA-F]{64})")


class BlobError(Exception):
    """An upload or a blob reference refused, with the HTTP status to answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def parse_digest(digest: str) -> str:
    """The lower-case hex of `sha256:<64 hex>`; a BlobError (400) for anything else."""
    found = _DIGEST.fullmatch(digest) if isinstance(digest, str) else None
    if found is None:
        shown = digest[:80] if isinstance(digest, str) else type(digest).__name__
        raise BlobError(400, f"invalid digest {shown!r}: expected sha256:<64 hex digits>")
    return found.group(1).lower()


class BlobUpload:
    """One upload in progress. Blocking file work: call it from a thread, not an event loop."""

    def __init__(self, target: Path, staging: Path, hex_digest: str, limit: int,
                 setting: str = "max_blob_bytes") -> None:
        self.target = target
        self.hex = hex_digest
        self.limit = limit
        self.setting = setting  # the setting the limit comes from, for the 413's message
        self.size = 0
        self._hash = hashlib.sha256()
        staging.mkdir(parents=True, exist_ok=True)
        self.tmp = staging / f"upload-{hex_digest[:16]}-{os.urandom(6).hex()}.partial"
        self._file = self.tmp.open("xb")

    def write(self, data: bytes) -> None:
        self.size += len(data)
        if self.size > self.limit:
            raise BlobError(413, f"the blob is over {self.limit} bytes, the limit "
                                 f"({self.setting})")
        self._hash.update(data)
        self._file.write(data)

    def commit(self) -> Path:
        """Verify the digest and move the blob into place; the upload is over either way."""
        try:
            got = self._hash.hexdigest()
            if got != self.hex:
                raise BlobError(400, f"digest mismatch: the uploaded bytes have sha256:{got}, "
                                     f"not sha256:{self.hex}")
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self.target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(self.tmp, self.target)
        finally:
            self.discard()
        return self.target

    def discard(self) -> None:
        """Drop the temporary file (a no-op once committed)."""
        self._file.close()
        self.tmp.unlink(missing_ok=True)
