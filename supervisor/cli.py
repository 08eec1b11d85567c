"""npx-supervisor: run npu-proxy and manage its device workers.

Configuration comes from built-in defaults, a TOML file (--config or NPU_PROXY_CONFIG),
NPU_PROXY_* environment variables and these flags, in that order of precedence.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import sys
from typing import Any

import click
import msgspec

from npu_proxy.protocol.config import TEST_ONLY_FIELDS, Config, is_loopback_host, redacted
from npu_proxy.protocol.control import Ok, Restart, Shutdown, Start, Status, StatusReply, Stop
from npu_proxy.protocol.logs import setup_logging
from npu_proxy.protocol.states import ProcessState
from npu_proxy.supervisor.cli_common import call, config_options, load
from npu_proxy.supervisor.logfiles import follow as follow_lines
from npu_proxy.supervisor.logfiles import tail

# The commands of modules of their own, imported when named (or listed, for --help).
LAZY_COMMANDS = {"pull": "models_cli", "models": "models_cli", "rm": "models_cli",
                 "convert": "models_cli", "service": "service_cli", "doctor": "doctor"}


class LazyGroup(click.Group):
    """A group whose LAZY_COMMANDS are imported on use.

    NOTE: `start` is on the path to /health/ready, and importing the doctor's, the service's
    and the model commands' modules cost it about a third of the CLI's imports
    (bench/start.py)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *LAZY_COMMANDS})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        module = LAZY_COMMANDS.get(cmd_name)
        if module is None:
            return super().get_command(ctx, cmd_name)
        found = getattr(importlib.import_module(f"npu_proxy.supervisor.{module}"), cmd_name)
        assert isinstance(found, click.Command)
        return found


@click.group(cls=LazyGroup)
def main() -> None:
    """npu-proxy: Ollama, OpenAI and Anthropic APIs on Intel NPU, GPU and CPU."""


@main.command()
@click.argument("worker", required=False)
@click.option("--quiet", is_flag=True, help="Do not echo the children's logs.")
@click.option("--allow-unauthenticated-remote", "allow_remote", is_flag=True,
              help="Serve a non-loopback --host without an API key (anyone who reaches the "
                   "port can use it).")
@click.option("--worker-only", is_flag=True,
              help="Run the workers without a gateway, for another host's gateway (tcp).")
@config_options
def start(worker: str | None, quiet: bool, allow_remote: bool, worker_only: bool,
          **kw: Any) -> None:
    """Start the server (foreground; Ctrl-C stops it), or start one WORKER of a running one."""
    if worker:
        call(load(**kw), Start(worker=worker), Ok)
        click.echo(f"started {worker}")
        return
    from npu_proxy.protocol.sockets import ipc_path_refusal
    from npu_proxy.supervisor.devices import discover_cached
    from npu_proxy.supervisor.runtime_dir import RuntimeDirError, prepare_runtime_dir
    from npu_proxy.supervisor.service.loop import Supervisor
    from npu_proxy.supervisor.service.startup import CannotStart

    # NOTE: None, not False, without the flag: the file or environment may allow it.
    opt_out = True if allow_remote else None

    def reload() -> Config:
        config = load(**kw, devices=found, allow_unauthenticated_remote=opt_out)
        return msgspec.structs.replace(config, worker_only=True) if worker_only else config

    # NOTE: the bind is checked before device discovery, so a refusal comes at once.
    first = load(**kw, allow_unauthenticated_remote=opt_out)
    for refusal in (first.remote_bind_refusal(), ipc_path_refusal(first)):
        if refusal is not None:
            raise click.ClickException(refusal)
    try:
        prepare_runtime_dir(first.runtime_path())
    except RuntimeDirError as exc:
        raise click.ClickException(str(exc)) from exc
    found, cached = discover_cached(first.runtime_path())
    config = reload()
    setup_logging("supervisor", config.log_level, config.log_format)
    logging.getLogger("supervisor").info(
        "devices: %s%s", ", ".join(f"{k} ({v})" for k, v in found.items()),
        " (as found at an earlier start since boot)" if cached else "")
    if not is_loopback_host(config.host) and not config.api_key:
        logging.getLogger("supervisor").warning(
            "ALLOW_UNAUTHENTICATED_REMOTE: listening on %s without an API key; anyone who "
            "can reach port %d can run models, pull and delete them", config.host, config.port)
    try:
        code = Supervisor(config, echo=not quiet, reload=reload).run()
    except (CannotStart, RuntimeDirError) as exc:
        raise click.ClickException(str(exc)) from exc
    sys.exit(code)


@main.command()
@config_options
def keys(**kw: Any) -> None:
    """Make this instance's CURVE keys for ZeroMQ over tcp (if missing) and say which file
    goes where when a gateway uses another host's workers."""
    from npu_proxy.protocol.keys import KeysError, ensure_keys
    from npu_proxy.supervisor.runtime_dir import RuntimeDirError, prepare_runtime_dir

    config = load(**kw)
    try:
        prepare_runtime_dir(config.runtime_path())
        folder = ensure_keys(config)
    except (KeysError, PermissionError, RuntimeDirError) as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"keys in {folder} (secret keys: *.key_secret, never copy them)")
    click.echo(f"  {folder / 'server.key'}: copy to a gateway host using this host's "
               "workers; its [[workers]] public_key_file names it")
    click.echo(f"  {folder / 'client.key'}: copy to a worker host this gateway uses; its "
               "client_key_files lists it")


