"""The llm worker does not keep its weights twice: once the CPU plugin has repacked them on the
warm-up inference, the mapped weight file's pages are let go, and so is the code compiling ran
(workers/generation/weights.py; bench/worker_memory.py measures the whole breakdown). A
chat-only gateway holds no numpy (gateway/http/preload.py)."""

from __future__ import annotations

import mmap
import os
import re
import sys
import time
from pathlib import Path

import httpx
import pytest
from serverctl import Server, seed_cache, small_llm, wait_for, worker_row

from npu_proxy.protocol.config import ConfigError, load_config
from npu_proxy.workers.generation.weights import (
    read_back_by_page,
    release_code_pages,
    release_mapped_weights,
)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="reads /proc/PID/smaps; the release is Linux-only")


def _resident_kib(pid: int | str, suffix: str, perms: str = "") -> tuple[int, int]:
    """(resident KiB, mapped KiB) of the process's mappings of files named *suffix (and, given
    `perms`, whose permissions start with it: "r-x" for code)."""
    resident = size = 0
    counted = False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split(maxsplit=5)
        if "-" in head[0] and not head[0].endswith(":"):
            name = head[5] if len(head) > 5 else ""
            counted = (name.endswith(suffix) and head[1].startswith(perms)
                       and (not perms or name.startswith("/")))
        elif counted and head[0] == "Rss:":
            resident += int(head[1])
        elif counted and head[0] == "Size:":
            size += int(head[1])
    return resident, size


def test_pages_of_a_read_only_mapping_are_dropped_and_read_back(tmp_path: Path) -> None:
    data = bytes(range(1, 256)) * (8 * 4096)  # about 8 MiB, no page starting with a zero
    path = tmp_path / "openvino_model.bin"
    path.write_bytes(data)
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        assert sum(mapped[i] for i in range(0, len(data), 4096)) > 0  # every page touched
        before, size = _resident_kib("self", "/openvino_model.bin")
        assert before >= size * 0.9
        released = release_mapped_weights(str(tmp_path))
        after, _ = _resident_kib("self", "/openvino_model.bin")
        assert released >= before * 0.9
        assert after < before * 0.1
        assert mapped[:] == data  # read back from the file, unchanged


def _filesystem_type(path: Path) -> str:
    """The type of the filesystem holding `path` (/proc/self/mounts, the longest mount point)."""
    best, kind = "", ""
    for line in Path("/proc/self/mounts").read_text().splitlines():
        point, fstype = line.split()[1:3]
        if str(path).startswith(point.rstrip("/") + "/") and len(point) > len(best):
            best, kind = point, fstype
    return kind


def test_a_released_weight_page_comes_back_alone(tmp_path: Path) -> None:
    """What inference reads again of a released weight file (the rows of a token embedding
    read in place) comes back a page at a time, not as the whole page-cache folio or the
    fault-around window around it (Qwen2.5-Coder-1.5B: 109 MiB of the file after one short
    stream instead of 6; docs/performance.md, "Page-cache folios")."""
    if _filesystem_type(tmp_path) in ("tmpfs", "ramfs"):
        pytest.skip("a memory filesystem's pages cannot leave the page cache")
    data = bytes(range(1, 256)) * (8 * 4096)
    path = tmp_path / "openvino_model.bin"
    with path.open("wb") as f:
        f.write(data)  # NOTE: one large write, cached in large folios where the kernel can
        f.flush()
        os.fsync(f.fileno())  # NOTE: a dirty page cannot leave the page cache yet
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        assert sum(mapped[i] for i in range(0, len(data), 4096)) > 0  # compiling read it all
        release_mapped_weights(str(tmp_path))
        assert mapped[123] == data[123]  # the first request reads a row in place
        read_back_by_page(str(tmp_path))
        middle = len(data) // 2 + 123
        assert mapped[middle] == data[middle]  # and a later one another
        resident, _ = _resident_kib("self", "/openvino_model.bin")
        assert resident <= 2 * mmap.PAGESIZE // 1024, f"{resident} KiB back for one byte"


