"""A test run leaves no temporary folder behind, however pytest ends (issue 46).

A pytest plugin (tests/conftest.py loads it): at the session's start it spawns a small watcher
in a session of its own, so a signal to pytest's process group does not reach it. The watcher
waits for pytest to exit (a pidfd: woken by the exit itself) and then removes the run's
folders: pytest's base temporary folder and the model builders' scratch folders named for the
run (`run_tag`). A run that ended normally says so first: its base folder is kept only when a
test failed (for a look at what it left), as pytest keeps failed tests' folders.

Run as a program, it is that watcher: `python reaper.py PID MARKER FOLDER [PATTERN...]`, where
each PATTERN is a glob of further folders to remove.
"""

from __future__ import annotations

import glob
import os
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

# Set for the whole run, children included: the run's tag, for folders made outside tmp_path.
RUN_ENV = "NPU_PROXY_TEST_RUN"
# How long the watcher keeps trying while processes of the dead run still write in a folder.
REMOVE_FOR_S = 60.0


def run_tag() -> str:
    """This run's tag, for the name of a scratch folder made outside tmp_path (a model build
    in the shared cache), so the watcher of this run, and only it, removes what is left."""
    return os.environ.get(RUN_ENV, f"p{os.getpid()}")


def build_prefix(name: str) -> str:
    """The prefix of a scratch folder of the build `name` in the shared model cache."""
    return f".{name}-build-{run_tag()}-"


def start(pid: int, marker: Path, folder: Path, patterns: list[str]) -> subprocess.Popen[bytes]:
    """The watcher of process `pid`, removing `folder` and `patterns` once it exits."""
    return subprocess.Popen(
        [sys.executable, __file__, str(pid), str(marker), str(folder), *patterns],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True)


def pytest_configure(config: pytest.Config) -> None:
    os.environ.setdefault(RUN_ENV, f"p{os.getpid()}")


def pytest_sessionstart(session: pytest.Session) -> None:
    config = session.config
    if hasattr(config, "workerinput"):  # NOTE: an xdist worker; its controller watches
        return
    factory = config._tmp_path_factory  # type: ignore[attr-defined]
    base = Path(factory.getbasetemp())
    marker = base.parent / f".{base.name}.ended"
    marker.unlink(missing_ok=True)
    from serverctl import MODEL_CACHE

    patterns = [str(MODEL_CACHE / f".*-build-{run_tag()}-*"), f"/dev/shm/npx-*-{run_tag()}-*"]
    config.stash[_MARKER] = marker
    config.stash[_WATCHER] = start(os.getpid(), marker, base, patterns)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    marker = session.config.stash.get(_MARKER, None)
    if marker is not None:
        marker.write_text("keep" if exitstatus not in (0, 5) else "clean")


_MARKER = pytest.StashKey[Path]()
_WATCHER = pytest.StashKey[subprocess.Popen[bytes]]()


def _wait_exit(pid: int) -> None:
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # NOTE: not Linux ≥ 5.3, or already gone
        while _alive(pid):
            time.sleep(0.5)
        return
    try:
        select.select([fd], [], [])
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove(paths: list[Path]) -> None:
    """Each path gone; retried while a process of the dead run still writes in one (they end
    with it: tests/serverctl.py with_parent)."""
    give_up = time.monotonic() + REMOVE_FOR_S
    while True:
        for path in paths:
            shutil.rmtree(path, ignore_errors=True)
        left = [p for p in paths if p.exists()]
        if not left or time.monotonic() > give_up:
            return
        time.sleep(0.5)


def main(argv: list[str]) -> None:
    pid, marker, folder, patterns = int(argv[0]), Path(argv[1]), Path(argv[2]), argv[3:]
    _wait_exit(pid)
    ended = marker.read_text() if marker.exists() else "killed"
    marker.unlink(missing_ok=True)
    paths = [Path(p) for pattern in patterns for p in glob.glob(pattern)]
    if ended != "keep":
        paths.append(folder)
    _remove(paths)


if __name__ == "__main__":
    main(sys.argv[1:])
