"""The Debian package (issue 30): deploy/debian/build.py makes `npu-proxy_<version>_amd64.deb`
from the PyInstaller folder, lintian finds no error in it, `dpkg -i` installs it for real
(the npu-proxy user, `npx-supervisor` on the PATH, the conffile, the unit enabled), the
service serves a chat and an embedding as that user, and `dpkg --purge` leaves nothing.

It installs a package on this machine: it runs as root on Debian with dpkg-dev and lintian
(CI, where `.ci/run` installs them), in CI or with NPU_PROXY_SLOW_TESTS=1, and only where
npu-proxy is not installed already.
"""

from __future__ import annotations

import grp
import os
import pwd
import re
import shlex
import shutil
import signal
import subprocess
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from installed import ROOT, chat_and_embed, workers_ready
from serverctl import alive, descendants, free_port, wait_for, with_parent

PACKAGE = "npu-proxy"
USER = "npu-proxy"
CONFIG = Path("/etc/npu-proxy/config.toml")
UNIT = Path("/lib/systemd/system/npu-proxy.service")
# Everything of the package's own that purge must take away, besides `dpkg -L`'s list.
STATE = [Path("/usr/lib/npu-proxy"), Path("/etc/npu-proxy"), Path("/var/lib/npu-proxy"),
         Path("/etc/systemd/system/multi-user.target.wants/npu-proxy.service"),
         Path("/var/lib/systemd/deb-systemd-helper-enabled/npu-proxy.service"),
         Path("/var/lib/systemd/deb-systemd-helper-masked/npu-proxy.service")]
TOOLS = ("dpkg", "dpkg-deb", "dpkg-shlibdeps", "chrpath", "lintian", "lintian-explain-tags",
         "adduser", "deb-systemd-helper")


def _why_not() -> str:
    if os.geteuid() != 0:
        return "installs a package: needs root"
    missing = [t for t in TOOLS if not shutil.which(t)]
    if missing:
        return f"needs {', '.join(missing)} (Debian: apt-get install dpkg-dev chrpath lintian)"
    if subprocess.run(["dpkg", "-s", PACKAGE], capture_output=True).returncode == 0:
        return "npu-proxy is installed on this machine: the test would remove it"
    return ""


WHY_NOT = _why_not()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(bool(WHY_NOT), reason=WHY_NOT)]


def _run(*args: str, timeout: float = 900) -> str:
    done = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{shlex.join(args)}:\n{done.stdout[-4000:]}{done.stderr}"
    return done.stdout


def _error_tags() -> list[str]:
    """Every tag this lintian reports as an error (E:).

    NOTE: lintian then runs only the checks that can emit them, with the same E: lines (its
    warnings are not asserted): 107 s instead of 185-207 s for this package on 2 cores at
    load 5-7."""
    tags = _run("lintian-explain-tags", "--list-tags").split()
    explained = _run("lintian-explain-tags", "--tags", *tags)
    errors = [line[3:].strip() for line in explained.splitlines() if line.startswith("E: ")]
    assert len(errors) > 100, explained[-2000:]
    return errors


def _installed() -> bool:
    status = subprocess.run(["dpkg-query", "-W", "-f=${db:Status-Status}", PACKAGE],
                            capture_output=True, text=True)
    return status.returncode == 0 and status.stdout not in ("", "not-installed")


def _unit_command() -> tuple[list[str], dict[str, str]]:
    """ExecStart and Environment of the installed unit, as systemd would run them for a
    system unit (%t = /run)."""
    settings = dict(line.partition("=")[::2] for line in UNIT.read_text().splitlines()
                    if "=" in line and not line.startswith("#"))
    command = [a.replace("%t", "/run") for a in shlex.split(settings["ExecStart"])]
    env = dict(kv.partition("=")[::2] for kv in shlex.split(settings["Environment"]))
    return command, env


