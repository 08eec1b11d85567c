"""The supervisor's life cycle: start, status, SIGTERM with no process left behind."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from serverctl import Server, alive, descendants, small_llm

from npu_proxy.protocol.config import ConfigError, load_config

# NOTE: the servers whose llm worker loads serve the embedded model cut to two layers
# (serverctl.small_llm): these tests are about processes, never what the model says. The
# embed-only and lazy servers load no LLM and are left as they are.


def test_sigterm_leaves_no_process(tmp_path: Path) -> None:
    srv = Server(tmp_path, workers=[{"name": "llm", "role": "llm"}], models=small_llm()).start()
    assert srv.proc is not None
    kids = descendants(srv.proc.pid)
    pids = {c["pid"] for c in srv.children().values()}
    assert len(pids) == 2 and pids <= kids
    out = srv.cli("status").stdout
    assert "llm" in out and "ready" in out and "smollm2:135m" in out
    r = httpx.post(srv.url + "/v1/completions", json={"model": "smollm2", "prompt": "Hi",
                                                      "max_tokens": 2})
    assert r.status_code == 200
    left = srv.stop()
    assert srv.proc.returncode == 0
    assert left == set()
    assert not any(alive(p) for p in kids)
    assert "npu-proxy listening on http://127.0.0.1:" in srv.logs()


def test_stop_command_and_private_runtime_folder(tmp_path: Path) -> None:
    srv = Server(tmp_path, workers=[{"name": "llm", "role": "llm"}], models=small_llm()).start()
    assert srv.proc is not None
    runtime = Path(srv.config.runtime_dir)
    assert runtime.stat().st_mode & 0o777 == 0o700
    assert (runtime / "config.json").stat().st_mode & 0o777 == 0o600
    kids = descendants(srv.proc.pid)
    assert "stopping" in srv.cli("stop").stdout
    assert srv.proc.wait(30) == 0
    assert not any(alive(p) for p in kids)
    assert srv.cli("status", check=False).returncode != 0


def test_configuration_precedence(tmp_path: Path) -> None:
    """Defaults < TOML file < NPU_PROXY_* environment < command-line flags."""
    path = tmp_path / "c.toml"
    path.write_text('port = 12000\nhost = "127.0.0.2"\nlog_level = "DEBUG"\n')
    assert load_config(env={}).port == 11435
    assert load_config(env={}).host == "127.0.0.1"
    from_file = load_config(path, env={})
    assert (from_file.port, from_file.host, from_file.log_level) == (12000, "127.0.0.2", "DEBUG")
    env = {"NPU_PROXY_PORT": "12001", "NPU_PROXY_CONFIG": str(path)}
    from_env = load_config(env=env)
    assert (from_env.port, from_env.host) == (12001, "127.0.0.2")
    assert load_config(env=env, overrides={"port": 12002}).port == 12002
    with pytest.raises(ConfigError, match="NPU_PROXY_PORT"):
        load_config(env={"NPU_PROXY_PORT": "eleven"})


def test_children_die_with_a_killed_supervisor(tmp_path: Path) -> None:
    """Even SIGKILL of the supervisor (no exit path runs) leaves no orphan: parent-death
    signal."""
    srv = Server(tmp_path, workers=[{"name": "llm", "role": "llm"}], models=small_llm()).start()
    assert srv.proc is not None
    kids = descendants(srv.proc.pid)
    assert len(kids) >= 2
    # NOTE: a second start in its runtime folder finds the control socket answering (the
    # start's quick check of the socket file says "someone listens", the Ping confirms).
    rt = srv.config.runtime_dir
    second = Server(tmp_path / "second", workers=[], runtime_dir=rt)
    try:
        second.start(wait=False)
        assert second.proc is not None
        assert second.proc.wait(120) != 0
        assert "an npu-proxy instance already runs" in second.logs()
    finally:
        second.stop()
    srv.proc.kill()
    srv.proc.wait(10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(alive(p) for p in kids):
        time.sleep(0.1)
    assert not any(alive(p) for p in kids)
    # NOTE: the killed supervisor left its socket files: nothing listens on them, and a new
    # start in the same folder goes ahead.
    again = Server(tmp_path / "again", workers=[], runtime_dir=rt)
    try:
        again.start()
        assert httpx.get(again.url + "/health", timeout=10).status_code == 200
    finally:
        again.stop()


def test_worker_properties_reach_openvino(tmp_path: Path) -> None:
    """`properties` in a worker section go to its pipeline; a name OpenVINO does not know
    fails that worker with OpenVINO's own message, and the other workers serve on."""
    srv = Server(tmp_path, workers=[
        {"name": "embed", "role": "embed", "lazy": False,
         "properties": {"INFERENCE_NUM_THREADS": 1}},
        {"name": "typo", "role": "embed", "max_restarts": 1, "lazy": False,
         "properties": {"INFERENCE_NUM_THREAD": 1}},
    ], backoff_initial=0.2).start(wait=False)
    try:
        srv.wait_state("embed", ("ready",), timeout=120)
        assert "'INFERENCE_NUM_THREADS': 1" in srv.worker_log("embed")
        typo = srv.wait_state("typo", ("failed",), timeout=120)
        assert "INFERENCE_NUM_THREAD" in typo["last_error"], typo
        r = httpx.post(srv.url + "/api/embed", json={"model": "all-minilm", "input": "hi"},
                       timeout=60)
        assert r.status_code == 200 and r.headers["x-npu-proxy-worker"] == "embed"
        shown = srv.cli("config").stdout
        assert "INFERENCE_NUM_THREADS = 1" in shown
        row = next(line for line in srv.cli("status").stdout.splitlines()
                   if line.startswith("typo "))
        # NOTE: the cause (OpenVINO's last line), not the source location it starts with.
        assert "INFERENCE_NUM_THREAD" in row and "Exception from" not in row, row
    finally:
        assert srv.stop() == set()


