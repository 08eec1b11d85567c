"""What every `npx-supervisor` command shares: the configuration options and the request to
a running instance's control socket."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click
import msgspec
import zmq

from protocol.config import Config, ConfigError, load_config
from protocol.sockets import control_endpoint

F = TypeVar("F", bound=Callable[..., Any])


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
         devices: dict[str, str] | None = None) -> Config:
    """The configuration from the options of `config_options`."""
    try:
        return load_config(config_file, overrides={"host": host, "port": port,
                                                   "runtime_dir": runtime_dir,
                                                   "transport": transport}, devices=devices)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from exc


def request(config: Config, request: dict[str, Any], timeout_ms: int = 30_000) -> Any:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(control_endpoint(config))
    try:
        sock.send(msgspec.json.encode(request))
        if not sock.poll(timeout_ms):
            raise click.ClickException(
                f"no npu-proxy instance answers at {control_endpoint(config)}")
        reply = msgspec.json.decode(sock.recv())
    finally:
        sock.close(0)
    if not reply.get("ok"):
        raise click.ClickException(reply.get("error", "failed"))
    return reply