@contextmanager
def service(tmp: Path) -> Iterator[str]:
    """The service as its unit runs it: systemd where it runs; elsewhere (a container, CI)
    its ExecStart as the unit's user, with its Environment and its RuntimeDirectory. Yields
    the URL; stops it the way systemd does (SIGTERM to the supervisor) and checks that every
    process is gone."""
    port = free_port()
    # NOTE: the conffile as an administrator edits it; purge removes it edited or not.
    CONFIG.write_text(re.sub(r"(?m)^port = \d+$", f"port = {port}", CONFIG.read_text()))
    url = f"http://127.0.0.1:{port}"
    if os.path.isdir("/run/systemd/system"):
        _run("systemctl", "restart", "npu-proxy")
        wait_for(lambda: workers_ready(url), timeout=600, every=0.5, what="service not ready")
        yield url
        _run("systemctl", "stop", "npu-proxy")
        return
    command, env = _unit_command()
    user = pwd.getpwnam(USER)
    runtime = Path(command[command.index("--runtime-dir") + 1])
    runtime.mkdir(mode=0o700)
    os.chown(runtime, user.pw_uid, user.pw_gid)
    log_path = tmp / "service.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            command, cwd="/", stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={"PATH": "/usr/bin:/bin", "HOME": user.pw_dir, "USER": USER, "LANG": "C.UTF-8",
                 **env},
            user=user.pw_uid, group=user.pw_gid,
            extra_groups=os.getgrouplist(USER, user.pw_gid))

    def ready() -> bool:
        assert proc.poll() is None, f"exited with {proc.returncode}:\n{log_path.read_text()}"
        return workers_ready(url)

    kids: set[int] = set()
    try:
        wait_for(ready, timeout=600, every=0.5, what="service not ready")
        kids = descendants(proc.pid)
        assert kids, "the supervisor started no process"
        assert {os.stat(f"/proc/{pid}").st_uid for pid in kids | {proc.pid}} == {user.pw_uid}
        yield url
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(90) == 0, log_path.read_text()[-6000:]
        wait_for(lambda: not any(alive(p) for p in kids), timeout=15,
                 what="processes outlived the supervisor")
    finally:
        if proc.poll() is None:
            kids |= descendants(proc.pid)
            proc.kill()
            proc.wait()
        for pid in kids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        # NOTE: systemd removes a RuntimeDirectory when the service stops.
        shutil.rmtree(runtime, ignore_errors=True)


@pytest.mark.timeout(3600)
def test_deb_installs_serves_and_purges_cleanly(deb_package: Path, tmp_path: Path) -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    # NOTE: built by deploy/debian/build.py from the frozen folder in the background
    # (conftest.py deb_package), while the tests before this one ran.
    deb = deb_package
    assert deb.name == f"npu-proxy_{version}_amd64.deb" and deb.is_file()

    # NOTE: lintian reads only the .deb, so it runs while the package is installed, served
    # and purged (about 50 s each on 2 cores: mostly one core each), and is judged after.
    check = [str(shutil.which("lintian")), "--tag-display-limit", "0", "--tags",
             ",".join(_error_tags()), str(deb)]
    lintian = subprocess.Popen(with_parent(check), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        _run("dpkg", "-i", str(deb))
        files = [Path(p) for p in _run("dpkg", "-L", PACKAGE).splitlines()
                 if p.strip() not in ("", "/.")]
        user = pwd.getpwnam(USER)
        assert (user.pw_dir, user.pw_shell) == ("/var/lib/npu-proxy", "/usr/sbin/nologin")
        assert user.pw_uid < 1000  # a system user
        assert shutil.which("npx-supervisor", path="/usr/bin:/bin") == "/usr/bin/npx-supervisor"
        assert "Usage: " in _run("npx-supervisor", "--help")
        assert CONFIG.stat().st_gid == user.pw_gid and CONFIG.stat().st_mode & 0o007 == 0
        conffiles = _run("dpkg-query", "-W", "-f=${Conffiles}", PACKAGE)
        assert str(CONFIG) in conffiles
        # Enabled on install, as `systemctl enable` would (systemd need not be running).
        enabled = subprocess.run(["systemctl", "is-enabled", "npu-proxy"],
                                 capture_output=True, text=True)
        assert enabled.stdout.strip() == "enabled", enabled.stdout + enabled.stderr

        with service(tmp_path) as url:
            chat_and_embed(url)
        # The service wrote its models where the unit lets it write, as its user.
        models = Path("/var/lib/npu-proxy/models")
        assert any(p.stat().st_uid == user.pw_uid for p in models.rglob("*"))

        _run("dpkg", "--purge", PACKAGE)
        assert not _installed()
        left = [p for p in [*files, *STATE] if p.exists() or p.is_symlink()]
        # Folders such as /usr/bin stay: they belong to other packages too.
        shared = subprocess.run(["dpkg-query", "-S", *map(str, left)], capture_output=True,
                                text=True).stdout if left else ""
        assert [p for p in left if not (p.is_dir() and f": {p}\n" in shared)] == []
        with pytest.raises(KeyError):
            pwd.getpwnam(USER)
        with pytest.raises(KeyError):
            grp.getgrnam(USER)
        out, err = lintian.communicate(timeout=1800)
        errors = [line for line in out.splitlines() if line.startswith("E:")]
        assert errors == [], out
        assert lintian.returncode in (0, 1), err  # 1: tags (warnings) were found
    finally:
        if lintian.poll() is None:
            lintian.kill()
            lintian.communicate()
        if _installed():
            subprocess.run(["dpkg", "--purge", PACKAGE], capture_output=True, timeout=300)
