"""The layers of DESIGN.md, checked on the source: who may import whom, and no import cycles.

    gateway/   supervisor/   workers/ (the only OpenVINO importers)
          \\          |          /
                   models/
                      |
                  protocol/
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("gateway", "supervisor", "workers", "models", "protocol")
# The one import package the wheel installs; the folders above are its subpackages.
NAMESPACE = "npu_proxy"
# What each package may import of the project (every import, lazy ones included).
MAY_IMPORT = {
    "gateway": {"gateway", "models", "protocol"},
    "supervisor": {"supervisor", "models", "protocol"},
    "workers": {"workers", "models", "protocol"},
    "models": {"models", "protocol"},
    "protocol": {"protocol"},
}
@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the imported project module
    line: int
    # At module level (including `if TYPE_CHECKING:`), not inside a function.
    module_level: bool


def _module_name(path: Path) -> str:
    """The module's name without the `npu_proxy.` namespace it is installed under."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _unprefixed(name: str) -> str:
    return name.removeprefix(f"{NAMESPACE}.")


def _sources() -> dict[str, Path]:
    return {_module_name(path): path for package in PACKAGES
            for path in sorted((ROOT / package).rglob("*.py"))}


def _walk(node: ast.AST, module_level: bool) -> Iterator[tuple[ast.AST, bool]]:
    for child in ast.iter_child_nodes(node):
        inner = module_level and not isinstance(
            child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
        yield child, inner
        yield from _walk(child, inner)


def _imports(name: str, path: Path, modules: set[str]) -> Iterator[Import]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    package = f"{NAMESPACE}.{package}"
    for node, module_level in _walk(ast.parse(path.read_text(), str(path)), True):
        if isinstance(node, ast.Import):
            targets = [_unprefixed(alias.name) if alias.name.startswith(f"{NAMESPACE}.")
                       else f"UNPREFIXED {alias.name}" if alias.name.split(".")[0] in PACKAGES
                       else alias.name for alias in node.names]
            for target in targets:
                if target.startswith("UNPREFIXED"):
                    yield Import(name, target, node.lineno, module_level)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            if base.split(".")[0] in PACKAGES:
                # NOTE: a bare `gateway.x` would import the folder under a second name (or,
                # installed, not at all): the project's imports all go through the namespace.
                yield Import(name, f"UNPREFIXED {base}", node.lineno, module_level)
                continue
            base = _unprefixed(base)
            # `from a import b` imports the module a.b when there is one, else a name of a.
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                       for alias in node.names]
        else:
            continue
        for target in targets:
            if target.split(".")[0] in PACKAGES:
                yield Import(name, target, node.lineno, module_level)


def _project_imports() -> list[Import]:
    sources = _sources()
    modules = set(sources)
    return [imp for name, path in sources.items() for imp in _imports(name, path, modules)]