def test_llm_worker_does_not_keep_the_mapped_weights_resident(tmp_path: Path) -> None:
    """After a first request and a chat, little of the weight file is resident. A chat's
    prompt (8 tokens or more) once made the CPU plugin read every layer's weights back in
    (the warm-up had run steps of one row only: batch_engine.py warm_up), after the worker
    had let go of them.

    NOTE: a server of its own, on a copy of the weight file (another inode): what other
    servers read of the shared file meanwhile (tests run in two processes) would decide how
    much of the page cache a fault maps."""
    srv = Server(tmp_path, workers=[{"name": "llm", "role": "llm"}],
                 model_cache=str(seed_cache(tmp_path / "cache", copy=True))).start()
    try:
        httpx.post(srv.url + "/v1/completions", timeout=120, json={
            "model": "smollm2:135m", "prompt": "Hello", "max_tokens": 4}).raise_for_status()
        # NOTE: the worker drops once more what that request read, once idle (weights.py
        # read_back_by_page); the chat comes after, or that drop would hide what it read.
        wait_for(lambda: "weight ranges read in place" in srv.worker_log("llm"), timeout=60,
                 what="the llm worker never said it dropped the ranges read in place")
        httpx.post(srv.url + "/v1/chat/completions", timeout=120, json={
            "model": "smollm2:135m", "max_tokens": 8,
            "messages": [{"role": "user", "content": "Say hello to the world."}]}
        ).raise_for_status()
        resident, size = _resident_kib(worker_row(srv, "llm")["pid"], "/openvino_model.bin")
    finally:
        srv.stop()
    assert size > 0, "the llm worker maps no openvino_model.bin"
    # NOTE: a generous bound, not a measurement: without the release all of the file that
    # compiling and the warm-up read stays resident (SmolLM2: 88 of 87.4 MiB mapped, 100 %);
    # with it only what inference reads in place comes back (at most the int8 token
    # embedding that the output layer shares: 24 MiB, 28 %; 2 MiB measured after these two
    # requests). Memory pressure only lowers it.
    assert resident < size * 0.5, f"{resident} KiB of {size} KiB of the weights resident"


def test_code_pages_are_dropped_and_the_process_runs_on() -> None:
    import json
    import zlib

    before, _ = _resident_kib("self", "", "r-x")
    released = release_code_pages()
    after, _ = _resident_kib("self", "", "r-x")
    assert released > 0
    assert after < before
    # NOTE: code of Python, libc and an extension module run again: read back, unchanged.
    assert zlib.decompress(zlib.compress(b"x" * 1000)) == b"x" * 1000
    assert json.loads(json.dumps({"a": [1, 2]})) == {"a": [1, 2]}


def test_llm_worker_lets_go_of_the_code_its_compilation_ran(server: Server) -> None:
    """The warm-up ends by dropping the code pages that compiling ran (CPU plugin, OpenVINO:
    SmolLM2's worker after a request, 88 MiB of code resident instead of 113); the worker
    says how much it dropped in its log."""
    server.wait_state("llm", ("ready", "busy"))
    found = [int(m) for m in re.findall(r"code pages \((\d+) MiB\) released",
                                        server.worker_log("llm"))]
    assert found, "the llm worker's log says nothing of its code pages"
    assert min(found) > 0


def test_llm_worker_reads_its_in_place_weights_by_page_after_a_request(server: Server,
                                                                       base_url: str) -> None:
    """Once a request has run and the worker is idle, the ranges of the weight file it read in
    place (the token embedding's rows) are set to come back a page at a time (weights.py
    read_back_by_page); the worker process says so in its log, once, whatever it served."""
    for _ in range(2):
        httpx.post(base_url + "/v1/completions", timeout=120, json={
            "model": "smollm2:135m", "prompt": "Hello", "max_tokens": 4}).raise_for_status()
    deadline = time.monotonic() + 60
    said: list[str] = []
    while not said and time.monotonic() < deadline:
        # NOTE: the current process's lines: the shared server's worker log holds those of
        # every process other tests restarted, each of which said it once.
        current = server.worker_log("llm").rsplit("ready in ", 1)[-1]
        said = re.findall(r"weight ranges read in place: \d+ MiB dropped", current)
        time.sleep(0.2)  # NOTE: polling for the log line, bounded by the deadline
    assert len(said) == 1, said


def test_a_gateway_without_embeddings_or_audio_holds_no_numpy(timeout_server: Server) -> None:
    """numpy (15 MiB of the gateway's RSS) is imported by the first request that needs it
    (gateway/http/preload.py), not at startup: a chat-only server never holds it."""
    httpx.post(timeout_server.url + "/v1/completions", timeout=120, json={
        "model": "smollm2:135m", "prompt": "Hello", "max_tokens": 4}).raise_for_status()
    pid = int(timeout_server.children()["gateway"]["pid"])
    maps = Path(f"/proc/{pid}/maps").read_text()
    assert "_multiarray_umath" not in maps and "libscipy_openblas" not in maps


