"""Start to ready with a cached model: `npx-supervisor start` with the default workers (the
embedded SmolLM2 on the CPU resident, embed and rerank lazy), timed from exec to
/health/ready answering 200 and to the first streamed chat token, with where the time goes.

    python bench/start.py [--starts 4] [--against main] [--no-against]
                          [--model-gguf PATH [--model NAME]]

Each variant is started once first (a warm-up start: the GGUF converted to IR, OpenVINO's
compile cache filled), then the starts alternate between this working tree and the git
revision `--against` (its files, run with this environment through PYTHONPATH), so both see
the same load on a shared machine; printed: the median of each and their ratio. Each variant
keeps one runtime folder from start to start, as a user's instance does, and its modules are
compiled to bytecode first, as an installed wheel's are (`--no-bytecode`: not, though what an
earlier run wrote stays; with PYTHONDONTWRITEBYTECODE set, as in the shared dev environment,
every start then compiles every module of the tree from source: 0.24 s of the gateway's
0.57 s of import CPU).

The breakdown comes from the processes' own JSON log lines (time.time() stamps, the same
clock as the exec time): the supervisor's device discovery (a child process that imports
OpenVINO), the spawns, the gateway's imports and bind, the worker's imports, OpenVINO
import, pipeline construction, warm-up, and how long the gateway takes to see the worker
ready. A phase a revision does not log is shown as "-". With --model-gguf the llm worker
serves that GGUF through a `[models."--model"]` path entry, as bench/peers.py does (its first
start converts it to IR in the shared model cache: minutes). The CPU seconds each process
had used when the first token came (/proc/PID/stat) are printed as well. Then the import
time of each process's entry module and the device discovery, measured alone in fresh
interpreters.
"""

from __future__ import annotations

import argparse
import compileall
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "deploy"))

import ns_tree
from serverctl import Server

from npu_proxy.protocol.config import default_workers

ROOT = Path(__file__).resolve().parents[1]

# (label, process, a piece of the message): the first matching line gives the phase's end.
MARKS: list[tuple[str, str, str]] = [
    ("devices found (supervisor imports + discovery)", "supervisor", "devices:"),
    ("llm worker spawned", "supervisor", "started llm pid"),
    ("gateway spawned", "supervisor", "started gateway pid"),
    ("gateway imported, config read", "gateway", "gateway accepting HTTP"),
    ("gateway bound", "gateway", "Running on http"),
    ("worker imported, model located", "worker:llm", "loading {model}"),
    ("worker: OpenVINO imported", "worker:llm", "OpenVINO properties in effect"),
    ("worker: pipeline built", "worker:llm", "pipeline built"),
    ("worker: warmed up, ready", "worker:llm", "ready in"),
    ("gateway sees the worker ready", "gateway", "is ready"),
]


def checkout(rev: str, into: Path) -> Path:
    """The files of `rev`, importable as npu_proxy through PYTHONPATH (the ns tree)."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return ns_tree.make(into)


def compile_tree(root: Path) -> None:
    """Bytecode for the packages under `root`, as pip writes it when it installs the wheel
    (Python reads it even when PYTHONDONTWRITEBYTECODE keeps it from writing any)."""
    for name in ns_tree.PACKAGES:
        compileall.compile_dir(str(root / name), quiet=1)


MODEL = "smollm2:135m"
GGUF_MODEL = "start-gguf:latest"


def cpu_s(pid: int) -> float:
    """User + system CPU seconds process `pid` has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def first_token_s(url: str, t0: float, model: str) -> float:
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=600, json={
            "model": model, "stream": True, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": "Hello"}]}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["delta"].get(
                    "content"):
                return time.time() - t0
    raise RuntimeError("no token")


def one_start(tmp: Path, pythonpath: str | None, runtime: Path,
              gguf: Path | None, model: str) -> dict[str, float]:
    extra: dict[str, Any] = {}
    if gguf is not None:
        workers: list[dict[str, Any]] = [{"name": w.name, "role": w.role, "device": "CPU"}
                                         for w in default_workers(["CPU"])]
        llm = next(w for w in workers if w["role"] == "llm")
        # NOTE: a first start converts the GGUF (minutes on two cores).
        llm.update(model=model, load_timeout=3600)
        extra = {"workers": workers, "models": {model: {"path": str(gguf)}}}
    server = Server(tmp, log_format="json", log_level="info", runtime_dir=str(runtime),
                    **extra)
    env_before = os.environ.get("PYTHONPATH")
    if pythonpath:
        os.environ["PYTHONPATH"] = pythonpath
    try:
        t0 = time.time()
        server.start(wait=False)
    finally:
        if env_before is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = env_before
    try:
        with httpx.Client(timeout=2) as client:
            while True:
                server._check_alive()
                try:
                    if client.get(server.url + "/health/ready").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                time.sleep(0.02)
        ready = time.time() - t0
        token = first_token_s(server.url, t0, model)
        assert server.proc is not None
        cpu = {"cpu: supervisor": cpu_s(server.proc.pid)}
        cpu.update({f"cpu: {c.name}": cpu_s(c.pid) for c in server.status().children
                    if c.pid})
    finally:
        server.stop()
    row = {"ready": ready, "token": token, **cpu}
    lines = [json.loads(x) for x in server.log_path.read_text().splitlines()
             if x.startswith("{")]
    for label, process, piece in MARKS:
        piece = piece.format(model=model.split(":")[0])
        hit = next((x["ts"] for x in lines if x.get("process") == process
                    and piece in x.get("msg", "")), None)
        if hit is not None:
            row[label] = hit - t0
    return row


