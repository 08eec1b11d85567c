"""npx-supervisor pull / models / rm / convert: the model cache from the command line.

These work on the model cache folder directly and need no running server; a running
gateway sees the change at its next request (it re-reads the cache when it changed).
"""

from __future__ import annotations

import sys
from typing import Any

import click

from npu_proxy.models.registry import (
    EMBEDDED,
    LIBRARY,
    ModelNameError,
    ModelSource,
    alias_table,
    canonical,
    embedded,
)
from npu_proxy.models.store import ModelStore
from npu_proxy.protocol.config import Config
from npu_proxy.protocol.control import ControlError, Load, Loaded, NoSupervisor, Status, StatusReply
from npu_proxy.protocol.control import call as control_call
from npu_proxy.supervisor.cli_common import call, config_options, load


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000  # type: ignore[assignment]
    return str(n)


class _Bars:
    """One click progress bar per file, fed by pull progress events."""

    def __init__(self) -> None:
        self.bar: Any = None
        self.digest = ""

    def close(self) -> None:
        if self.bar is not None:
            self.bar.render_finish()
            self.bar = None

    def __call__(self, event: Any) -> None:
        if event.digest and event.total is not None:
            if event.digest != self.digest:
                self.close()
                self.digest = event.digest
                self.bar = click.progressbar(
                    length=max(event.total, 1), label=event.status, file=sys.stderr,
                    show_percent=True, show_pos=False, width=30)
                self.bar.__enter__()
            if self.bar is not None and event.completed is not None:
                step = min(event.completed, self.bar.length) - self.bar.pos
                if step > 0:
                    self.bar.update(step)
            return
        self.close()
        click.echo(event.status, err=event.status != "success")


@click.command()
@click.argument("name")
@config_options
def pull(name: str, **kw: Any) -> None:
    """Download model NAME into the model cache, with a progress bar per file.

    NAME is a registry name (tinyllama, qwen2.5:0.5b, phi3:mini, bge-small, ... or a
    [models] entry of the config file), hf.co/org/repo[:file.gguf] or org/repo. An
    interrupted pull resumes where it stopped when run again."""
    from npu_proxy.models.pull.install import pull as do_pull
    from npu_proxy.models.pull.plan import PullError

    config = load(**kw)
    bars = _Bars()
    try:
        do_pull(config, name, bars)
    except PullError as exc:
        bars.close()
        raise click.ClickException(str(exc)) from exc
    except KeyboardInterrupt:
        bars.close()
        raise click.ClickException("interrupted; pull again to resume") from None


def _rows(config: Config) -> list[tuple[str, str, str, str, str]]:
    store = ModelStore(config.model_cache_path())
    rows = []
    for entry in EMBEDDED:
        rows.append((entry.name, entry.kind, "-", "built in", ""))
    manifests = store.manifests()
    for m in sorted(manifests.values(), key=lambda m: m.name):
        rows.append((m.name, m.kind, _size(m.size), m.source, "npu" if m.npu_ready else ""))
    for r in sorted(store.created().values(), key=lambda r: r.name):
        rows.append((r.name, r.kind, "-", f"created from {r.base or r.file or r.blob}", ""))
    for alias, target in sorted(store.aliases().items()):
        rows.append((alias, "", "-", f"alias of {target}", ""))
    for name, source in sorted(config.models.items()):
        if source.path:
            rows.append((name, source.kind, "-", f"config: {source.path}", ""))
    return rows


def _where(source: ModelSource) -> str:
    return source.path or f"hf.co/{source.repo}" + (f":{source.file}" if source.file else "")


