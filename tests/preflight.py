"""A test run on a disk too full for it stops at once and says why (a pytest plugin).

Without this, a nearly full disk failed the run deep inside a packaging build
(`[Errno 28] No space left on device` in the .deb's staging) after a quarter of an hour.
What a run writes, measured in `CI=true bash .ci/run` on a fresh clone: about 3 GiB in
pytest's temporary folders (the frozen build, the .deb's staging, pipx's environment, the
servers' runtime folders) and, on a machine that never ran the suite, about 6 GiB in the
model cache (converted and downloaded-from-PyPI models, the compiled-blob cache).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

GIB = 1 << 30
# Free space a run needs in pytest's temporary folders: the slow tier's builds, or without.
TEMP_NEED = {True: 4 * GIB, False: 2 * GIB}
# Free space the model cache needs: empty (everything built and compiled in this run), or not.
CACHE_NEED = {True: 7 * GIB, False: 1 * GIB}


def existing(path: Path) -> Path:
    """`path`, or its nearest ancestor that exists (a folder the run will make)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def shortfall(needs: dict[Path, int], free: dict[int, int]) -> str | None:
    """What is missing, or None: `needs` in bytes per folder, `free` bytes per device
    (`os.stat(...).st_dev`); the needs of folders on one device add up."""
    wanted: dict[int, tuple[int, list[Path]]] = {}
    for folder, need in needs.items():
        dev = os.stat(existing(folder)).st_dev
        total, folders = wanted.get(dev, (0, []))
        wanted[dev] = (total + need, [*folders, folder])
    for dev, (need, folders) in wanted.items():
        if free[dev] < need:
            names = ", ".join(str(f) for f in folders)
            return (f"the test run needs {need / GIB:.1f} GiB free for {names} and that disk "
                    f"has {free[dev] / GIB:.1f} GiB: free some space (old clones, "
                    "~/.cache/npu-proxy-test/models/ov_cache) or point TMPDIR and "
                    "NPU_PROXY_TEST_MODEL_CACHE at a larger disk")
    return None


def free_by_device(folders: list[Path]) -> dict[int, int]:
    return {os.stat(existing(f)).st_dev: shutil.disk_usage(existing(f)).free for f in folders}


def pytest_sessionstart(session: pytest.Session) -> None:
    config = session.config
    if hasattr(config, "workerinput"):  # NOTE: an xdist worker; its controller checked
        return
    from installed import SLOW
    from serverctl import MODEL_CACHE

    temp = Path(config._tmp_path_factory.getbasetemp())  # type: ignore[attr-defined]
    cold = not (MODEL_CACHE / "ov_cache").exists()
    needs = {temp: TEMP_NEED[SLOW], MODEL_CACHE: CACHE_NEED[cold]}
    why = shortfall(needs, free_by_device(list(needs)))
    if why is not None:
        raise pytest.UsageError(why)