def import_s(module: str, pythonpath: str | None, code: str = "") -> float:
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    body = code or f"import {module}"
    probe = ("import time, os; t = time.perf_counter(); c = os.times()\n"
             f"{body}\n"
             "c2 = os.times(); print(sum(c2[:4]) - sum(c[:4]))")
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                         text=True, check=True, cwd=ROOT)
    return float(out.stdout.strip().splitlines()[-1])


def median(rows: list[dict[str, float]], key: str) -> float | None:
    values = [r[key] for r in rows if key in r]
    return statistics.median(values) if values else None


def fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:6.2f}"


def ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None or a == 0 else f"x{b / a:.2f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--starts", type=int, default=4, help="starts of each variant")
    parser.add_argument("--against", default="main", help="git revision to compare with")
    parser.add_argument("--no-against", action="store_true", help="this tree only")
    parser.add_argument("--no-bytecode", action="store_true",
                        help="do not compile the variants' modules first")
    parser.add_argument("--model-gguf", metavar="PATH", type=Path,
                        help="the GGUF the llm worker serves (default: the embedded SmolLM2)")
    parser.add_argument("--model", default=None,
                        help=f"its name in the configuration (default {GGUF_MODEL})")
    args = parser.parse_args()
    model = args.model or (GGUF_MODEL if args.model_gguf else MODEL)
    with tempfile.TemporaryDirectory(prefix="bench-start-") as tmp_name:
        tmp = Path(tmp_name)
        variants: dict[str, str | None] = {"this tree": None}
        if not args.no_against:
            (tmp / "against").mkdir()
            variants[args.against] = str(checkout(args.against, tmp / "against"))
        if not args.no_bytecode:
            compile_tree(ROOT)
            if not args.no_against:
                compile_tree(tmp / "against")
        rows: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
        runs = 0

        def start(name: str) -> dict[str, float]:
            nonlocal runs
            runs += 1
            # NOTE: one runtime folder per variant, kept from start to start as a user's is
            # (what a start may keep there, such as the devices found, is then found).
            runtime = tmp / f"rt{list(variants).index(name)}"
            return one_start(tmp / f"run{runs}", variants[name], runtime, args.model_gguf,
                             model)

        for name in variants:
            warm = start(name)
            print(f"warm-up start, {name}: ready {warm['ready']:.2f} s", flush=True)
        for i in range(args.starts):
            for name in (list(variants) if i % 2 == 0 else list(variants)[::-1]):
                row = start(name)
                rows[name].append(row)
                print(f"  {name}: ready {row['ready']:.2f} s, first token "
                      f"{row['token']:.2f} s", flush=True)
        names = list(variants)
        print(f"\nstart (exec of npx-supervisor start) to ..., median of {args.starts} "
              "starts, seconds")
        print(f"{'':52s}" + "".join(f"{n[:10]:>11s}" for n in names)
              + ("      ratio" if len(names) == 2 else ""))
        keys = [label for label, _, _ in MARKS] + ["ready", "token"]
        keys += sorted({k for n in names for r in rows[n] for k in r if k.startswith("cpu:")})
        labels = {"ready": "/health/ready 200 (client)", "token": "first chat token (client)"}
        for key in keys:
            values = [median(rows[n], key) for n in names]
            line = f"{labels.get(key, key):52s}" + "".join(f"{fmt(v):>11s}" for v in values)
            if len(names) == 2:
                line += f"{ratio(values[1], values[0]):>11s}"
            print(line)

        print("\nCPU seconds (its children's included) to import, alone in a fresh interpreter, "
              "median of 3")
        probes: list[tuple[str, str, str]] = [
            ("supervisor CLI", "npu_proxy.supervisor.cli", ""),
            ("gateway (app + hypercorn)", "npu_proxy.gateway.__main__", ""),
            ("worker entry", "npu_proxy.workers.__main__", ""),
            ("worker engine (OpenVINO GenAI)", "npu_proxy.workers.batch_engine", ""),
            ("device discovery", "", "from npu_proxy.supervisor.devices import discover\n"
                                     "discover()"),
        ]
        def take(module: str, code: str, pythonpath: str | None) -> float:
            return statistics.median(import_s(module, pythonpath, code) for _ in range(3))

        for label, module, code in probes:
            values = [take(module, code, variants[n]) for n in names]
            line = f"{label:52s}" + "".join(f"{v:11.2f}" for v in values)
            if len(names) == 2:
                line += f"{ratio(values[1], values[0]):>11s}"
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
