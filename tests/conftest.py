from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from installed import SLOW, SLOW_REASON, Builds, known_skips
from serverctl import MODEL_CACHE, Server

# Removes the run's temporary folders when pytest exits, even by SIGKILL (tests/reaper.py);
# prints the slowest modules after the slowest tests (tests/budget.py); stops a run at once on
# a disk too full for it (tests/preflight.py).
pytest_plugins = ["reaper", "budget", "preflight"]

LLM = "smollm2:135m"


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One real server (gateway + CPU LLM worker + embedding worker + rerank worker, the
    default workers) shared by the suite.

    NOTE: its embed and rerank workers are resident (`lazy = false`), not started by their
    first request as by default: many tests use them, in any order and a few at once, and
    several look at their process (heartbeats, pids, metrics) before asking anything. A
    lazy first request would make whichever test runs first pay a worker's start within its
    client timeout on two shared cores. The lazy path has its own servers (test_lazy.py).
    """
    srv = Server(tmp_path_factory.mktemp("server"), workers=[
        {"name": "llm", "role": "llm"},
        {"name": "embed", "role": "embed", "lazy": False},
        {"name": "rerank", "role": "rerank", "lazy": False},
    ]).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Qwen2.5-Coder-1.5B-Instruct (tests/qwen_coder.py) on a server of its own, with the
    greedy alias AGENT: for the slow tier's real clients (test_client_tool_loop) and
    fill-in-the-middle (test_fill_in_middle), one start for both."""
    # NOTE: imported here: qwen_coder imports reaper, a plugin pytest must import first.
    from qwen_coder import AGENT, QWEN, Unavailable, ensure

    try:
        gguf = ensure(MODEL_CACHE)
    except Unavailable as exc:
        pytest.skip(str(exc))
    # NOTE: bf16 (AMX/AVX512-BF16 where the CPU has them) reads long prompts faster than the
    # llm worker's f32 default, which is tuned for decode. A prompt takes minutes here,
    # hence the stall and inference timeouts; 2 GB of KV cache hold the
    # 32,768-token context with room for the prefix cache that makes later turns cheap.
    srv = Server(tmp_path_factory.mktemp("qwen"), workers=[{
        "name": "llm", "role": "llm", "model": QWEN, "kv_cache_gb": 2.0,
        "stall_timeout": 1800.0, "properties": {"INFERENCE_PRECISION_HINT": "bf16"}}],
        models={QWEN: {"path": str(gguf)}}, inference_timeout=3600.0).start(timeout=1200)
    try:
        # NOTE: /api/show hashes the 1.1 GB file the first time; done here, so the launcher's
        # own /api/show (10 s) reads the context length instead of falling back to 8192.
        shown = httpx.post(srv.url + "/api/show", json={"model": QWEN}, timeout=600)
        assert shown.status_code == 200, shown.text
        # NOTE: sampled (Codex sends no temperature), the 1.5B model's first call varied from
        # run to run, one of two unusable (an exec_command with a `justification` Codex
        # refuses); Codex gets it greedy, as a user would set with a Modelfile's PARAMETER.
        # Claude Code gets it greedy too (sampled, it once wrote paths outside the folder).
        made = httpx.post(srv.url + "/api/create", timeout=600, json={
            "model": AGENT, "from": QWEN, "parameters": {"temperature": 0}, "stream": False})
        assert made.status_code == 200, made.text
        httpx.post(srv.url + "/api/show", json={"model": AGENT}, timeout=600)
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def timeout_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One llm worker behind an inference_timeout of 3 s, which cuts every long generation:
    for the tests of what a timed-out request returns (test_routing) and frees
    (test_hostile).

    NOTE: one server for both rather than one each; a server's start costs 5-15 s of the
    suite on two shared cores, and neither test changes it (each waits for its slot to be
    free before it ends)."""
    # NOTE: the prompt gets no time of its own (min_prefill_rate 0): 3 s, all told.
    srv = Server(tmp_path_factory.mktemp("timeout"),
                 workers=[{"name": "llm", "role": "llm", "min_prefill_rate": 0}],
                 inference_timeout=3.0).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def base_url(server: Server) -> str:
    return server.url


@pytest.fixture(scope="module")
def http(base_url: str) -> Iterator[httpx.Client]:
    """Raw HTTP to the shared server (a module with a server of its own defines its own)."""
    with httpx.Client(base_url=base_url, timeout=120) as c:
        yield c


@pytest.fixture(scope="session")
def tiny_vlm_path() -> Path:
    """The tiny test VLM's IR folder (tests/tiny_vlm.py), built on first use per machine."""
    from serverctl import MODEL_CACHE
    from tiny_vlm import ensure

    return ensure(MODEL_CACHE)


# The session fixtures of the packaging builds, and what each is (tests/installed.py Builds).
PACKAGED = {"frozen_folder": "frozen", "deb_package": "deb", "wheel": "wheel",
            "pipx_command": "pipx"}


# Session fixtures that a group of modules shares on one xdist worker, in the order the
# groups start: the packaging builds' (minutes of mostly one core, while the other worker
# tests), then Qwen's server (the longest group), then every other module as a group of its
# own, as collected. `make test` runs two workers (`-n 2`): a third of two cores was idle in a
# one-process run (server starts, clients, polls).
SHARED = {"packaging": (*PACKAGED, "_builds"), "qwen": ("qwen",),
          "timeout_server": ("timeout_server",)}