def test_two_instances_of_one_user_each_have_a_runtime_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A second server of the same user on another port (a second checkout, a test run
    beside a running server) was refused: "an npu-proxy instance already runs in" the one
    default folder per user. The default folder is one per instance now (issue 46)."""
    xdg = tmp_path / "xdg"
    xdg.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    lazy = [{"name": "llm", "role": "llm", "lazy": True}]
    first = Server(tmp_path / "a", workers=lazy, runtime_dir="")
    second = Server(tmp_path / "b", workers=lazy, runtime_dir="")
    try:
        first.start()
        second.start()
        for srv in (first, second):
            assert httpx.get(f"{srv.url}/health").status_code == 200
            status = srv.cli("status")
            assert status.returncode == 0 and "llm" in status.stdout
        folders = sorted(p.name for p in xdg.iterdir())
        assert len(folders) == 2 and all(name.startswith("npu-proxy-") for name in folders)
    finally:
        first.stop()
        second.stop()


# The main-thread wait of an idle embed, rerank or speech worker (InboxEngine._arrivals),
# with a signal handler that runs past the wait's deadline, as SIGTERM's drain may.
_INBOX_WAIT = """
import os, signal, threading, time
from npu_proxy.protocol.config import WorkerSpec
from npu_proxy.workers.engine import InboxEngine
stop = threading.Event()
def handler(signum, frame):
    time.sleep(0.2)
    stop.set()
signal.signal(signal.SIGUSR1, handler)
threading.Timer(0.01, os.kill, (os.getpid(), signal.SIGUSR1)).start()
for _ in InboxEngine(WorkerSpec(name="embed", role="embed"), lambda frame: None)._arrivals(stop):
    pass
print("stopped")
"""


def test_an_idle_worker_told_to_stop_in_its_inbox_wait_stops() -> None:
    """CPython 3.11's SimpleQueue.get(timeout=...) waits for ever once a signal handler has
    outlasted its deadline: an idle embed worker unloaded after its keep_alive was killed at
    the grace period instead of stopping (seen in test_lazy)."""
    done = subprocess.run([sys.executable, "-c", _INBOX_WAIT], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "stopped", done.stderr