def _rss_kib(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^VmRSS:\s+(\d+)", status, re.M).group(1))  # type: ignore[union-attr]


def _llm_rss_after_a_long_prompt(srv: Server) -> int:
    """The llm worker's RSS (KiB) after a ~6,000-token prompt."""
    httpx.post(srv.url + "/v1/completions", timeout=600, json={
        "model": "smollm2:135m", "prompt": " ".join(["word"] * 6000),
        "max_tokens": 1}).raise_for_status()
    return _rss_kib(int(worker_row(srv, "llm")["pid"]))


def test_prefill_in_steps_leaves_less_memory_after_a_long_prompt(tmp_path: Path) -> None:
    """The CPU plugin keeps the intermediate buffers of its largest step for reuse; a worker
    reads a long prompt in steps of `max_batch_tokens` (512 by default) and keeps a step's
    worth, not a whole prompt's (docs/performance.md, "Memory of the llm worker"). Measured
    after a 6,000-token prompt on the two-layer SmolLM2 (small_llm(): the buffers are reused
    from layer to layer, so two layers keep what thirty keep): 211 against 373 MiB RSS at
    f32 (AMX), 198 against 281 at bf16 (oneDNN held to AVX512_CORE_BF16). Two private
    servers: the shared one's KV pages depend on what other tests sent it."""
    rss: dict[str, int] = {}
    for name, worker in (("default", {}), ("whole", {"max_batch_tokens": 0})):
        srv = Server(tmp_path / name, workers=[{"name": "llm", "role": "llm", **worker}],
                     models=small_llm()).start()
        try:
            rss[name] = _llm_rss_after_a_long_prompt(srv)
        finally:
            srv.stop()
    # NOTE: a margin well above two workers' difference at rest (~10 MiB) and about half the
    # 83-162 MiB measured. (The whole SmolLM2 after 3,000 tokens differed by 47 MiB at bf16.)
    assert rss["default"] + 40 * 1024 < rss["whole"], f"RSS KiB {rss}"


def test_a_negative_max_batch_tokens_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text('[[workers]]\nname = "llm"\nrole = "llm"\nmax_batch_tokens = -1\n')
    with pytest.raises(ConfigError, match="max_batch_tokens must be >= 0"):
        load_config(config, env={})


# --- a worker past its memory limit dies alone (issue 43) -------------------------------------


def test_limits_default_to_a_share_of_the_machine() -> None:
    from npu_proxy.protocol.config import WorkerSpec
    from npu_proxy.supervisor.memory import limit_mib, machine_mib, over_limit

    assert limit_mib(WorkerSpec(name="llm", role="llm"), 1000.0) == 600.0
    assert limit_mib(WorkerSpec(name="embed", role="embed"), 1000.0) == 250.0
    assert limit_mib(WorkerSpec(name="llm", memory_limit_mb=300), 1000.0) == 300.0
    assert limit_mib(WorkerSpec(name="llm", memory_limit_mb=-1), 1000.0) is None
    assert machine_mib() is not None  # NOTE: Linux, as every machine here
    assert over_limit(WorkerSpec(name="x", memory_limit_mb=1), os.getpid(), None)
    assert over_limit(WorkerSpec(name="x"), os.getpid(), machine_mib()) is None


def test_a_worker_over_its_memory_limit_is_killed_and_says_why(tmp_path: Path) -> None:
    """A worker whose resident memory passes memory_limit_mb (1 MiB here: at once) is killed
    by the supervisor, its status says why, and the gateway and the other workers serve on."""
    srv = Server(tmp_path, workers=[
        {"name": "llm", "role": "llm"},
        {"name": "embed", "role": "embed", "lazy": False, "memory_limit_mb": 1}]).start(
        wait=False)
    try:
        wait_for(lambda: "memory_limit_mb" in srv.children()["embed"]["last_error"],
                 timeout=120, what="the embed worker was not killed for its memory")
        assert "over its limit of 1 MiB" in srv.logs()
        srv.wait_state("llm", ("ready",))
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=120, json={
            "model": "smollm2:135m", "max_tokens": 2,
            "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text
    finally:
        srv.stop()
