"""Windows: npu-proxy as a Windows Service (pywin32's service framework, extra `windows`).

The service runs `npx-supervisor start --config ...` as its child and stops it the way
`npx-supervisor stop` does: a Shutdown on the control socket, so the supervisor drains its
workers within its grace period and exits 0; a supervisor that does not stop in time is
killed. Windows has no SIGTERM to send, hence the control socket.

What needs Windows is behind `ServiceManager` (install, remove, status), implemented with
pywin32 only on win32; the rest (`ServiceSpec`, `run_until_stopped`, the CLI's messages)
runs and is tested everywhere, with a fake manager.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

SERVICE_NAME = "npu-proxy"
DISPLAY_NAME = "npu-proxy"
DESCRIPTION = "Ollama, OpenAI and Anthropic APIs on Intel NPU, GPU and CPU (OpenVINO GenAI)"
# Seconds between two looks at the child while the service waits for a stop request.
_POLL = 0.5


@dataclass(frozen=True)
class ServiceSpec:
    name: str
    display_name: str
    description: str
    argv: list[str]  # the supervisor's command line
    config_file: str  # "" = built-in defaults
    stop_timeout: float  # seconds from the stop request to killing the supervisor


class ServiceManager(Protocol):
    """The Windows Service Control Manager, as far as npu-proxy needs it."""

    def install(self, spec: ServiceSpec) -> None: ...
    def remove(self, name: str) -> None: ...
    def status(self, name: str) -> str: ...  # "running", "stopped", ... or "not installed"


def service_spec(command: list[str], config_file: Path | None,
                 stop_timeout: float) -> ServiceSpec:
    config = str(config_file.absolute()) if config_file else ""
    argv = [*command, "start", "--quiet", *(["--config", config] if config else [])]
    return ServiceSpec(SERVICE_NAME, DISPLAY_NAME, DESCRIPTION, argv, config, stop_timeout)


def install(manager: ServiceManager, spec: ServiceSpec) -> str:
    if manager.status(spec.name) != "not installed":
        manager.remove(spec.name)
    manager.install(spec)
    return f"installed Windows service {spec.name}: {subprocess.list2cmdline(spec.argv)}"


def uninstall(manager: ServiceManager, name: str = SERVICE_NAME) -> str:
    if manager.status(name) == "not installed":
        return f"Windows service {name} is not installed"
    manager.remove(name)
    return f"removed Windows service {name}"


def run_until_stopped(argv: list[str], stop: threading.Event,
                      request_shutdown: Callable[[], None], timeout: float) -> int:
    """The service's body: run the supervisor until it exits or `stop` is set; then ask it
    to shut down and wait up to `timeout` s before killing it. Returns its exit code."""
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
    try:
        while not stop.wait(_POLL):
            if proc.poll() is not None:
                return proc.returncode
        request_shutdown()
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            return 1
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def control_shutdown(config_file: str) -> Callable[[], None]:
    """What `npx-supervisor stop` does, for the supervisor of this configuration."""

    def shutdown() -> None:
        from npu_proxy.protocol import control
        from npu_proxy.protocol.config import ConfigError, load_config

        try:
            config = load_config(Path(config_file) if config_file else None)
            control.call(config, control.Shutdown(), control.Ok, timeout=5.0)
        except (ConfigError, control.ControlError):
            pass  # NOTE: the caller kills the supervisor once the timeout has passed

    return shutdown


if sys.platform == "win32":  # pragma: no cover - runs on Windows only
    import win32service
    import win32serviceutil

    _CLASS = f"{__name__}.NpuProxyService"
    _STATES = {
        win32service.SERVICE_STOPPED: "stopped",
        win32service.SERVICE_START_PENDING: "starting",
        win32service.SERVICE_STOP_PENDING: "stopping",
        win32service.SERVICE_RUNNING: "running",
    }

    class Win32Manager:
        """The real Service Control Manager (administrator rights needed)."""

        def install(self, spec: ServiceSpec) -> None:
            win32serviceutil.InstallService(
                _CLASS, spec.name, spec.display_name,
                startType=win32service.SERVICE_AUTO_START, description=spec.description)
            win32serviceutil.SetServiceCustomOption(spec.name, "spec", json.dumps(
                {"argv": spec.argv, "config_file": spec.config_file,
                 "stop_timeout": spec.stop_timeout}))
            # Restart on failure, like the systemd unit's Restart=on-failure (after 5 s).
            scm = win32service.OpenSCManager(None, None, win32service.SC_MANAGER_ALL_ACCESS)
            try:
                handle = win32service.OpenService(scm, spec.name,
                                                  win32service.SERVICE_ALL_ACCESS)
                try:
                    win32service.ChangeServiceConfig2(
                        handle, win32service.SERVICE_CONFIG_FAILURE_ACTIONS,
                        {"ResetPeriod": 3600, "RebootMsg": "", "Command": "",
                         "Actions": [(win32service.SC_ACTION_RESTART, 5000)] * 3})
                finally:
                    win32service.CloseServiceHandle(handle)
            finally:
                win32service.CloseServiceHandle(scm)

        def remove(self, name: str) -> None:
            if self.status(name) not in ("stopped", "not installed"):
                win32serviceutil.StopService(name)
            win32serviceutil.RemoveService(name)

        def status(self, name: str) -> str:
            try:
                state = win32serviceutil.QueryServiceStatus(name)[1]
            except win32service.error:
                return "not installed"
            return _STATES.get(state, str(state))

    class NpuProxyService(win32serviceutil.ServiceFramework):  # type: ignore[misc]
        _svc_name_ = SERVICE_NAME
        _svc_display_name_ = DISPLAY_NAME
        _svc_description_ = DESCRIPTION

        def __init__(self, args: list[str]) -> None:
            super().__init__(args)
            self.stop_requested = threading.Event()

        def SvcStop(self) -> None:
            self.ReportServiceStatus(win32service.SERVICE_STOP_PENDING)
            self.stop_requested.set()

        def SvcDoRun(self) -> None:
            saved = json.loads(win32serviceutil.GetServiceCustomOption(self._svc_name_, "spec"))
            code = run_until_stopped(saved["argv"], self.stop_requested,
                                     control_shutdown(saved["config_file"]),
                                     float(saved["stop_timeout"]))
            if code != 0:
                # NOTE: a failed exit lets the Service Control Manager's recovery restart it.
                raise SystemExit(code)

    def default_manager() -> ServiceManager:
        return Win32Manager()