@click.command()
@click.option("--available", is_flag=True, help="List the registry's pullable names instead.")
@config_options
def models(available: bool, **kw: Any) -> None:
    """List the models in the model cache: name, kind, size, source."""
    config = load(**kw)
    header = ("NAME", "KIND", "SIZE", "SOURCE", "")
    if available:
        rows = [header] + [
            (name, s.kind, "-", f"config: {_where(s)}", "npu" if s.npu_ready else "")
            for name, s in sorted(config.models.items())] + [
            (e.name, e.kind, "-", ", ".join(_where(s) for s in e.sources),
             "npu" if any(s.npu_ready for s in e.sources) else "")
            for e in LIBRARY]
    else:
        rows = [header, *_rows(config)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for row in rows:
        click.echo("  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())


@click.command()
@click.argument("name")
@config_options
def rm(name: str, **kw: Any) -> None:
    """Delete pulled or created model NAME from the model cache (or an alias made by copy)."""
    config = load(**kw)
    try:
        key = canonical(name)
    except ModelNameError as exc:
        raise click.ClickException(str(exc)) from exc
    store = ModelStore(config.model_cache_path())
    target = alias_table(config.model_aliases).get(key, key)
    if embedded(target) is not None:
        raise click.ClickException(f"'{name}' is a built-in default model; it cannot be "
                                   "deleted")
    if store.remove_alias(key):
        click.echo(f"deleted alias '{key}'")
        return
    created = store.created()
    if store.get(key) is None and key not in created:
        raise click.ClickException(f"model '{name}' not found")
    users = sorted(r.name for r in created.values() if r.base == key)
    if users:
        raise click.ClickException(f"'{key}' is the base of the created model(s) "
                                   f"{', '.join(users)}; delete them first")
    _unload(config, key)
    if key in created:
        store.remove_created(key)
    else:
        store.remove(key)
    click.echo(f"deleted '{key}'")


def _same(model: str, name: str) -> bool:
    try:
        return canonical(model) == name
    except ModelNameError:
        return False  # a local path


def _unload(config: Config, name: str) -> None:
    """A running instance's workers that run `name` go back to their configured model."""
    homes = [s.name for s in config.workers if _same(s.model_name, name)]
    if homes:
        raise click.ClickException(f"'{name}' is the configured model of worker "
                                   f"{', '.join(homes)}; change the config file first")
    try:
        children = control_call(config, Status(), StatusReply, timeout=1.0).children
    except NoSupervisor:
        return  # NOTE: no instance running
    except ControlError as exc:
        raise click.ClickException(str(exc)) from exc
    for child in children:
        if child.role != "gateway" and child.model == name:
            click.echo(f"worker {child.name} runs '{name}': switching it back")
            call(config, Load(worker=child.name), Loaded)


@click.command()
@click.argument("repo")
@click.option("--weight-format", type=click.Choice(["int4", "int8", "fp16"]),
              default="int4", show_default=True, help="Weight compression.")
@click.option("--sym", is_flag=True, help="Symmetric quantisation (NPU needs it for int4).")
@click.option("--group-size", type=int, default=None,
              help="Quantisation group size; -1 = channel-wise (NPU).")
@click.option("--ratio", type=float, default=None,
              help="Share of layers in the 4-bit format (1.0 for NPU).")
@click.option("--task", default="text-generation-with-past", show_default=True,
              help="optimum export task (feature-extraction for embedding models, "
                   "text-classification for cross-encoder rerankers).")
@click.option("--name", "model_name", help="Install under this name "
              "(default: <repo>:<weight-format>[-sym]).")
@config_options
def convert(repo: str, weight_format: str, sym: bool, group_size: int | None,
            ratio: float | None, task: str, model_name: str | None, **kw: Any) -> None:
    """Convert Transformers repository REPO to OpenVINO IR and install it in the cache.

    For NPU: --weight-format int4 --sym --group-size -1 --ratio 1.0. Needs the optional
    extra: pip install 'npu-proxy[convert]'."""
    from npu_proxy.models.convert import ConvertError, convert_repo

    config = load(**kw)
    try:
        manifest = convert_repo(config, repo, weight_format=weight_format, sym=sym,
                                group_size=group_size, ratio=ratio, task=task,
                                name=model_name, echo=click.echo)
    except ConvertError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"installed '{manifest.name}' ({_size(manifest.size)})")
