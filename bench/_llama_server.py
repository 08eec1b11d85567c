"""llama.cpp's own C++ `llama-server` as a peer of bench/peers.py: started on a free loopback
port with a GGUF, a number of slots and a context per slot, timed from exec to its /health
saying ok, and stopped (SIGTERM, then SIGKILL after a grace period).

How to build the binary (AMX off, only the server target): docs/performance.md,
"Compared with llama.cpp"."""

from __future__ import annotations

import shlex
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from serverctl import free_port, stop_process

# NOTE: prompt tokens a workload's request may take, template included, with room for a
# chat template that adds a default system prompt (Qwen2.5's adds ~30 tokens).
SHORT_PROMPT = 160
LONG_PROMPT = 1280
CTX_STEP = 256


def ctx_per_slot(long: bool, tokens: int) -> int:
    """The smallest multiple of CTX_STEP that holds one request of a workload: llama-server
    allocates (and clears) the KV cache of every slot at start, so a context larger than the
    workloads need would only add to its RSS."""
    need = (LONG_PROMPT if long else SHORT_PROMPT) + tokens
    return -(-need // CTX_STEP) * CTX_STEP


@dataclass
class LlamaServer:
    """One llama-server process: `slots` parallel slots (`-np`), continuous batching, the
    whole context `-c` = slots x ctx (each slot gets ctx: no unified KV cache)."""

    binary: Path
    gguf: Path
    slots: int
    ctx: int
    threads: int = 2
    extra: list[str] = field(default_factory=list)
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    ready_s: float = float("nan")
    log: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def argv(self) -> list[str]:
        return [str(self.binary), "-m", str(self.gguf), "--host", "127.0.0.1",
                "--port", str(self.port), "-t", str(self.threads), "-tb", str(self.threads),
                "-c", str(self.ctx * self.slots), "-np", str(self.slots), "--cont-batching",
                *self.extra]

    def command(self) -> str:
        return shlex.join(self.argv())

    def start(self, timeout: float = 300.0) -> LlamaServer:
        """Spawn it and wait for GET /health to answer 200 {"status": "ok"} (503 while the
        model loads); ready_s is exec to that answer."""
        self.port = free_port()
        fd, name = tempfile.mkstemp(prefix=f"llama-server-np{self.slots}-", suffix=".log")
        self.log = Path(name)
        with open(fd, "wb") as sink:
            started = time.perf_counter()
            self.proc = subprocess.Popen(self.argv(), stdout=sink, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL)
        deadline = started + timeout
        with httpx.Client(timeout=2.0) as client:
            while time.perf_counter() < deadline:
                if self.proc.poll() is not None:
                    raise SystemExit(f"llama-server exited ({self.proc.returncode}): "
                                     f"{self.command()}\n{self.tail()}\n(log: {self.log})")
                try:
                    r = client.get(self.url + "/health")
                    if r.status_code == 200 and r.json().get("status") == "ok":
                        self.ready_s = time.perf_counter() - started
                        return self
                except (httpx.HTTPError, ValueError):
                    pass
                # NOTE: polled, as a client would; 20 ms is below what a start takes.
                time.sleep(0.02)
        stop_process(self.proc, timeout=15.0)
        raise SystemExit(f"llama-server not ready after {timeout:.0f} s: {self.command()}\n"
                         f"{self.tail()}\n(log: {self.log})")

    def tail(self, chars: int = 3000) -> str:
        if self.log is None:
            return ""
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            stop_process(self.proc, timeout=15.0)
        if self.log is not None:
            self.log.unlink(missing_ok=True)