_TESTS = Path(__file__).resolve().parent


def _group_using(fixtures: set[str]) -> str | None:
    """The SHARED group of a test that uses these fixtures (its closure)."""
    return next((group for group, names in SHARED.items() if fixtures.intersection(names)),
                None)


def _group_named(source: str) -> str | None:
    """The SHARED group of a module whose source names one of its fixtures as a parameter
    (`name: Type`)."""
    return next((group for group, names in SHARED.items()
                 if any(re.search(rf"\b{name}\s*:\s*[A-Z]", source) for name in names)), None)


@functools.cache
def _module_group(module: str) -> str:
    """A module's xdist group, from its source (xdist's controller does not collect)."""
    path = _TESTS.parent / module
    return _group_named(path.read_text()) or module if path.is_file() else module


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's scheduler of whole groups (`_module_group`), in collection order.

    NOTE: not `--dist loadgroup`: its `xdist_group` marks rename node ids through an
    attribute pytest 9 no longer reads, so every test went its own way."""
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False  # NOTE: the groups in collection order

    class ByGroup(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return _module_group(nodeid.split("::", 1)[0])

    return ByGroup(config, log)


# Outside the slow tier's runs (tests/installed.py SLOW) its tests are skipped: a skipif, so
# `_wanted` sees it and starts no build and no server for them.
SLOW_TIER = pytest.mark.skipif(True, reason=SLOW_REASON)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Outside CI the slow tier is skipped (SLOW_TIER). In one process: the modules that use
    a packaging build run last, so the builds have the whole run before them to take idle
    cycles in (`_early_builds`). On xdist's workers: the shared groups first, and each
    module's group as its source says is the one its fixtures say (or the run stops, naming
    the module)."""
    if not SLOW:
        for item in items:
            if item.get_closest_marker("slow") is not None:
                item.add_marker(SLOW_TIER)
    if not hasattr(config, "workerinput"):
        late = {item.module for item in items if isinstance(item, pytest.Function)
                and set(PACKAGED) & set(item.fixturenames)}
        items.sort(key=lambda item: getattr(item, "module", None) in late)
        return
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        used = _group_using(set(getattr(item, "fixturenames", ())))
        if used is not None and used != _module_group(module):
            raise pytest.UsageError(f"{module} uses the shared fixture of group {used} but its "
                                    "source does not name it as a typed parameter "
                                    "(tests/conftest.py _module_group)")
    rank = {group: at for at, group in enumerate(SHARED)}
    items.sort(key=lambda item: rank.get(_module_group(item.nodeid.split("::", 1)[0]),
                                         len(SHARED)))


def _wanted(session: pytest.Session, fixture: str) -> bool:
    """Does a test of this run that is not skipped already (a skipif whose condition is
    known) use `fixture`?"""
    return any(fixture in getattr(item, "fixturenames", ()) and not known_skips(item)
               for item in session.items)


def _start_builds(request: pytest.FixtureRequest,
                  tmp_path_factory: pytest.TempPathFactory) -> Builds | None:
    products = {made for fixture, made in PACKAGED.items() if _wanted(request.session, fixture)}
    return Builds(tmp_path_factory.mktemp("packaging"), products) if products else None


@pytest.fixture(scope="session", autouse=True)
def _early_builds(request: pytest.FixtureRequest,
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[Builds | None]:
    """The packaging builds start with the session when a test of this run will use them
    (minutes of mostly one core, in the idle cycles of the tests before them), not when
    that test's turn comes.

    NOTE: not on an xdist worker, which collects every test but runs only its groups: there
    the packaging group's first test starts them (`_builds`), and that group runs first."""
    builds = None if hasattr(request.config, "workerinput") else _start_builds(
        request, tmp_path_factory)
    yield builds
    if builds is not None:
        builds.stop()


@pytest.fixture(scope="session")
def _builds(_early_builds: Builds | None, request: pytest.FixtureRequest,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[Builds]:
    """The run's packaging builds: the early ones, or else started now."""
    if _early_builds is not None:
        yield _early_builds
        return
    builds = _start_builds(request, tmp_path_factory)
    assert builds is not None, "no test of this run was found to use the build"
    yield builds
    builds.stop()


@pytest.fixture(scope="session")
def frozen_folder(_builds: Builds) -> Path:
    """The PyInstaller one-folder build of the tree, made once for the slow tests that use
    it (the folder itself, the Debian package)."""
    return _builds.folder()


@pytest.fixture(scope="session")
def deb_package(_builds: Builds) -> Path:
    """The Debian package deploy/debian/build.py made from the frozen folder."""
    return _builds.deb()


@pytest.fixture(scope="session")
def wheel(_builds: Builds) -> Path:
    """The wheel of the tree."""
    return _builds.wheel()


@pytest.fixture(scope="session")
def pipx_command(_builds: Builds) -> Path:
    """`npx-supervisor` of the wheel installed with pipx (and the model packages with it)."""
    return _builds.pipx_command()

