"""A local HTTP peer that speaks the Hugging Face hub's file endpoints, for pull tests.

What huggingface_hub 2.x asks (HF_ENDPOINT points here):
- `GET /api/models/{repo}[/revision/{rev}]` (`?blobs=True` adds each sibling's size, git
  blob id and, for LFS files, `lfs: {sha256, size, pointerSize}`);
- `HEAD`/`GET /{repo}/resolve/{rev}/{path}` with `X-Repo-Commit`, `ETag`, for LFS files
  `X-Linked-Etag`/`X-Linked-Size`, `Content-Length`, and `Range: bytes=N-` answered 206;
- errors carry `X-Error-Code` (RepoNotFound, RevisionNotFound, EntryNotFound).

It serves real files (the embedded SmolLM2 GGUF under other repository names) and can be
told to drop the connection once after N bytes of a file, to interrupt a download.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

CHUNK = 1 << 20


@dataclass
class HubFile:
    path: str
    size: int
    sha256: str
    git_oid: str
    lfs: bool
    source: Path | None = None
    data: bytes = b""

    def read(self, start: int) -> Any:
        if self.source is None:
            yield self.data[start:]
            return
        with open(self.source, "rb") as f:
            f.seek(start)
            while chunk := f.read(CHUNK):
                yield chunk


def _digests(chunks: Any) -> tuple[int, str, str]:
    data_sha = hashlib.sha256()
    body = []
    size = 0
    for chunk in chunks:
        data_sha.update(chunk)
        body.append(chunk)
        size += len(chunk)
    git = hashlib.sha1(f"blob {size}\0".encode(), usedforsecurity=False)
    for chunk in body:
        git.update(chunk)
    return size, data_sha.hexdigest(), git.hexdigest()


class FakeHub:
    def __init__(self) -> None:
        self.repos: dict[str, dict[str, HubFile]] = {}
        self.commits: dict[str, str] = {}
        self.requests: list[tuple[str, str, str]] = []  # (method, path, Range header)
        self.drop_after: dict[str, int] = {}  # repo path -> bytes sent before dropping, once
        # repo path -> (reached, release): a transfer pauses after its first chunk, once
        self.holds: dict[str, tuple[threading.Event, threading.Event]] = {}
        self.lock = threading.Lock()
        self.server: ThreadingHTTPServer | None = None
        self.url = ""

    def add_file(self, repo: str, path: str, source: Path | None = None, data: bytes = b"",
                 lfs: bool | None = None) -> HubFile:
        if source is not None:
            with open(source, "rb") as f:
                size, sha256, git_oid = _digests(iter(lambda: f.read(CHUNK), b""))
        else:
            size, sha256, git_oid = _digests([data])
        is_lfs = size > 10_000 if lfs is None else lfs
        file = HubFile(path=path, size=size, sha256=sha256, git_oid=git_oid, lfs=is_lfs,
                       source=source, data=data)
        self.repos.setdefault(repo, {})[path] = file
        self.commits.setdefault(repo, hashlib.sha1(repo.encode()).hexdigest())
        return file

    def drop_once(self, repo: str, path: str, after: int) -> None:
        with self.lock:
            self.drop_after[f"{repo}/{path}"] = after

    def hold_once(self, repo: str, path: str) -> tuple[threading.Event, threading.Event]:
        """The next transfer of the file pauses after its first chunk: `reached` is set
        then, and it goes on once `release` is set."""
        events = threading.Event(), threading.Event()
        with self.lock:
            self.holds[f"{repo}/{path}"] = events
        return events

    def start(self) -> str:
        hub = self

        class Handler(_Handler):
            pass

        Handler.hub = hub
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        return self.url

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()


class _Handler(BaseHTTPRequestHandler):
    hub: FakeHub
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _error(self, status: int, code: str, message: str) -> None:
        body = json.dumps({"error": message}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def do_HEAD(self) -> None:
        self._serve()

    def do_GET(self) -> None:
        self._serve()

    def _serve(self) -> None:
        url = urlsplit(self.path)
        path = unquote(url.path)
        with self.hub.lock:
            self.hub.requests.append((self.command, path, self.headers.get("Range", "")))
        if path.startswith("/api/models/"):
            self._model_info(path.removeprefix("/api/models/"), parse_qs(url.query))
            return
        parts = path.lstrip("/").split("/", 4)
        if len(parts) == 5 and parts[2] == "resolve":
            self._resolve(f"{parts[0]}/{parts[1]}", parts[3], parts[4])
            return
        self._error(404, "NotFound", f"no route {path}")

    def _repo(self, repo: str, revision: str) -> dict[str, HubFile] | None:
        files = self.hub.repos.get(repo)
        if files is None:
            self._error(404, "RepoNotFound", f"Repository {repo} not found")
            return None
        if revision not in ("main", self.hub.commits[repo]):
            self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
            return None
        return files

    def _model_info(self, rest: str, query: dict[str, list[str]]) -> None:
        repo, _, revision = rest.partition("/revision/")
        files = self._repo(repo, revision or "main")
        if files is None:
            return
        blobs = query.get("blobs", ["false"])[0].lower() == "true"
        siblings = []
        for f in files.values():
            sib: dict[str, Any] = {"rfilename": f.path}
            if blobs:
                sib["size"] = f.size
                sib["blobId"] = f.git_oid
                if f.lfs:
                    sib["lfs"] = {"sha256": f.sha256, "size": f.size, "pointerSize": 134}
            siblings.append(sib)
        body = json.dumps({"_id": repo, "id": repo, "modelId": repo, "private": False,
                           "sha": self.hub.commits[repo], "siblings": siblings,
                           "tags": [], "downloads": 0, "likes": 0}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _resolve(self, repo: str, revision: str, path: str) -> None:
        files = self._repo(repo, revision)
        if files is None:
            return
        f = files.get(path)
        if f is None:
            self._error(404, "EntryNotFound", f"{path} does not exist in {repo}")
            return
        start = 0
        wanted = self.headers.get("Range", "")
        if wanted.startswith("bytes=") and wanted.endswith("-"):
            start = int(wanted[len("bytes="):-1])
            if start >= f.size:
                self._error(416, "RangeNotSatisfiable", "range not satisfiable")
                return
        etag = f.sha256 if f.lfs else f.git_oid
        self.send_response(206 if start else 200)
        self.send_header("X-Repo-Commit", self.hub.commits[repo])
        self.send_header("ETag", f'"{etag}"')
        if f.lfs:
            self.send_header("X-Linked-Etag", f'"{f.sha256}"')
            self.send_header("X-Linked-Size", str(f.size))
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(f.size - start))
        if start:
            self.send_header("Content-Range", f"bytes {start}-{f.size - 1}/{f.size}")
        self.end_headers()
        if self.command == "HEAD":
            return
        with self.hub.lock:
            drop = self.hub.drop_after.pop(f"{repo}/{path}", None)
            hold = self.hub.holds.pop(f"{repo}/{path}", None)
        sent = 0
        for chunk in f.read(start):
            if hold is not None and sent:
                self.wfile.flush()
                hold[0].set()
                hold[1].wait(300)
                hold = None
            if drop is not None and sent + len(chunk) >= drop:
                self.wfile.write(chunk[:max(0, drop - sent)])
                self.wfile.flush()
                self.close_connection = True
                self.connection.close()
                return
            self.wfile.write(chunk)
            sent += len(chunk)
