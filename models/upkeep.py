"""Keeping the model cache in bounds: what it holds (`usage`), its quota (`room`,
`max_cache_bytes`), leftovers cleaned at start (`clean_leftovers`) and blobs no model uses
pruned (`prune_blobs`).

The layout is models/store.py's. A pull's staging folder (`.staging/<folder>/`) is kept at
start, since the next pull of that model resumes from it; an upload's `.partial` file cannot
be resumed (once nothing has written to it for an hour: another instance sharing the cache may
be receiving it), and the trash of a delete or a replaced install (`deleted-*`, `old-*`) is what an
interrupted removal left behind.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from pathlib import Path

from npu_proxy.models.store import BLOBS, GGUF_IR, STAGING, ModelStore

log = logging.getLogger(__name__)

# NOTE: Ollama's clients upload a blob and then call /api/create; a blob younger than this is
# an upload whose create may still come, so it is not pruned yet.
BLOB_GRACE = 3600.0
# NOTE: an upload's partial file written to within this many seconds may be another instance's
# upload in progress (instances behind a balancer share a model cache): not a leftover yet.
UPLOAD_GRACE = 3600.0


# NOTE: what the workers derive and can rebuild (OpenVINO's compile cache, GGUFs converted to
# IR) is not counted: the quota is for what clients bring in, pulls and uploads.
DERIVED = ("ov_cache", GGUF_IR)


class QuotaExceeded(Exception):
    """What a pull or an upload would add does not fit `max_cache_bytes`."""


def usage(root: Path, skip: Path | None = None) -> int:
    """Bytes of the files under `root` (links not followed, hard links counted once),
    leaving out the folder `skip` and the DERIVED ones."""
    total = 0
    seen: set[tuple[int, int]] = set()
    left_out = {root / name for name in DERIVED} | ({skip} if skip is not None else set())
    stack = [root]
    while stack:
        folder = stack.pop()
        if folder in left_out:
            continue
        with contextlib.suppress(OSError), os.scandir(folder) as entries:
            for entry in entries:
                with contextlib.suppress(OSError):
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(Path(entry.path))
                    elif entry.is_file(follow_symlinks=False):
                        st = entry.stat(follow_symlinks=False)
                        if st.st_nlink > 1:
                            if (st.st_dev, st.st_ino) in seen:
                                continue
                            seen.add((st.st_dev, st.st_ino))
                        total += st.st_size
    return total


def room(root: Path, quota: int, skip: Path | None = None) -> int | None:
    """Bytes the cache may still take under `quota` (None: no quota)."""
    if quota <= 0:
        return None
    return max(quota - usage(root, skip), 0)


def check_room(root: Path, quota: int, need: int, what: str, skip: Path | None = None) -> None:
    """A QuotaExceeded naming the setting when `need` more bytes do not fit."""
    left = room(root, quota, skip)
    if left is not None and need > left:
        raise QuotaExceeded(
            f"{what} needs {need} bytes, but the model cache has {left} of its {quota} bytes "
            "left (max_cache_bytes); delete models or raise the quota")


def clean_leftovers(root: Path, grace: float = UPLOAD_GRACE) -> list[str]:
    """Remove upload `.partial` files not written to for `grace` seconds and the trash of
    interrupted removals; returns their names. Pull staging folders stay (a pull resumes from
    them)."""
    removed = []
    cutoff = time.time() - grace
    with contextlib.suppress(OSError):
        for entry in (root / STAGING).iterdir():
            name = entry.name
            upload = name.startswith("upload-") and name.endswith(".partial")
            with contextlib.suppress(OSError):
                if upload and entry.stat().st_mtime >= cutoff:
                    continue
            if upload or name.startswith(("deleted-", "old-")):
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
                removed.append(name)
    if removed:
        log.info("model cache: removed %d leftover file(s) of interrupted uploads and "
                 "removals", len(removed))
    return removed


def prune_blobs(store: ModelStore, grace: float = BLOB_GRACE) -> list[str]:
    """Remove blobs no created model uses (older than `grace` seconds); returns their names."""
    used = {store.blob_path(r.blob).name for r in store.created().values() if r.blob}
    cutoff = time.time() - grace
    removed = []
    with contextlib.suppress(OSError):
        for entry in (store.root / BLOBS).iterdir():
            with contextlib.suppress(OSError):
                if entry.name not in used and entry.is_file() and \
                        entry.stat().st_mtime < cutoff:
                    entry.unlink()
                    removed.append(entry.name)
    if removed:
        log.info("model cache: pruned %d blob(s) no model uses", len(removed))
    return removed


def tidy(store: ModelStore) -> None:
    """At start: leftovers cleaned, unused blobs pruned."""
    clean_leftovers(store.root)
    prune_blobs(store)
