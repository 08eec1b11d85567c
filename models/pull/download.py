"""Downloading a planned pull's files: `.incomplete` files resumed with an HTTP Range
request, progress at most every 0.1 s per file, each file's size and digest verified.

NOTE: huggingface_hub 2.x deletes its own partial files on failure, so the transfer itself
is done here, with huggingface_hub's session, headers, URLs, metadata and errors.
"""

from __future__ import annotations

import hashlib
import threading
import time
from pathlib import Path

from npu_proxy.models.pull.plan import (
    OnProgress,
    Progress,
    PullCancelled,
    PullError,
    RemoteFile,
    hub_errors,
)
from npu_proxy.models.store import ManifestFile

CHUNK = 1 << 20
PROGRESS_EVERY = 0.1  # seconds between progress events of one file


class Reporter:
    """Progress of one file: `completed` only grows, events at most every 0.1 s."""

    def __init__(self, file: RemoteFile, on_progress: OnProgress,
                 cancel: threading.Event | None) -> None:
        self.file = file
        self.on_progress = on_progress
        self.cancel = cancel
        self.sent = -1
        self.sent_at = 0.0

    def __call__(self, completed: int, force: bool = False) -> None:
        if self.cancel is not None and self.cancel.is_set():
            raise PullCancelled("pull cancelled")
        completed = max(completed, self.sent)
        now = time.monotonic()
        if completed == self.sent and not force:
            return
        if force or completed >= self.file.size or now - self.sent_at >= PROGRESS_EVERY:
            self.sent, self.sent_at = completed, now
            self.on_progress(Progress(status=f"pulling {_short(self.file)}",
                                      digest=self.file.digest, total=self.file.size,
                                      completed=completed))


def _short(file: RemoteFile) -> str:
    return file.digest.split(":", 1)[1][:12]


def fetch_file(url: str, headers: dict[str, str], dest: Path, file: RemoteFile,
           report: Reporter) -> None:
    from huggingface_hub import get_session, hf_raise_for_status

    if dest.is_file() and not dest.is_symlink() and dest.stat().st_size == file.size:
        report(file.size, force=True)
        return
    part = dest.with_name(dest.name + ".incomplete")
    for path in (dest, part):
        if path.is_symlink():
            path.unlink()
    have = part.stat().st_size if part.is_file() else 0
    if have > file.size:
        part.unlink()
        have = 0
    request_headers = dict(headers)
    if 0 < have < file.size:
        request_headers["Range"] = f"bytes={have}-"
    if have < file.size or file.size == 0:
        with hub_errors(file.path), get_session().stream(
                "GET", url, headers=request_headers, timeout=60.0,
                follow_redirects=True) as response:
            if response.status_code >= 400:
                response.read()
                hf_raise_for_status(response)
            resumed = have and response.status_code == 206
            if not resumed:
                have = 0  # NOTE: the server sent the whole file (a Range it ignored)
            report(have, force=True)
            try:
                with open(part, "ab" if resumed else "wb") as out:
                    for chunk in response.iter_bytes(CHUNK):
                        out.write(chunk)
                        have += len(chunk)
                        report(have)
            except Exception as exc:
                if isinstance(exc, PullCancelled):
                    raise
                raise PullError(f"download of {file.path} interrupted after {have} of "
                                f"{file.size} bytes ({exc}); pull again to resume") from exc
    if have != file.size:
        raise PullError(f"download of {file.path} ended after {have} of {file.size} bytes; "
                        "pull again to resume")
    part.replace(dest)
    report(file.size, force=True)


def file_hashes(path: Path, size: int) -> tuple[str, str]:
    """(sha256, git blob sha1) of a file in one pass."""
    sha256 = hashlib.sha256()
    git = hashlib.sha1(f"blob {size}\0".encode(), usedforsecurity=False)
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            sha256.update(chunk)
            git.update(chunk)
    return sha256.hexdigest(), git.hexdigest()


def verify_files(staging: Path, files: list[RemoteFile]) -> list[ManifestFile]:
    out = []
    for file in files:
        path = staging / file.path
        size = path.stat().st_size
        if size != file.size:
            path.unlink()
            raise PullError(f"{file.path}: {size} bytes, expected {file.size}; pull again")
        sha256, git_oid = file_hashes(path, size)
        if (file.sha256 and sha256 != file.sha256) or \
                (not file.sha256 and file.git_oid and git_oid != file.git_oid):
            path.unlink()
            want = file.sha256 or file.git_oid
            raise PullError(f"{file.path}: digest mismatch (expected {want}, got "
                            f"{sha256 if file.sha256 else git_oid}); the file was removed, "
                            "pull again")
        out.append(ManifestFile(path=file.path, size=size, sha256=sha256,
                                git_oid=file.git_oid))
    return out
