"""The llm worker does not keep its weights twice: once the CPU plugin has repacked them on the
warm-up inference, the mapped weight file's pages are let go (workers/generation/weights.py;
bench/worker_memory.py measures the whole breakdown)."""

from __future__ import annotations

import mmap
import sys
from pathlib import Path

import httpx
import pytest
from serverctl import Server

from npu_proxy.workers.generation.weights import release_mapped_weights

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="reads /proc/PID/smaps; the release is Linux-only")


def _resident_kib(pid: int | str, suffix: str) -> tuple[int, int]:
    """(resident KiB, mapped KiB) of the process's mappings of files named *suffix."""
    resident = size = 0
    name = ""
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head = line.split(maxsplit=5)
        if "-" in head[0] and not head[0].endswith(":"):
            name = head[5] if len(head) > 5 else ""
        elif name.endswith(suffix) and head[0] in ("Rss:", "Size:"):
            if head[0] == "Rss:":
                resident += int(head[1])
            else:
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


def test_llm_worker_does_not_keep_the_mapped_weights_resident(server: Server,
                                                              base_url: str) -> None:
    httpx.post(base_url + "/v1/completions", timeout=120, json={
        "model": "smollm2:135m", "prompt": "Hello", "max_tokens": 8}).raise_for_status()
    rows = httpx.get(base_url + "/health/devices", timeout=10).json()["workers"]
    pid = next(w["pid"] for w in rows if w["name"] == "llm")
    resident, size = _resident_kib(pid, "/openvino_model.bin")
    assert size > 0, "the llm worker maps no openvino_model.bin"
    # NOTE: a generous bound, not a measurement: without the release all of the file that
    # compiling and the warm-up read stays resident (SmolLM2: 88 of 87.4 MiB mapped, 100 %);
    # with it only what inference reads in place comes back (the int8 token embedding that
    # the output layer shares: 24 MiB, 28 %). Memory pressure only lowers it.
    assert resident < size * 0.5, f"{resident} KiB of {size} KiB of the weights resident"
