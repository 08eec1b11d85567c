"""The systemd unit that runs `npx-supervisor start` as a service (Linux).

`render_unit` writes the unit text from a `UnitSpec`; `installed_spec` fills one in for this
machine (`npx-supervisor service install`), `TEMPLATE` is the generic one shipped in
deploy/systemd/npu-proxy.service (tests/test_service.py keeps the two identical).

How the unit fits the supervisor:
- Stop: systemd sends KillSignal (SIGTERM) to the supervisor only (KillMode=mixed); the
  supervisor's SIGTERM path drains its children within `grace_period`, kills what is left,
  then exits 0. TimeoutStopSec leaves room for all of it before systemd kills the group.
- The runtime folder (sockets, logs, effective config) is the unit's RuntimeDirectory:
  created 0700 for the service's user before the start, so PrivateTmp=yes hides /tmp without
  hiding the folder from the CLI. For a user unit its name is the CLI's default one
  ($XDG_RUNTIME_DIR/npu-proxy-<uid>), so `npx-supervisor status` finds it with no flag.
- The filesystem is read-only (ProtectSystem=strict, ProtectHome=read-only) except the model
  cache (pulls, the compile cache, the embedded model's IR) and the runtime folder.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from npu_proxy.protocol.config import Config

UNIT_NAME = "npu-proxy.service"
SYSTEM_UNIT_DIR = Path("/etc/systemd/system")
# Seconds beyond the grace period: the supervisor waits up to 5 s for a killed child.
STOP_MARGIN = 15


@dataclass(frozen=True)
class UnitSpec:
    """What varies between installs. Every field is already in unit syntax: specifiers such
    as %t stay as they are; literal text goes through `literal()` first."""

    command: list[str]  # the program and its arguments before `start`
    config_file: str  # "" = run with the built-in defaults
    model_cache: str
    runtime_name: str  # RuntimeDirectory=, relative to %t
    grace_period: float
    user: str = ""  # User= of a system unit; "" = the manager's own user
    # NOTE: default.target is the one target both managers have; a packaged system unit
    # (deploy/debian/) names multi-user.target, as Debian's services do.
    wanted_by: str = "default.target"


def literal(text: str) -> str:
    """Text as a unit file takes it literally: `%` starts a specifier there."""
    return text.replace("%", "%%")


def _word(arg: str) -> str:
    """One word of a unit setting, quoted the way systemd splits words."""
    if arg and not any(c in arg for c in " \t\n\"'\\;"):
        return arg
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'


def exec_start(spec: UnitSpec) -> str:
    args = [*spec.command, "start"]
    if spec.config_file:
        args += ["--config", spec.config_file]
    args += ["--runtime-dir", f"%t/{spec.runtime_name}"]
    # NOTE: Exec lines expand $VAR themselves; $$ is a literal dollar.
    return " ".join(_word(a.replace("$", "$$")) for a in args)


def stop_timeout(grace_period: float) -> int:
    return math.ceil(grace_period) + STOP_MARGIN


def render_unit(spec: UnitSpec) -> str:
    user = f"User={spec.user}\n" if spec.user else ""
    return f"""\
# npu-proxy: the supervisor (`npx-supervisor start`) with its gateway and device workers.
# `npx-supervisor service install` writes this unit with this machine's paths; the generic
# one is deploy/systemd/npu-proxy.service. The reasons: supervisor/service_unit.py.
[Unit]
Description=npu-proxy (Ollama, OpenAI and Anthropic APIs on Intel NPU, GPU and CPU)
After=network.target

[Service]
Type=exec
{user}ExecStart={exec_start(spec)}
Environment={_word("NPU_PROXY_MODEL_PATH=" + spec.model_cache)}
# The supervisor's SIGTERM path: drain the children within grace_period, then exit 0.
KillMode=mixed
KillSignal=SIGTERM
TimeoutStopSec={stop_timeout(spec.grace_period)}
Restart=on-failure
RestartSec=5
StandardOutput=journal
StandardError=journal
SyslogIdentifier=npu-proxy
RuntimeDirectory={spec.runtime_name}
RuntimeDirectoryMode=0700
ReadWritePaths={_word("-" + spec.model_cache)}
NoNewPrivileges=yes
ProtectSystem=strict
ProtectHome=read-only
PrivateTmp=yes
ProtectKernelTunables=yes
ProtectKernelModules=yes
ProtectControlGroups=yes
RestrictSUIDSGID=yes
LockPersonality=yes
# NOTE: no PrivateDevices (the NPU is /dev/accel/*, the GPU /dev/dri/*) and no
# MemoryDenyWriteExecute (OpenVINO's CPU plugin compiles kernels at run time).

[Install]
WantedBy={spec.wanted_by}
"""


# The generic unit of deploy/systemd/: npx-supervisor from PATH, the config in %E (/etc for
# a system unit, ~/.config for a user unit), the model cache in the service user's home.
TEMPLATE = UnitSpec(
    command=["/usr/bin/env", "npx-supervisor"],
    config_file="%E/npu-proxy/config.toml",
    model_cache="%h/.cache/npu-proxy/models",
    runtime_name="npu-proxy-%U",
    grace_period=Config().grace_period,
)


def installed_spec(command: list[str], config_file: Path | None, model_cache: Path,
                   grace_period: float, system: bool, uid: int, user: str = "") -> UnitSpec:
    """The unit for this machine: absolute paths, a runtime folder named like the CLI's
    default for a user unit (npu-proxy-<uid>), /run/npu-proxy for a system one."""
    return UnitSpec(
        command=[literal(c) for c in command],
        config_file=literal(str(config_file.absolute())) if config_file else "",
        model_cache=literal(str(model_cache)),
        runtime_name="npu-proxy" if system else f"npu-proxy-{uid}",
        grace_period=grace_period,
        user=user if system else "",
    )


def unit_path(system: bool, config_home: Path) -> Path:
    """Where the unit goes: /etc/systemd/system, or the user's $XDG_CONFIG_HOME/systemd/user."""
    return SYSTEM_UNIT_DIR / UNIT_NAME if system else config_home / "systemd" / "user" / UNIT_NAME


def systemctl_args(system: bool, *args: str) -> list[str]:
    return ["systemctl", *([] if system else ["--user"]), *args]
