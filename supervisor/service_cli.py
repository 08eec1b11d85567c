"""npx-supervisor service install | uninstall | status: npu-proxy as a system service.

Linux: a systemd unit (supervisor/service_unit.py), a user unit by default or a system one
with --system. Windows: a Windows Service (supervisor/winservice.py, extra `windows`).
"""

from __future__ import annotations

import getpass
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import click

from npu_proxy.supervisor import service_unit
from npu_proxy.supervisor.cli_common import load


def current_command() -> list[str]:
    """The absolute command line of this program, as a service should run it."""
    argv0 = Path(sys.argv[0])
    if argv0.name.startswith("npx-supervisor"):
        found = shutil.which(sys.argv[0]) if not argv0.is_absolute() else str(argv0)
        return [str(Path(found or argv0).absolute())]
    return [sys.executable, "-m", "npu_proxy.supervisor.cli"]


def _config_home() -> Path:
    # NOTE: systemd's own convention for user units, not an npu-proxy setting.
    return Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")


def _home_of(user: str) -> Path:
    if sys.platform == "win32":
        return Path.home()
    import pwd

    try:
        return Path(pwd.getpwnam(user).pw_dir)
    except KeyError:
        return Path.home()


def _make_folder(path: Path, owner: str) -> None:
    """mkdir -p, the folders it creates owned by `owner` (the service's user) if given."""
    missing = [p for p in [path, *path.parents] if not p.exists()]
    path.mkdir(parents=True, exist_ok=True)
    for folder in missing if owner else []:
        shutil.chown(folder, owner, owner)


def _systemctl(system: bool, *args: str, check: bool = True) -> int:
    argv = service_unit.systemctl_args(system, *args)
    click.echo(f"$ {shlex.join(argv)}")
    try:
        code = subprocess.run(argv, check=False).returncode
    except FileNotFoundError as exc:
        raise click.ClickException("systemctl not found: is this a systemd system?") from exc
    if check and code != 0:
        raise click.ClickException(f"{shlex.join(argv)} failed with exit code {code}")
    return code


config_option = click.option(
    "--config", "config_file", type=click.Path(path_type=Path, dir_okay=False, exists=True),
    help="The TOML configuration the service runs with (default: built-in defaults).")
system_option = click.option(
    "--system", is_flag=True,
    help="A system unit in /etc/systemd/system instead of a user unit (Linux).")


@click.group()
def service() -> None:
    """Run npu-proxy as a service: systemd on Linux, a Windows Service on Windows."""


@service.command()
@config_option
@system_option
@click.option("--run-as", help="Account a system unit runs as (default: the user who ran "
              "sudo, else the current user).")
@click.option("--no-start", is_flag=True, help="Install and enable, but do not start now.")
@click.option("--dry-run", is_flag=True, help="Print the unit; change nothing.")
def install(config_file: Path | None, system: bool, run_as: str | None, no_start: bool,
            dry_run: bool) -> None:
    """Install the service running `npx-supervisor start` with this configuration; enable
    and start it unless --no-start."""
    config = load(config_file, None, None, None, None)
    stop_timeout = service_unit.stop_timeout(config.grace_period)
    if sys.platform == "win32":
        from npu_proxy.supervisor import winservice

        spec = winservice.service_spec(current_command(), config_file, stop_timeout)
        if dry_run:
            click.echo(subprocess.list2cmdline(spec.argv))
            return
        manager = winservice.default_manager()
        click.echo(winservice.install(manager, spec))
        return
    user = ""
    model_cache = config.model_cache_path()
    if system:
        user = run_as or os.environ.get("SUDO_USER") or getpass.getuser()
        user = "" if user == "root" else user
        if config.model_cache.startswith("~"):
            # NOTE: "~" is the service user's home, not the home of whoever runs sudo.
            model_cache = _home_of(user or "root") / config.model_cache.lstrip("~").lstrip("/")
    if config_file is None:
        click.echo("note: no --config: the service runs with the built-in defaults", err=True)
    spec = service_unit.installed_spec(current_command(), config_file, model_cache,
                                       config.grace_period, system, os.getuid(), user)
    text = service_unit.render_unit(spec)
    path = service_unit.unit_path(system, _config_home())
    if dry_run:
        click.echo(f"# {path}")
        click.echo(text, nl=False)
        return
    _make_folder(model_cache, user)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    click.echo(f"wrote {path}")
    _systemctl(system, "daemon-reload")
    if no_start:
        _systemctl(system, "enable", service_unit.UNIT_NAME)
    else:
        _systemctl(system, "enable", "--now", service_unit.UNIT_NAME)
    runtime = ("/run" if system else "$XDG_RUNTIME_DIR") + f"/{spec.runtime_name}"
    where = "" if not system else f" --runtime-dir {runtime}"
    click.echo(f"npu-proxy {'enabled' if no_start else 'enabled and started'}; logs: "
               f"journalctl {'' if system else '--user '}-u {service_unit.UNIT_NAME}; "
               f"workers: npx-supervisor status{where}")


@service.command()
@system_option
@click.option("--dry-run", is_flag=True, help="Say what would be removed; change nothing.")
def uninstall(system: bool, dry_run: bool) -> None:
    """Stop and disable the service and remove its unit."""
    if sys.platform == "win32":
        from npu_proxy.supervisor import winservice

        if not dry_run:
            click.echo(winservice.uninstall(winservice.default_manager()))
        return
    path = service_unit.unit_path(system, _config_home())
    if dry_run:
        click.echo(f"would stop and disable {service_unit.UNIT_NAME} and remove {path}")
        return
    if not path.exists():
        raise click.ClickException(f"no unit at {path}: not installed")
    _systemctl(system, "disable", "--now", service_unit.UNIT_NAME, check=False)
    path.unlink()
    click.echo(f"removed {path}")
    _systemctl(system, "daemon-reload")


@service.command()
@system_option
def status(system: bool) -> None:
    """Show whether the service is installed and what systemd says of it."""
    if sys.platform == "win32":
        from npu_proxy.supervisor import winservice

        click.echo(winservice.default_manager().status(winservice.SERVICE_NAME))
        return
    path = service_unit.unit_path(system, _config_home())
    if not path.exists():
        click.echo(f"not installed ({path} does not exist)")
        sys.exit(3)
    click.echo(f"unit: {path}")
    sys.exit(_systemctl(system, "status", "--no-pager", service_unit.UNIT_NAME, check=False))
