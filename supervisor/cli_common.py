"""What every `npx-supervisor` command shares: the configuration options and the call to a
running instance's control socket (protocol/control.py) with click's error reporting."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click
import msgspec

from npu_proxy.protocol import control
from npu_proxy.protocol.config import Config, ConfigError, load_config

F = TypeVar("F", bound=Callable[..., Any])
R = TypeVar("R", bound=msgspec.Struct)


def config_options(func: F) -> F:
    for option in reversed([
        click.option("--config", "config_file", type=click.Path(path_type=Path),
                     help="TOML configuration file."),
        click.option("--host", help="Address to listen on (default 127.0.0.1)."),
        click.option("--port", type=int, help="HTTP port (default 11435)."),
        click.option("--runtime-dir", help="Private folder for sockets and logs."),
        click.option("--transport", type=click.Choice(["ipc", "tcp"]),
                     help="ZeroMQ transport between processes."),
    ]):
        func = option(func)
    return func


def load(config_file: Path | None, host: str | None, port: int | None,
         runtime_dir: str | None, transport: str | None,
         devices: dict[str, str] | None = None,
         allow_unauthenticated_remote: bool | None = None) -> Config:
    """The configuration from the options of `config_options` (and `start`'s opt-out)."""
    try:
        return load_config(config_file, overrides={
            "host": host, "port": port, "runtime_dir": runtime_dir, "transport": transport,
            "allow_unauthenticated_remote": allow_unauthenticated_remote}, devices=devices)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from exc


def call(config: Config, command: control.Command, expect: type[R],
         timeout: float = 30.0) -> R:
    """`control.call`, its errors (no instance, refused) reported as click errors."""
    try:
        return control.call(config, command, expect, timeout)
    except control.ControlError as exc:
        raise click.ClickException(str(exc)) from exc