@main.command()
@click.argument("worker", required=False)
@config_options
def stop(worker: str | None, **kw: Any) -> None:
    """Stop the running instance, or only one WORKER of it (it stays stopped)."""
    config = load(**kw)
    if worker:
        call(config, Stop(worker=worker), Ok)
        click.echo(f"stopping {worker}")
    else:
        call(config, Shutdown(), Ok)
        click.echo("stopping npu-proxy")


@main.command()
@click.argument("worker")
@click.option("--now", is_flag=True, help="Kill at once instead of draining.")
@config_options
def restart(worker: str, now: bool, **kw: Any) -> None:
    """Restart one WORKER: drain its in-flight requests first unless --now."""
    call(load(**kw), Restart(worker=worker, now=now), Ok)
    click.echo(f"restarting {worker}")


def _age(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _last_line(error: str) -> str:
    """An error's last line: OpenVINO's carry the source locations first, the cause last."""
    lines = [line for line in error.splitlines() if line.strip()]
    return lines[-1].strip() if lines else "-"


@main.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@config_options
def status(as_json: bool, **kw: Any) -> None:
    """Show every process: role, device, model, state, pid, uptime, restarts, last error."""
    reply = call(load(**kw), Status(), StatusReply, timeout=3.0)
    if as_json:
        click.echo(msgspec.json.encode({
            "ok": True, "pid": reply.pid, "host": reply.host, "port": reply.port,
            "children": [c.as_json() for c in reply.children]}).decode())
        return
    click.echo(f"npu-proxy on http://{reply.host}:{reply.port} (supervisor pid {reply.pid})")
    header = ("WORKER", "ROLE", "DEVICE", "MODEL", "STATE", "PID", "UPTIME", "RESTARTS",
              "LAST ERROR")
    rows = [header] + [
        (c.name, c.role, c.device or "-", c.model or "-",
         "idle (not loaded)" if c.state == ProcessState.IDLE else c.state.label,
         str(c.pid or "-"), _age(c.uptime) if c.pid else "-", str(c.restarts),
         _last_line(c.last_error))
        for c in reply.children
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header) - 1)]
    for row in rows:
        click.echo("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=False))
                   + "  " + row[-1])


@main.command()
@click.argument("worker")
@click.option("-n", "--lines", default=50, show_default=True)
@click.option("-f", "--follow", is_flag=True, help="Keep printing new lines (Ctrl-C stops).")
@config_options
def logs(worker: str, lines: int, follow: bool, **kw: Any) -> None:
    """Print the tail of WORKER's log file ("gateway" for the gateway)."""
    folder = load(**kw).runtime_path() / "logs"
    path = folder / f"{worker}.log"
    # NOTE: the name becomes a file name: only names the folder actually holds.
    if worker != path.stem or not path.is_file():
        raise click.ClickException(f"no log for {worker!r} in {folder}")
    out = sys.stdout.buffer
    out.write(b"".join(tail(path, lines)))
    out.flush()
    if follow:
        with contextlib.suppress(KeyboardInterrupt):
            for line in follow_lines(path):
                out.write(line)
                out.flush()


@main.command("config")
@config_options
def show_config(**kw: Any) -> None:
    """Print the effective configuration as TOML (with the devices found here; the API key
    shown as <redacted>)."""
    from npu_proxy.supervisor.devices import discover

    config = redacted(load(**kw, devices=discover()))
    click.echo(msgspec.toml.encode(_everything(config)).decode())


@main.command(context_settings={"ignore_unknown_options": True})
@click.argument("client", type=click.Choice(["claude", "codex", "opencode"]))
@click.option("--model", "-m", default="smollm2:135m", show_default=True,
              help="The model the client uses.")
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@config_options
def launch(client: str, model: str, args: tuple[str, ...], **kw: Any) -> None:
    """Start CLIENT (Claude Code, Codex CLI or opencode) pointed at this server, as `ollama
    launch` does: its URL, a key, MODEL and the context length, without editing the client's
    own config files. Arguments after `--` go to the client."""
    from npu_proxy.supervisor.launch import LaunchError
    from npu_proxy.supervisor.launch import launch as start_client

    try:
        sys.exit(start_client(load(**kw), client, model, list(args)))
    except LaunchError as exc:
        raise click.ClickException(str(exc)) from None


def _everything(obj: Any) -> Any:
    """A Struct as plain data with every field, defaults included (TOML has no null), but
    without the test-only fault hooks: they are no supported interface."""
    if isinstance(obj, msgspec.Struct):
        return {f: _everything(getattr(obj, f)) for f in obj.__struct_fields__
                if getattr(obj, f) is not None and f not in TEST_ONLY_FIELDS}
    if isinstance(obj, list):
        return [_everything(v) for v in obj]
    if isinstance(obj, dict):
        return {k: _everything(v) for k, v in obj.items() if v is not None}
    return obj


if __name__ == "__main__":
    main()
