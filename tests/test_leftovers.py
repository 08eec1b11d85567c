"""Nothing a test starts outlives the test process, however it ends (issue 46): a process
that started a server (as pytest does) is SIGKILLed, and the supervisor, the gateway and the
workers all end; a pytest run SIGKILLed in the middle leaves neither a process nor a
temporary folder (tests/reaper.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from reaper import RUN_ENV
from serverctl import alive, descendants, kill_all, wait_for

TESTS = Path(__file__).parent
# NOTE: the servers below serve the full model, not serverctl.small_llm: their one worker is
# lazy, so no model is loaded in these tests.

_STARTER = """
import sys, time
sys.path.insert(0, sys.argv[2])
from pathlib import Path
from serverctl import Server
srv = Server(Path(sys.argv[1]), workers=[{"name": "llm", "role": "llm", "lazy": True}])
srv.start()
print(srv.proc.pid, flush=True)
time.sleep(3600)
"""


def test_a_killed_test_process_leaves_no_server(tmp_path: Path) -> None:
    starter = subprocess.Popen(
        [sys.executable, "-c", _STARTER, str(tmp_path), str(Path(__file__).parent)],
        stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    tree: set[int] = set()
    try:
        assert starter.stdout is not None
        supervisor = int(starter.stdout.readline())
        tree = descendants(starter.pid)
        assert supervisor in tree and len(tree) >= 2  # the supervisor and its gateway
        os.kill(starter.pid, signal.SIGKILL)
        starter.wait()
        wait_for(lambda: not any(alive(pid) for pid in tree), timeout=60,
                 what=f"processes left after the test process was killed: {tree}")
    finally:
        kill_all(starter, tree)


_INNER_TEST = """
import json, os, tempfile
from pathlib import Path
from reaper import build_prefix
from serverctl import MODEL_CACHE, Server


def test_stays(tmp_path):
    srv = Server(tmp_path / "srv", workers=[{"name": "llm", "role": "llm", "lazy": True}])
    srv.start()
    MODEL_CACHE.mkdir(parents=True, exist_ok=True)
    scratch = tempfile.mkdtemp(dir=MODEL_CACHE, prefix=build_prefix("leftover-probe"))
    report = {"supervisor": srv.proc.pid, "scratch": scratch, "base": str(tmp_path)}
    Path(os.environ["INNER_REPORT"]).write_text(json.dumps(report))
    srv.proc.wait()
"""


def test_a_killed_pytest_run_leaves_no_process_and_no_folder(tmp_path: Path) -> None:
    inner = tmp_path / "inner"
    inner.mkdir()
    (inner / "test_inner.py").write_text(_INNER_TEST)
    report = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if k != RUN_ENV}  # NOTE: a run of its own
    env |= {"PYTHONPATH": str(TESTS), "INNER_REPORT": str(report)}
    # NOTE: a short name: the inner server's IPC paths lie under it (a Unix socket path has
    # 107 bytes at most; an xdist worker's base folder adds its own level).
    base = tmp_path / "b"
    run = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "reaper",
         "--basetemp", str(base), "--rootdir", str(inner), str(inner / "test_inner.py")],
        cwd=inner, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    tree: set[int] = set()
    try:
        wait_for(lambda: report.exists() and report.read_text(), timeout=240,
                 what="the inner run's server")
        made = json.loads(report.read_text())
        tree = descendants(run.pid)
        assert made["supervisor"] in tree
        assert Path(made["scratch"]).is_dir() and base.is_dir()
        os.kill(run.pid, signal.SIGKILL)
        run.wait()
        wait_for(lambda: not any(alive(pid) for pid in tree), timeout=60,
                 what=f"processes left after pytest was killed: {tree}")
        wait_for(lambda: not base.exists() and not Path(made["scratch"]).exists(),
                 timeout=90, what="the killed run's temporary folders removed")
    finally:
        kill_all(run, tree)