def _cycles(edges: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components with more than one module (or a self-import)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component: set[str] = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1 or node in edges.get(node, ()):
                found.append(component)

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def _fresh_modules(*imports: str) -> list[str]:
    """The modules a fresh interpreter holds after importing `imports` (this test process has
    loaded OpenVINO and much else through other tests)."""
    code = ("import json, sys\n" + "".join(f"import {name}\n" for name in imports)
            + "print(json.dumps(sorted(sys.modules)))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    modules: list[str] = json.loads(out)
    return modules


def test_gateway_supervisor_and_models_load_no_openvino() -> None:
    """The gateway, the CLI and the model tools run without OpenVINO (and without workers/)."""
    banned = ("openvino", "openvino_genai", "npu_proxy.workers")
    loaded = _fresh_modules("npu_proxy.gateway.app", "npu_proxy.supervisor.cli",
                            "npu_proxy.models.locate", "npu_proxy.models.pull.install")
    assert [m for m in loaded if m.startswith(banned)] == []


def test_gateway_start_loads_no_module_only_some_requests_need() -> None:
    """The image URL fetch (httpx) and the speech encoders (soundfile, soxr) are imported on
    use, and numpy and Pillow by the first request that needs them, in a thread (gateway/http/
    preload.py): at start they cost the gateway time before it can bind (bench/start.py)."""
    banned = ("httpx", "soundfile", "soxr", "click", "rich", "pygments", "numpy", "PIL")
    loaded = _fresh_modules("npu_proxy.gateway.__main__")
    assert [m for m in loaded if m.split(".")[0] in banned] == []


def test_supervisor_start_loads_no_module_only_other_commands_need() -> None:
    """`npx-supervisor start` spawns the gateway after its own imports: the doctor's, the
    service's and the model commands' modules (supervisor/cli.py LazyGroup), the model
    registry (a Load's check) and asyncio (zmq.auth.thread, for CURVE over tcp only) are
    imported on use (bench/start.py)."""
    banned = {"asyncio", "npu_proxy.supervisor.doctor", "npu_proxy.supervisor.service_cli",
              "npu_proxy.supervisor.models_cli", "npu_proxy.models.locate", "zmq.auth.thread"}
    loaded = _fresh_modules("npu_proxy.supervisor.cli", "npu_proxy.supervisor.devices",
                            "npu_proxy.supervisor.runtime_dir",
                            "npu_proxy.supervisor.service.loop")
    assert [m for m in loaded if m in banned] == []


def test_start_finds_kept_devices_and_default_workers_without_importlib_metadata() -> None:
    """Before the supervisor spawns the gateway it looks up the kept devices (keyed by the
    boot, this Python and this OpenVINO) and, when the configuration lists no workers, which
    embedded models' packages are installed: importlib.metadata for either (OpenVINO's
    version, the packages' distributions) was 0.02-0.03 s of CPU on that serial path."""
    code = ("import json, sys\n"
            "from npu_proxy.supervisor.devices import boot_key\n"
            "from npu_proxy.protocol.config import default_workers\n"
            "boot_key()\n"
            "default_workers(['CPU'])\n"
            "print(json.dumps('importlib.metadata' in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    assert json.loads(out) is False


def test_imports_follow_the_layers() -> None:
    wrong = [f"{imp.source} (line {imp.line}) imports {imp.target}"
             for imp in _project_imports()
             if imp.target.split(".")[0] not in MAY_IMPORT[imp.source.split(".")[0]]]
    assert wrong == []


def test_no_import_cycles() -> None:
    # NOTE: imports inside functions count too (issue 45: conversion.py and gguf_ir.py
    # imported each other lazily), and so does one under `if TYPE_CHECKING:`: lazy or not,
    # the two modules depend on each other.
    edges: dict[str, set[str]] = {}
    lines: dict[tuple[str, str], int] = {}
    for imp in _project_imports():
        edges.setdefault(imp.source, set()).add(imp.target)
        lines.setdefault((imp.source, imp.target), imp.line)
    cycles = [frozenset(c) for c in _cycles(edges)]
    report = [", ".join(f"{a} -> {b} (line {lines[a, b]})" for a in sorted(c)
                        for b in sorted(edges[a] & c))
              for c in cycles]
    assert report == [], "import cycles:\n" + "\n".join(report)


# The gateway's rooms, lowest first: what each may import of the gateway. `core` is the
# request-independent machinery (broker, router, catalog), `content` works on what requests
# carry and imports no Starlette, `http` is the middleware and what every handler does with a
# request, `api` the dialects, `admin` model administration, `pages` the status page and the
# OpenAPI document; `app` puts them together.
ROOMS = {
    "core": {"core"},
    "content": {"core", "content"},
    "http": {"core", "http"},
    "api": {"core", "content", "http", "api"},
    "admin": {"core", "content", "http", "admin"},
    "pages": {"core", "content", "http", "api", "admin", "pages"},
}


def _room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "gateway" and len(parts) > 2 else None


def test_gateway_rooms_import_only_below() -> None:
    wrong = [f"{imp.source} (line {imp.line}) imports {imp.target}"
             for imp in _project_imports()
             if (room := _room(imp.source)) in ROOMS and imp.target.startswith("gateway.")
             and _room(imp.target) not in ROOMS[room]]
    assert wrong == []


# The request path: the one place a dialect's request reaches the server (routes it, waits for a
# load, watches for a disconnect, answers errors in the API's shape, releases the worker's
# stream), with the limits it holds requests to. A dialect imports nothing of the gateway's
# core: what it names of it (errors, ids, answers, models and their facts) the path
# re-exports, and the machinery that routes and dispatches is the path's alone.
PATH_MODULES = {"gateway.api.request_path", "gateway.api.dispatch", "gateway.api.limits"}
# What holds the path's machinery: a dialect that reads one of these attributes goes round it.
PATH_ATTRIBUTES = {"router", "broker", "switcher", "table"}


def test_dialects_reach_the_server_only_through_the_request_path() -> None:
    wrong = [f"{imp.source} (line {imp.line}) imports {imp.target}"
             for imp in _project_imports()
             if _room(imp.source) == "api" and imp.source not in PATH_MODULES
             and _room(imp.target) == "core"]
    sources = _sources()
    for name, path in sorted(sources.items()):
        if _room(name) != "api" or name in PATH_MODULES:
            continue
        wrong += [f"{name} (line {node.lineno}) reads .{node.attr}"
                  for node in ast.walk(ast.parse(path.read_text()))
                  if isinstance(node, ast.Attribute) and node.attr in PATH_ATTRIBUTES]
    assert wrong == []


def test_content_processing_imports_no_starlette() -> None:
    """What works on a request's content is testable without a web framework."""
    content = sorted((ROOT / "gateway" / "content").rglob("*.py"))
    found = [str(path.relative_to(ROOT)) for path in content
             if any(isinstance(node, ast.Import | ast.ImportFrom)
                    and any(name.split(".")[0] == "starlette"
                            for name in ([node.module or ""] if isinstance(node, ast.ImportFrom)
                                         else [a.name for a in node.names]))
                    for node in ast.walk(ast.parse(path.read_text())))]
    assert found == []


MAX_MODULES_PER_FOLDER = 15
MAX_LINES = 400
# NOTE: modules still over MAX_LINES, each to be split by its concepts (issue 30). The list
# only shrinks: a module that grows past the limit, or one listed that no longer needs to be,
# fails the test below.
OVER_LIMIT: set[str] = set()


def test_folders_and_modules_stay_small() -> None:
    folders: dict[Path, int] = {}
    long = set()
    for path in _sources().values():
        folders[path.parent] = folders.get(path.parent, 0) + (path.name != "__init__.py")
        if len(path.read_text().splitlines()) > MAX_LINES:
            long.add(str(path.relative_to(ROOT)))
    crowded = {str(f.relative_to(ROOT)): n for f, n in folders.items()
               if n > MAX_MODULES_PER_FOLDER}
    assert crowded == {}
    assert long == OVER_LIMIT


def test_the_wheel_lists_every_package() -> None:
    """pyproject.toml names each folder under the `npu_proxy` namespace; a new folder not
    listed there would be missing from the wheel."""
    import tomllib

    settings = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = {f"{NAMESPACE}.{_module_name(path)}" for path in _sources().values()
               if path.name == "__init__.py"}
    assert set(settings["packages"]) == folders
    assert settings["package-dir"] == {f"{NAMESPACE}.{p}": p for p in PACKAGES}


# A block of this many lines found in two modules of one of these folders is one concept
# written twice: the dialects share the request path, the engines their bases.
REPEAT_LINES = 6
NO_REPEATS = ("gateway/api", "workers")
_PUNCTUATION = set("()[]{},:")


def _code_lines(path: Path) -> list[tuple[int, str]]:
    """The module's lines that say something, white space folded: no blank lines, comments,
    imports (their continuation lines too) or lines of brackets alone."""
    source = path.read_text()
    skip: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import | ast.ImportFrom):
            skip.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    lines = []
    for number, line in enumerate(source.splitlines(), 1):
        text = " ".join(line.split())
        if (number in skip or not text or text.startswith("#")
                or set(text) <= _PUNCTUATION):
            continue
        lines.append((number, text))
    return lines


def _repeats(folder: str) -> list[str]:
    """Each block of REPEAT_LINES lines that stands in two modules under `folder`."""
    seen: dict[tuple[str, ...], str] = {}
    found: list[str] = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        name = str(path.relative_to(ROOT))
        lines = _code_lines(path)
        reported: set[str] = set()
        for at in range(len(lines) - REPEAT_LINES + 1):
            window = tuple(text for _, text in lines[at:at + REPEAT_LINES])
            first = seen.setdefault(window, f"{name}:{lines[at][0]}")
            other = first.rpartition(":")[0]
            if other != name and other not in reported:
                reported.add(other)
                found.append(f"{name}:{lines[at][0]} repeats {first}")
    return found


def test_no_block_repeated_between_dialects_or_engines() -> None:
    assert [r for folder in NO_REPEATS for r in _repeats(folder)] == []
