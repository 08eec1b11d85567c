"""`npx-supervisor service`: the systemd unit (verified by systemd-analyze, its ExecStart run
outside systemd and stopped the way systemd stops it), install/uninstall against a fake
systemctl, and the Windows Service through a fake Service Control Manager."""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import tomli_w
from serverctl import SUPERVISOR, Server, alive, descendants, small_llm, wait_for

from npu_proxy.supervisor import winservice
from npu_proxy.supervisor.service_unit import TEMPLATE, render_unit

ROOT = Path(__file__).resolve().parent.parent
DEPLOY_UNIT = ROOT / "deploy" / "systemd" / "npu-proxy.service"


def _cli(*args: str, env: dict[str, str] | None = None,
         check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run([SUPERVISOR, *args], capture_output=True, text=True, check=check,
                          timeout=60, env={**os.environ, **(env or {})})


def _config(tmp: Path) -> Path:
    path = tmp / "npu-proxy.toml"
    path.write_text(tomli_w.dumps({"model_cache": str(tmp / "models"), "grace_period": 5.0}))
    return path


def _unit(text: str) -> dict[str, list[str]]:
    """Each setting of a unit file (all sections) -> its values, in order."""
    settings: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            settings.setdefault(key, []).append(value)
    return settings


def _dry_run_unit(config: Path, *extra: str) -> str:
    out = _cli("service", "install", "--dry-run", "--config", str(config), *extra).stdout
    return out


# --- the unit ------------------------------------------------------------------------------


def _verify(path: Path, user: bool, runtime: Path) -> str:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (Debian package systemd; .ci/run "
                    "installs it where apt-get can)")
    runtime.mkdir(mode=0o700, exist_ok=True)
    done = subprocess.run([analyze, *(["--user"] if user else []), "verify", str(path)],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "XDG_RUNTIME_DIR": str(runtime)})
    assert done.returncode == 0, done.stderr
    # NOTE: unknown or malformed settings are only warnings (exit 0), naming the file.
    return "\n".join(line for line in (done.stdout + done.stderr).splitlines()
                     if path.name in line)


def test_generated_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    unit = tmp_path / "npu-proxy.service"
    unit.write_text(_dry_run_unit(_config(tmp_path)))
    assert _verify(unit, user=True, runtime=tmp_path / "xdg") == ""
    system = tmp_path / "system" / "npu-proxy.service"
    system.parent.mkdir()
    system.write_text(_dry_run_unit(_config(tmp_path), "--system", "--run-as", "daemon"))
    assert _verify(system, user=False, runtime=tmp_path / "xdg") == ""


def test_deploy_unit_passes_verify_and_is_the_template(tmp_path: Path) -> None:
    assert DEPLOY_UNIT.read_text() == render_unit(TEMPLATE)
    assert _verify(DEPLOY_UNIT, user=False, runtime=tmp_path / "xdg") == ""
    assert _verify(DEPLOY_UNIT, user=True, runtime=tmp_path / "xdg") == ""


def test_unit_runs_this_program_with_the_config_and_hardening(tmp_path: Path) -> None:
    config = _config(tmp_path)
    text = _dry_run_unit(config)
    settings = _unit(text)
    argv = shlex.split(settings["ExecStart"][0])
    assert argv[:2] == [SUPERVISOR, "start"]
    assert argv[argv.index("--config") + 1] == str(config)
    assert argv[argv.index("--runtime-dir") + 1] == f"%t/npu-proxy-{os.getuid()}"
    assert settings["RuntimeDirectory"] == [f"npu-proxy-{os.getuid()}"]
    assert settings["RuntimeDirectoryMode"] == ["0700"]
    assert settings["ReadWritePaths"] == [f"-{tmp_path / 'models'}"]
    assert settings["KillMode"] == ["mixed"] and settings["KillSignal"] == ["SIGTERM"]
    assert settings["TimeoutStopSec"] == ["20"]  # grace_period 5 s + 15
    assert settings["Restart"] == ["on-failure"]
    for key, value in [("NoNewPrivileges", "yes"), ("ProtectSystem", "strict"),
                       ("ProtectHome", "read-only"), ("PrivateTmp", "yes"),
                       ("StandardOutput", "journal")]:
        assert settings[key] == [value]
    assert "User" not in settings
    system = _unit(_dry_run_unit(config, "--system", "--run-as", "daemon"))
    assert system["User"] == ["daemon"]
    assert system["RuntimeDirectory"] == ["npu-proxy"]


