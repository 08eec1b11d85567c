"""Helpers of the tests of npu-proxy as a user installs it (tests/test_packaging.py: the
wheel with pipx, the PyInstaller folder; tests/test_deb.py: the Debian package): a copy of
the tree to build from, the frozen folder, a user's environment, and what a user of the
installed server sees."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import httpx
from serverctl import stop_process, with_parent

ROOT = Path(__file__).resolve().parent.parent
# The slow builds (PyInstaller, the .deb) run in CI or when asked for.
SLOW = bool(os.environ.get("CI") or os.environ.get("NPU_PROXY_SLOW_TESTS"))


def source_copy(dest: Path) -> Path:
    """The project's files without local state (a stale build/ would leak into a wheel)."""
    shutil.copytree(ROOT, dest, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache"))
    return dest


class Builds:
    """The packaging builds of a run, in a background thread, one after the other, each at
    the lowest CPU priority (they take the cycles the tests leave idle: ~2 CPU-minutes of
    PyInstaller and ~1 of gzip, mostly one core) and ended with the test process: the
    PyInstaller one-folder build of a copy of the tree (the copy is gone afterwards, so the
    folder can only use what it carries), then, when `deb` is asked for, the Debian package
    deploy/debian/build.py makes from it. `folder()` and `deb()` wait for theirs."""

    def __init__(self, tmp: Path, deb: bool) -> None:
        self.tmp = tmp
        self.want_deb = deb
        self.frozen = threading.Event()
        self.outcomes: dict[str, tuple[int, str]] = {}  # step: exit code, output's end
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._stopped = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _step(self, name: str, command: list[str]) -> bool:
        log_path = self.tmp / f"{name}.log"
        with open(log_path, "wb") as log:
            with self._lock:
                if self._stopped:
                    return False
                self._proc = subprocess.Popen(
                    with_parent(command), cwd=self.tmp, stdout=log, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL, preexec_fn=lambda: os.nice(19))
            code = self._proc.wait()
        self.outcomes[name] = (code, log_path.read_text(errors="replace")[-9000:])
        return code == 0

    def _run(self) -> None:
        try:
            src = source_copy(self.tmp / "src")
            frozen = self._step("pyinstaller", [
                sys.executable, "-m", "PyInstaller", "--noconfirm", "--log-level", "WARN",
                "--distpath", str(self.tmp / "dist"), "--workpath", str(self.tmp / "build"),
                str(src / "deploy" / "pyinstaller" / "npu-proxy.spec")])
            for scratch in ("src", "build"):
                shutil.rmtree(self.tmp / scratch, ignore_errors=True)
        finally:
            self.frozen.set()
        if frozen and self.want_deb:
            # NOTE: gzip -1 instead of xz: the same package, built in a fraction of the time
            # (630 MB: 44 s with gzip -1, 174 s with gzip -9 on 2 cores at load 5). Not
            # zstd: lintian 2.116 calls it malformed-deb-archive; nor none:
            # uses-no-compression-* errors.
            self._step("deb", [sys.executable, str(ROOT / "deploy" / "debian" / "build.py"),
                               "--folder", str(self.tmp / "dist" / "npu-proxy"),
                               "--out", str(self.tmp), "--compression", "gzip",
                               "--level", "1"])

    def _outcome(self, name: str) -> str:
        code, output = self.outcomes.get(name, (-1, "did not run (an earlier step failed)"))
        assert code == 0, f"{name} failed ({code}):\n{output}"
        return output

    def folder(self, timeout: float = 1800) -> Path:
        assert self.frozen.wait(timeout), "the PyInstaller build did not end"
        self._outcome("pyinstaller")
        folder = self.tmp / "dist" / "npu-proxy"
        assert (folder / "npu-proxy").is_file()
        return folder

    def deb(self, timeout: float = 2400) -> Path:
        """The .deb deploy/debian/build.py made (the last line it printed)."""
        assert self.want_deb, "the run did not ask for the .deb"
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the .deb build did not end"
        return Path(self._outcome("deb").strip().splitlines()[-1])

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
            if self._proc is not None and self._proc.poll() is None:
                stop_process(self._proc)
        self._thread.join(60)


def clean_env(**extra: str) -> dict[str, str]:
    """The environment of a user's shell: no test venv, no repository on the path, no
    npu-proxy settings of the test run."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")
           and not k.startswith("NPU_PROXY_")}
    env.update(extra)
    return env


def chat_and_embed(url: str) -> None:
    """What a user of the installed server sees: a chat answer, an embedding, a rerank."""
    chat = httpx.post(url + "/v1/chat/completions", timeout=300, json={
        "model": "smollm2:135m", "max_tokens": 16, "temperature": 0,
        "messages": [{"role": "user", "content": "What is the capital of France?"}]})
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["message"]["content"].strip()
    assert chat.headers["x-npu-proxy-worker"] == "llm"
    embed = httpx.post(url + "/api/embed", timeout=300,
                       json={"model": "all-minilm", "input": ["hello world"]})
    assert embed.status_code == 200, embed.text
    assert len(embed.json()["embeddings"][0]) == 384
    rerank = httpx.post(url + "/v1/rerank", timeout=300, json={
        "model": "all-minilm-rerank", "query": "capital of France",
        "documents": ["Bananas are yellow.", "Paris is the capital of France."]})
    assert rerank.status_code == 200, rerank.text
    assert rerank.json()["results"][0]["index"] == 1


def workers_ready(url: str) -> bool:
    """/health/ready answers 200 and every worker is ready (or busy)."""
    try:
        workers = httpx.get(url + "/health/devices", timeout=5).json()["workers"]
        ready = httpx.get(url + "/health/ready", timeout=5).status_code == 200
    except (httpx.HTTPError, ValueError, KeyError):
        return False
    # NOTE: a lazy worker (embed, rerank) is `idle` until the first request that needs it.
    return ready and all(w["state"] in ("ready", "busy", "idle") for w in workers)
