"""The private runtime folder (IPC endpoints, logs, the effective config): created and
verified without following links.

POSIX: a real directory (never a symbolic link, checked with lstat and opened with
O_NOFOLLOW, so a link planted at the path is refused, not followed), owned by this user,
mode 0700; a folder others may write to is refused, one others may only read is tightened.
Windows: a real folder (no link or junction) whose ACL grants this user alone, set with
icacls.
"""

from __future__ import annotations

import contextlib
import os
import stat
import subprocess
from pathlib import Path


class RuntimeDirError(Exception):
    """The runtime folder cannot be trusted; the message says why and what to do."""


def prepare_runtime_dir(path: Path) -> None:
    """Create `path` (and its `logs` folder) private to this user, or refuse."""
    if os.name == "nt":
        _prepare_windows(path)
    else:
        _prepare_posix(path)


def _refuse(path: Path, why: str) -> RuntimeDirError:
    return RuntimeDirError(f"runtime folder {path} {why}; remove it or choose another "
                           "folder (runtime_dir, NPU_PROXY_RUNTIME_DIR or --runtime-dir)")


def _prepare_posix(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    if stat.S_ISLNK(os.lstat(path).st_mode):
        raise _refuse(path, "is a symbolic link")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:  # NOTE: ELOOP if a link was swapped in since the lstat
        raise _refuse(path, f"cannot be opened as a directory ({exc.strerror})") from exc
    try:
        _check_owned(path, os.fstat(fd))
        os.fchmod(fd, 0o700)
        with contextlib.suppress(FileExistsError):
            os.mkdir("logs", 0o700, dir_fd=fd)
        logs = os.stat("logs", dir_fd=fd, follow_symlinks=False)
        if not stat.S_ISDIR(logs.st_mode) or logs.st_uid != os.getuid():
            raise _refuse(path, "holds a 'logs' entry that is not this user's folder")
    finally:
        os.close(fd)


def _check_owned(path: Path, st: os.stat_result) -> None:
    if not stat.S_ISDIR(st.st_mode):
        raise _refuse(path, "is not a directory")
    if st.st_uid != os.getuid():
        raise _refuse(path, f"belongs to another user (uid {st.st_uid})")
    if st.st_mode & 0o022:
        raise _refuse(path, f"is writable by others (mode {stat.S_IMODE(st.st_mode):o})")


def _prepare_windows(path: Path) -> None:
    """A real folder, inheritance cut, full control for the current user's SID only."""
    path.mkdir(parents=True, exist_ok=True)
    st = os.lstat(path)
    # NOTE: a junction is no symlink to S_ISLNK but has a reparse tag.
    reparse: int = getattr(st, "st_reparse_tag", 0)
    if stat.S_ISLNK(st.st_mode) or reparse:
        raise _refuse(path, "is a link or junction")
    if not stat.S_ISDIR(st.st_mode):
        raise _refuse(path, "is not a directory")
    sid = _current_sid()
    subprocess.run(["icacls", str(path), "/inheritance:r", "/grant:r", f"*{sid}:(OI)(CI)F"],
                   check=True, capture_output=True)
    (path / "logs").mkdir(exist_ok=True)


def _current_sid() -> str:
    """The SID of the user running this process (`whoami /user`, CSV: name, SID)."""
    out = subprocess.run(["whoami", "/user", "/fo", "csv", "/nh"], check=True,
                         capture_output=True, text=True).stdout
    return out.strip().rsplit(",", 1)[-1].strip().strip('"')