def test_exec_start_serves_and_kill_signal_stops_it_cleanly(tmp_path: Path) -> None:
    """The unit's own command line, run as systemd would (its RuntimeDirectory made 0700 and
    %t given), serves; the unit's KillSignal to the main process stops everything, exit 0."""
    # NOTE: the small model (serverctl.small_llm): the test starts and stops, nothing asks.
    srv = Server(tmp_path, workers=[{"name": "llm", "role": "llm"}], models=small_llm())
    settings = _unit(_dry_run_unit(srv.config_path))
    run_root = tmp_path / "run"
    run_root.mkdir(mode=0o700)
    (run_root / settings["RuntimeDirectory"][0]).mkdir(mode=0o700)
    argv = [a.replace("%t", str(run_root)).replace("%%", "%")
            for a in shlex.split(settings["ExecStart"][0])]
    env = dict(os.environ)
    for assignment in settings["Environment"]:
        key, _, value = shlex.split(assignment)[0].partition("=")
        env[key] = value
    log = open(tmp_path / "service.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL)
    kids: set[int] = set()
    try:
        def ready() -> bool:
            assert proc.poll() is None, (tmp_path / "service.log").read_text()
            try:
                return httpx.get(srv.url + "/health/ready", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, 240, "not ready (see service.log)", every=0.2)
        kids = descendants(proc.pid)
        assert kids and list((run_root / settings["RuntimeDirectory"][0]).glob("*.in"))
        proc.send_signal(signal.Signals[settings["KillSignal"][0]])
        assert proc.wait(float(settings["TimeoutStopSec"][0])) == 0
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(alive(p) for p in kids):
            time.sleep(0.1)
        assert not any(alive(p) for p in kids)
    finally:
        log.close()
        for pid in [p for p in kids if alive(p)]:
            os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# --- install / uninstall -----------------------------------------------------------------------


@pytest.fixture
def fake_systemctl(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """A `systemctl` on PATH that records its arguments, and a private XDG_CONFIG_HOME."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "systemctl.calls"
    script = bin_dir / "systemctl"
    script.write_text(f'#!/bin/sh\necho "$*" >> {shlex.quote(str(calls))}\n')
    script.chmod(0o755)
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "XDG_CONFIG_HOME": str(tmp_path / "xdg-config")}
    return env, calls


def _calls(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def test_install_writes_the_user_unit_and_starts_it(
        tmp_path: Path, fake_systemctl: tuple[dict[str, str], Path]) -> None:
    env, calls = fake_systemctl
    config = _config(tmp_path)
    unit = tmp_path / "xdg-config" / "systemd" / "user" / "npu-proxy.service"

    out = _cli("service", "install", "--dry-run", "--config", str(config), env=env).stdout
    assert out.startswith(f"# {unit}\n") and "ExecStart=" in out
    assert not unit.exists() and _calls(calls) == []

    out = _cli("service", "install", "--config", str(config), env=env).stdout
    assert f"wrote {unit}" in out
    assert unit.read_text() == _dry_run_unit(config).split("\n", 1)[1]
    assert (tmp_path / "models").is_dir()  # ReadWritePaths needs it to exist
    assert _calls(calls) == ["--user daemon-reload", "--user enable --now npu-proxy.service"]
    assert "$ systemctl --user enable --now npu-proxy.service" in out

    out = _cli("service", "status", env=env).stdout
    assert f"unit: {unit}" in out
    assert _calls(calls)[-1] == "--user status --no-pager npu-proxy.service"

    out = _cli("service", "uninstall", env=env).stdout
    assert f"removed {unit}" in out and not unit.exists()
    assert _calls(calls)[-2:] == ["--user disable --now npu-proxy.service",
                                  "--user daemon-reload"]
    again = _cli("service", "uninstall", env=env, check=False)
    assert again.returncode != 0 and "not installed" in again.stderr
    status = _cli("service", "status", env=env, check=False)
    assert status.returncode == 3 and "not installed" in status.stdout


def test_install_no_start_only_enables(
        tmp_path: Path, fake_systemctl: tuple[dict[str, str], Path]) -> None:
    env, calls = fake_systemctl
    _cli("service", "install", "--no-start", "--config", str(_config(tmp_path)), env=env)
    assert _calls(calls) == ["--user daemon-reload", "--user enable npu-proxy.service"]
    out = _cli("service", "uninstall", "--dry-run", env=env).stdout
    assert "would stop and disable npu-proxy.service" in out
    assert (tmp_path / "xdg-config" / "systemd" / "user" / "npu-proxy.service").exists()


def test_a_failing_systemctl_is_reported(
        tmp_path: Path, fake_systemctl: tuple[dict[str, str], Path]) -> None:
    env, _calls_file = fake_systemctl
    script = Path(env["PATH"].split(os.pathsep)[0]) / "systemctl"
    script.write_text("#!/bin/sh\necho 'Failed to connect to bus' >&2\nexit 1\n")
    done = _cli("service", "install", "--config", str(_config(tmp_path)), env=env,
                check=False)
    assert done.returncode != 0
    assert "systemctl --user daemon-reload failed with exit code 1" in done.stderr


# --- Windows ---------------------------------------------------------------------------------


class FakeManager:
    """The Service Control Manager as a dict: what winservice asks of the real one."""

    def __init__(self) -> None:
        self.services: dict[str, winservice.ServiceSpec] = {}
        self.removed: list[str] = []

    def install(self, spec: winservice.ServiceSpec) -> None:
        assert spec.name not in self.services
        self.services[spec.name] = spec

    def remove(self, name: str) -> None:
        del self.services[name]
        self.removed.append(name)

    def status(self, name: str) -> str:
        return "stopped" if name in self.services else "not installed"


def test_windows_service_install_and_uninstall(tmp_path: Path) -> None:
    manager: winservice.ServiceManager = FakeManager()
    config = _config(tmp_path)
    spec = winservice.service_spec([r"C:\npu\npx-supervisor.exe"], config, 20.0)
    assert spec.argv == [r"C:\npu\npx-supervisor.exe", "start", "--quiet", "--config",
                         str(config)]
    assert "installed Windows service npu-proxy" in winservice.install(manager, spec)
    assert manager.status("npu-proxy") == "stopped"
    # Installing again replaces the service (a new config path, a new program).
    assert winservice.install(manager, spec)
    fake = manager
    assert isinstance(fake, FakeManager) and fake.removed == ["npu-proxy"]
    assert winservice.uninstall(manager) == "removed Windows service npu-proxy"
    assert manager.status("npu-proxy") == "not installed"
    assert "not installed" in winservice.uninstall(manager)


def _waiting_child(flag: Path, code: int) -> list[str]:
    """A process that exits with `code` once `flag` exists (a supervisor told to stop)."""
    return [sys.executable, "-c",
            f"import os, sys, time\nwhile not os.path.exists({str(flag)!r}): time.sleep(0.02)\n"
            f"sys.exit({code})"]


def test_windows_service_body_asks_the_supervisor_to_stop(tmp_path: Path) -> None:
    flag = tmp_path / "shutdown"
    stop = threading.Event()
    asked: list[bool] = []

    def shutdown() -> None:
        asked.append(True)
        flag.touch()

    stop.set()  # the Service Control Manager's stop request
    assert winservice.run_until_stopped(_waiting_child(flag, 0), stop, shutdown, 60) == 0
    assert asked == [True]


def test_windows_service_body_kills_a_supervisor_that_does_not_stop(tmp_path: Path) -> None:
    stop = threading.Event()
    stop.set()
    # Nothing creates the flag: the child ignores the shutdown and is killed after the timeout.
    assert winservice.run_until_stopped(
        _waiting_child(tmp_path / "never", 0), stop, lambda: None, 0.5) == 1


def test_windows_service_body_returns_when_the_supervisor_exits(tmp_path: Path) -> None:
    flag = tmp_path / "exit"
    flag.touch()
    assert winservice.run_until_stopped(
        _waiting_child(flag, 3), threading.Event(), lambda: None, 60) == 3
