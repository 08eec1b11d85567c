"""Helpers of the tests of npu-proxy as a user installs it (tests/test_packaging.py: the
wheel with pipx, the PyInstaller folder; tests/test_deb.py: the Debian package): a copy of
the tree to build from, the frozen folder, a user's environment, and what a user of the
installed server sees."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
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


class Freeze:
    """The PyInstaller one-folder build of a copy of the tree, running in the background at
    the lowest CPU priority (it takes the cycles the tests leave idle, ~2 CPU-minutes,
    mostly one core), ended with the test process; `folder()` waits for it. The copy of the
    tree is gone afterwards, so the folder can only use what it carries."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.log = tmp / "pyinstaller.log"
        src = source_copy(tmp / "src")
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                with_parent([sys.executable, "-m", "PyInstaller", "--noconfirm", "--log-level",
                             "WARN", "--distpath", str(tmp / "dist"), "--workpath",
                             str(tmp / "build"),
                             str(src / "deploy" / "pyinstaller" / "npu-proxy.spec")]),
                cwd=tmp, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                preexec_fn=lambda: os.nice(19))

    def folder(self, timeout: float = 1500) -> Path:
        code = self.proc.wait(timeout)
        assert code == 0, self.log.read_text(errors="replace")[-9000:]
        for scratch in ("src", "build"):
            shutil.rmtree(self.tmp / scratch, ignore_errors=True)
        folder = self.tmp / "dist" / "npu-proxy"
        assert (folder / "npu-proxy").is_file()
        return folder

    def stop(self) -> None:
        if self.proc.poll() is None:
            stop_process(self.proc)


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
