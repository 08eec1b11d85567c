"""A GGUF's converted IR folder is keyed by the file's content (its sha256, remembered in the
model cache's digest record), so a copy, a moved file or a new virtual environment's file
shares the conversion already made; prune keeps a folder while any file of that content is
there. Small fake .gguf files: nothing is converted here."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from npu_proxy.models import digests
from npu_proxy.models.store import CONVERTED_FROM, GGUF_IR
from npu_proxy.workers import gguf_ir
from npu_proxy.workers.gguf_ir import FORMAT, ir_folder, loadable


def _gguf(path: Path, seed: int, size: int = 4096) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(bytes((seed + i * 7) % 251 for i in range(size)))
    return path


def _copy(source: Path, target: Path) -> Path:
    """A copy (another inode) with another modification time."""
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, target)
    st = source.stat()
    os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    return target


def _complete(folder: Path, source: Path) -> Path:
    """What a finished conversion leaves (its model files do not matter here)."""
    folder.mkdir(parents=True)
    digest = digests.sha256_file(source)
    (folder / CONVERTED_FROM).write_text(f"{source.resolve()}\n{digest}\n")
    return folder


def _record(cache: Path) -> dict[str, dict[str, object]]:
    entries: dict[str, dict[str, object]] = json.loads(
        (cache / "digests.json").read_text())["entries"]
    return entries


def test_the_same_bytes_elsewhere_load_the_same_ir(tmp_path: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    cache = tmp_path / "cache"
    first = _gguf(tmp_path / "venv-a" / "model.gguf", 1)
    second = _copy(first, tmp_path / "venv-b" / "renamed.gguf")
    assert first.stat().st_mtime_ns != second.stat().st_mtime_ns
    folder = ir_folder(cache / GGUF_IR, first)
    assert ir_folder(cache / GGUF_IR, second) == folder
    _complete(folder, first)
    caplog.set_level(logging.INFO, logger="npu_proxy.workers.gguf_ir")
    assert loadable(str(second), cache) == str(folder)
    assert "loading the converted IR" in caplog.text and "converting" not in caplog.text


def test_other_bytes_of_the_same_size_get_another_folder(tmp_path: Path) -> None:
    root = tmp_path / GGUF_IR
    model = _gguf(tmp_path / "model.gguf", 1)
    before = ir_folder(root, model)
    assert ir_folder(root, _gguf(tmp_path / "other.gguf", 2)) != before
    # Replaced (as a download does: written beside, renamed over) by other bytes of the same
    # size with the same modification time: only the content (and the inode) differs.
    st = model.stat()
    _gguf(tmp_path / "model.gguf.part", 3)
    os.utime(tmp_path / "model.gguf.part", ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(tmp_path / "model.gguf.part", model)
    assert (model.stat().st_size, model.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    assert ir_folder(root, model) != before
    assert ir_folder(root, model).name.startswith(digests.sha256_file(model)[:16])


def test_a_warm_lookup_reads_the_record_not_the_file(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    model = _gguf(tmp_path / "model.gguf", 1)
    reads: list[Path] = []
    hash_file = digests.sha256_file

    def counted(path: Path) -> str:
        reads.append(path)
        return hash_file(path)

    monkeypatch.setattr(digests, "sha256_file", counted)
    ir_folder(cache / GGUF_IR, model)
    ir_folder(cache / GGUF_IR, model)
    assert reads == [model.resolve()]  # hashed once, then read from the record
    # The record's entry is the only source of the key: a digest put there is what is used.
    record = {"version": 1, "entries": _record(cache)}
    record["entries"][str(model.resolve())]["sha256"] = "ab" * 32
    (cache / "digests.json").write_text(json.dumps(record))
    assert ir_folder(cache / GGUF_IR, model) == cache / GGUF_IR / f"{'ab' * 8}-{FORMAT}"
    assert reads == [model.resolve()]


def test_a_corrupt_record_is_recomputed_and_gone_files_leave_it(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "digests.json").write_text("{not json")
    kept, gone = _gguf(tmp_path / "kept.gguf", 1), _gguf(tmp_path / "gone.gguf", 2)
    assert ir_folder(cache / GGUF_IR, kept).name.startswith(digests.sha256_file(kept)[:16])
    ir_folder(cache / GGUF_IR, gone)
    assert set(_record(cache)) == {str(kept.resolve()), str(gone.resolve())}
    gone.unlink()
    ir_folder(cache / GGUF_IR, _gguf(tmp_path / "new.gguf", 3))  # a write drops dead entries
    assert set(_record(cache)) == {str(kept.resolve()), str((tmp_path / "new.gguf").resolve())}


def test_prune_keeps_a_shared_folder_while_one_of_its_files_is_there(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="npu_proxy.workers.gguf_ir")
    root = tmp_path / "cache" / GGUF_IR
    first = _gguf(tmp_path / "venv-a" / "model.gguf", 1)
    second = _copy(first, tmp_path / "venv-b" / "model.gguf")
    folder = _complete(ir_folder(root, first), first)
    assert ir_folder(root, second) == folder
    shutil.rmtree(tmp_path / "venv-a")  # the folder names this file
    gguf_ir._prune(root)
    assert folder.is_dir()
    (tmp_path / "venv-b" / "model.gguf").unlink()
    gguf_ir._prune(root)
    assert not folder.exists() and "no GGUF converted to it is left" in caplog.text


def test_prune_drops_the_old_key_s_folders_and_dead_staging(tmp_path: Path) -> None:
    root = tmp_path / "cache" / GGUF_IR
    model = _gguf(tmp_path / "model.gguf", 1)
    current = _complete(ir_folder(root, model), model)
    old = root / "model-0123456789abcdef"  # `<stem>-<hash of path, size, mtime, FORMAT>`
    old.mkdir()
    (old / CONVERTED_FROM).write_text(f"{model.resolve()}\n")
    dead = root / f"{current.name}.999999999.partial"
    dead.mkdir()
    running = root / "unfinished"  # another worker's conversion: no COMPLETE file yet
    running.mkdir()
    gguf_ir._prune(root)
    assert sorted(p.name for p in root.iterdir()) == sorted([current.name, running.name])


def test_prune_keeps_a_folder_a_running_process_maps(tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    """An older npu-proxy sharing the cache (the key before content) may run on a folder this
    version would drop: its worker maps the model file, so the folder stays while it runs."""
    caplog.set_level(logging.INFO, logger="npu_proxy.workers.gguf_ir")
    root = tmp_path / "cache" / GGUF_IR
    model = _gguf(tmp_path / "model.gguf", 1)
    old = root / "model-0123456789abcdef"
    old.mkdir(parents=True)
    (old / CONVERTED_FROM).write_text(f"{model.resolve()}\n")
    weights = old / "openvino_model.bin"
    weights.write_bytes(b"\0" * 8192)
    holder = subprocess.Popen(
        [sys.executable, "-c", "import mmap, sys; f = open(sys.argv[1], 'rb'); "
         "m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ); print('mapped', flush=True); "
         "sys.stdin.read()", str(weights)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "mapped\n"
        gguf_ir._prune(root)
        assert old.is_dir() and "a running process has its files mapped" in caplog.text
    finally:
        holder.communicate("")
    gguf_ir._prune(root)
    assert not old.exists()


_WRITER = """
import sys
from pathlib import Path
from npu_proxy.models.digests import DigestCache
cache, files = Path(sys.argv[1]), sys.argv[2:]
for name in files:
    DigestCache(cache).file_sha256(Path(name))
"""


def test_processes_recording_digests_at_once_lose_none(tmp_path: Path) -> None:
    """Workers of one model cache record their files' digests at the same time: every entry
    is kept (a lost one makes the IR folder's prune fall back to the file its COMPLETE names,
    which may be gone, and remove a folder in use)."""
    cache = tmp_path / "cache"
    writers = []
    for w in range(6):
        files = []
        for i in range(15):
            path = tmp_path / f"w{w}-{i}.gguf"
            path.write_bytes(f"{w}-{i}".encode())
            files.append(str(path))
        writers.append(subprocess.Popen([sys.executable, "-c", _WRITER, str(cache), *files]))
    assert [p.wait(timeout=120) for p in writers] == [0] * 6
    assert len(digests.DigestCache(cache).recorded()) == 6 * 15
