"""Sustained load: N concurrent OpenAI streaming chat clients for a fixed time, every stream's
chunks checked, failures counted by reason, latency, throughput and memory of each process.

    python bench/load.py [--streams 512] [--seconds 60] [--max-tokens 16] [--quick]
                         [--deterministic off|on|both]
                         [--url URL [--config npu-proxy.toml]]

Without --url a private server is started (one `llm` worker on the CPU, its defaults, so
admission control answers 503 beyond the running requests and the worker's queue);
`--deterministic on` gives that worker `deterministic = true`, and `both` runs the load on one
server of each, one after the other, and ends with their texts differing from the idle
server's and their tokens/s side by side (the cost of deterministic mode, as a ratio of one
run). Each of
the N streams is a client loop: a streaming chat request (`stream_options.include_usage`,
`ignore_eos`, temperature 0, `max_tokens`), then the next, until the time is up; requests in
flight then finish (no new ones start). A 503/429 with Retry-After is waited out (with a
little jitter) before that stream's next request, as the official SDKs do; `--no-backoff`
sends the next one at once.

Printed: requests completed; failed by reason (HTTP status with the error's type/code, a
stream's error event, transport errors and client timeouts, each saying whether it came
before the response or mid-stream); streams with frames lost or duplicated; TTFT (request
sent to the first content delta) and inter-chunk latency (between a stream's consecutive
content deltas) of completed requests, p50 and p99; aggregate completion tokens/s (their
usage.completion_tokens over the whole run, drain included); the client's own CPU time;
RSS of the supervisor, gateway and each worker, each with its children (before, sampled
peak, after, VmHWM, CPU seconds), and what the server logged at WARNING or above meanwhile.

What "frames lost or duplicated" checks (any of them makes the exit code 1), per stream:
- nothing after `data: [DONE]`, and exactly one `[DONE]` on a stream that did not fail;
  a body that ends properly with neither `[DONE]` nor an error event lost its last frames;
- every chunk has the stream's one `id`, `created`, `model` and `object`;
- the first chunk is the role chunk (`delta.role == "assistant"`), and there is only one;
- then content deltas (non-empty `delta.content`, no finish_reason), then exactly one chunk
  with a finish_reason, then exactly one usage chunk (`choices == []`), then `[DONE]`;
- `usage.completion_tokens == max_tokens` (ignore_eos: the length is exactly that) and the
  number of content deltas is between 1 and that (the gateway may put several tokens in one
  delta, never less than one);
- the concatenated content equals the text the same prompt produced, alone, on the idle
  server before the load (greedy decoding). If it does not: "lost" when the reference is
  the stream's text with a piece missing at a boundary between two deltas, "duplicated"
  when leaving out a run of the stream's deltas gives the reference; any other difference
  is counted as "diverged" (batched floating point can pick another token at a near tie),
  which is printed but is not lost or duplicated: a diverged text is checked only by
  the rules above.
A stream that ends in an error event may have nothing after it and no repeated role, finish
or usage chunk before it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import random
import re
import resource
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from _proc import rss_kib
from serverctl import SUPERVISOR, Server, descendants

from npu_proxy.protocol.config import load_config

MODEL = "smollm2:135m"
TOPICS = ["a lighthouse keeper", "a lost robot", "the first snow of winter", "a river town",
          "an old clockmaker", "a dragon who cannot fly", "a night market", "a sailing ship"]
DECODER = msgspec.json.Decoder()
TICKS = os.sysconf("SC_CLK_TCK")


def prompt(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Write a short story about {TOPICS[i % len(TOPICS)]}."}]


# --- one request -------------------------------------------------------------------------


@dataclass
class Result:
    """One request: how it ended, what was wrong with its frames, its timings."""

    failure: str | None = None  # None: completed
    problems: list[str] = field(default_factory=list)
    diverged: bool = False
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    text: str = ""


def _error_reason(where: str, obj: Any) -> str:
    err = obj.get("error") if isinstance(obj, dict) else None
    if isinstance(err, dict):
        return f"{where} {err.get('type')}/{err.get('code')}"
    return f"{where} {str(obj)[:60]!r}"


def check(events: list[tuple[float, bytes]], started: float, max_tokens: int,
          reference: str | None, res: Result) -> None:
    """Walk one stream's SSE events (arrival time, data) and fill in res (see the docstring)."""
    ids: set[tuple[Any, ...]] = set()
    roles = finishes = usages = dones = 0
    deltas: list[str] = []
    stamps: list[float] = []
    usage: dict[str, Any] | None = None
    error: Any = None
    for at, data in events:
        if dones:
            res.problems.append("event after [DONE]")
            if data == b"[DONE]":
                continue
        if error is not None:
            res.problems.append("event after an error event")
        if data == b"[DONE]":
            dones += 1
            continue
        try:
            obj = DECODER.decode(data)
        except msgspec.DecodeError:
            res.problems.append("undecodable chunk")
            continue
        if "error" in obj:
            error = obj
            continue
        ids.add((obj.get("id"), obj.get("created"), obj.get("model"), obj.get("object")))
        choices = obj.get("choices")
        if choices == []:
            usages += 1
            usage = obj.get("usage")
            if not finishes:
                res.problems.append("usage chunk before the finish chunk")
            continue
        if not choices or len(choices) != 1:
            res.problems.append("chunk without exactly one choice")
            continue
        choice = choices[0]
        delta = choice.get("delta") or {}
        if usages:
            res.problems.append("choice chunk after the usage chunk")
        if delta.get("role") is not None:
            roles += 1
            if deltas or finishes or roles > 1:
                res.problems.append("role chunk not first or repeated")
        elif roles == 0:
            res.problems.append("chunk before the role chunk")
        if delta.get("content"):
            if finishes:
                res.problems.append("content after the finish chunk")
            if choice.get("finish_reason") is not None:
                res.problems.append("content in the finish chunk")
            deltas.append(delta["content"])
            stamps.append(at)
        if choice.get("finish_reason") is not None:
            finishes += 1
    if len(ids) > 1:
        res.problems.append("id/created/model/object changed within the stream")
    if dones > 1:
        res.problems.append("more than one [DONE]")
    res.text = "".join(deltas)
    if stamps:
        res.ttft = stamps[0] - started
        res.gaps = [b - a for a, b in itertools.pairwise(stamps)]
    if error is not None:
        res.failure = _error_reason("stream error", error)
        if finishes > 1 or usages > 1 or roles > 1:
            res.problems.append("repeated chunk before the error event")
        return
    if not dones:
        # NOTE: the HTTP body ended properly (a broken one is a transport error), so the
        # gateway ended the stream without its last frames: lost.
        res.failure = "stream ended without [DONE] or an error event"
        res.problems.append(res.failure)
        return
    if roles != 1:
        res.problems.append("role chunk missing")
    if finishes != 1:
        res.problems.append(f"{finishes} finish chunks")
    if usages != 1 or not isinstance(usage, dict):
        res.problems.append(f"{usages} usage chunks")
        return
    res.tokens = int(usage.get("completion_tokens") or 0)
    if res.tokens != max_tokens:
        res.problems.append("usage.completion_tokens != max_tokens")
    if not 1 <= len(deltas) <= res.tokens:
        res.problems.append("content deltas not within 1..completion_tokens")
    if reference is not None and res.text != reference:
        kind = compare(deltas, reference)
        if kind == "diverged":
            res.diverged = True
        else:
            res.problems.append(f"text: a delta {kind}")


def compare(deltas: list[str], reference: str) -> str:
    """Why the deltas' text is not the reference: "lost" if the reference is the deltas with
    a run of pieces missing between two of them, "duplicated" if leaving out one run of
    deltas gives the reference, else "diverged"."""
    text = "".join(deltas)
    cuts = [0]
    for d in deltas:
        cuts.append(cuts[-1] + len(d))
    if len(text) < len(reference):
        for c in cuts:
            if reference.startswith(text[:c]) and reference.endswith(text[c:]):
                return "lost"
    else:
        for i, a in enumerate(cuts):
            for b in cuts[i + 1:]:
                if text[:a] + text[b:] == reference:
                    return "duplicated"
    return "diverged"


class Load:
    def __init__(self, url: str, streams: int, max_tokens: int, read_timeout: float,
                 backoff: bool) -> None:
        self.url = url + "/v1/chat/completions"
        self.streams = streams
        self.max_tokens = max_tokens
        self.backoff = backoff
        # NOTE: asyncio (uvloop when installed), one event loop parsing every stream in one
        # thread, and one httpx.AsyncClient (one keep-alive connection) per stream. 512 OS
        # threads would each hold a stack and take the GIL for every chunk. One client with
        # a 512-connection pool does not scale either: httpcore's pool scans all its
        # connections on every request start and end (measured here: 30 s of client CPU in
        # 20 s of load, most of it in AsyncConnectionPool._assign_requests_to_connections),
        # so it would take a core from the server it measures. Its CPU time is printed.
        ssl_context = ssl.create_default_context()
        self.clients = [httpx.AsyncClient(
            verify=ssl_context, limits=httpx.Limits(max_connections=1),
            timeout=httpx.Timeout(connect=30.0, read=read_timeout, write=30.0, pool=30.0))
            for _ in range(streams)]
        self.references: dict[int, str] = {}
        self.results: list[Result] = []

    def body(self, i: int) -> bytes:
        return msgspec.json.encode({
            "model": MODEL, "messages": prompt(i), "max_tokens": self.max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}})

    async def one(self, client: httpx.AsyncClient, i: int,
                  fresh: bool = False) -> tuple[Result, float | None]:
        """One request (fresh: on a connection not used before); returns its result and
        the Retry-After of a refusal (else None)."""
        res = Result()
        started = time.perf_counter()
        events: list[tuple[float, bytes]] = []
        status = 0
        try:
            async with client.stream("POST", self.url, content=self.body(i),
                                     headers={"content-type": "application/json"}) as r:
                status = r.status_code
                if status != 200:
                    raw = await r.aread()
                    try:
                        obj = json.loads(raw)
                    except ValueError:
                        obj = raw.decode(errors="replace")
                    res.failure = _error_reason(f"HTTP {status}", obj)
                    retry = r.headers.get("retry-after")
                    return res, float(retry) if retry and retry.isdigit() else None
                buf = b""
                async for piece in r.aiter_bytes():
                    now = time.perf_counter()
                    buf += piece
                    *whole, buf = buf.split(b"\n\n")
                    for event in whole:
                        for line in event.split(b"\n"):
                            if line.startswith(b"data: "):
                                events.append((now, line[6:]))
                if buf.strip():
                    res.problems.append("trailing bytes without an event end")
        except httpx.HTTPError as exc:
            kind = "client timeout" if isinstance(exc, httpx.TimeoutException) else "transport"
            where = "mid-stream" if status == 200 else "before the response"
            if fresh:
                where += " on a new connection"
            res.failure = f"{kind} {type(exc).__name__} {where}"
            return res, None
        check(events, started, self.max_tokens, self.references.get(i % len(TOPICS)), res)
        return res, None

    async def warm(self) -> None:
        """The reference text of every prompt, each alone on the idle server."""
        async with httpx.AsyncClient(timeout=120.0) as client:
            for i in range(len(TOPICS)):
                res, _ = await self.one(client, i)
                if res.failure or res.problems:
                    raise SystemExit(f"reference request {i} failed: {res.failure} "
                                     f"{res.problems}")
                self.references[i] = res.text

    async def stream(self, n: int, stop_at: float) -> None:
        i = n
        fresh = True
        while time.monotonic() < stop_at:
            res, retry = await self.one(self.clients[n], i, fresh)
            self.results.append(res)
            # NOTE: httpx drops a connection that failed; the next request opens another.
            fresh = (res.failure or "").startswith(("transport", "client timeout"))
            i += 1
            if retry is not None and self.backoff:
                wait = min(retry * random.uniform(1.0, 1.25), stop_at - time.monotonic())
                if wait > 0:
                    await asyncio.sleep(wait)

    async def close(self) -> None:
        for client in self.clients:
            await client.aclose()

    async def run(self, seconds: float) -> float:
        stop_at = time.monotonic() + seconds
        started = time.perf_counter()
        await asyncio.gather(*(self.stream(n, stop_at) for n in range(self.streams)))
        return time.perf_counter() - started


# --- processes ---------------------------------------------------------------------------


def _status_kib(pid: int, key: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def _cpu_ticks(pid: int) -> int:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])
    except OSError:
        return 0


@dataclass
class Proc:
    name: str
    pid: int
    pids: set[int] = field(default_factory=set)
    before: int = 0
    peak: int = 0
    last: int = 0
    cpu: dict[int, int] = field(default_factory=dict)
    pid_changes: int = 0


class Sampler:
    """Polls the RSS of the gateway, every worker and the supervisor, each with all its
    descendants, in a thread; the pids come from the supervisor's status (as
    `npx-supervisor status --json` shows them) and are refreshed so a restart is seen."""

    def __init__(self, status: Any, interval: float = 0.25) -> None:
        self.status = status
        self.interval = interval
        self.procs: dict[str, Proc] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.refresh()
        for p in self.procs.values():
            p.before = p.peak = p.last = sum(rss_kib(q) for q in p.pids)
            p.cpu = {q: _cpu_ticks(q) for q in p.pids}

    def refresh(self) -> None:
        try:
            reply = self.status()
        except Exception:  # NOTE: the supervisor busy or gone: keep the last pids
            return
        rows = [("supervisor", reply["pid"])] + [
            (c["name"], c["pid"]) for c in reply["children"]]
        for name, pid in rows:
            if pid is None:
                continue
            p = self.procs.get(name)
            if p is None:
                p = self.procs[name] = Proc(name, pid)
            elif p.pid != pid:
                p.pid_changes += 1
                p.pid = pid
            # NOTE: the supervisor's descendants are the others; it is counted alone.
            own = {pid} if name == "supervisor" else {pid} | descendants(pid)
            p.pids = own
            for q in own:
                p.cpu.setdefault(q, _cpu_ticks(q))

    def _loop(self) -> None:
        last_refresh = time.monotonic()
        while not self.stop.wait(self.interval):
            if time.monotonic() - last_refresh > 1.0:
                self.refresh()
                last_refresh = time.monotonic()
            for p in self.procs.values():
                p.last = sum(rss_kib(q) for q in p.pids)
                p.peak = max(p.peak, p.last)

    def start(self) -> None:
        self.thread.start()

    def finish(self) -> None:
        self.stop.set()
        self.thread.join()
        self.refresh()
        for p in self.procs.values():
            p.last = sum(rss_kib(q) for q in p.pids)
            p.peak = max(p.peak, p.last)

    def cpu_seconds(self, p: Proc) -> float:
        return sum(max(0, _cpu_ticks(q) - t0) for q, t0 in p.cpu.items()) / TICKS


class Logs:
    """What the server's processes logged at WARNING or above while the load ran (text or
    JSON lines; the lines of a log that rotated meanwhile are not all seen)."""

    LEVELS = ("WARNING", "ERROR", "CRITICAL")

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.start = {f: f.stat().st_size for f in folder.glob("*.log")}

    def problems(self) -> dict[str, Counter[str]]:
        found: dict[str, Counter[str]] = {}
        for f in sorted(self.folder.glob("*.log")):
            with f.open("rb") as fh:
                fh.seek(self.start.get(f, 0))
                lines = fh.read().decode(errors="replace").splitlines()
            seen: Counter[str] = Counter()
            for line in lines:
                if line.startswith("{"):
                    try:
                        rec = json.loads(line)
                    except ValueError:
                        continue
                    level = str(rec.get("level", "")).upper()
                    message = f"{rec.get('logger')}: {rec.get('msg')}"
                else:
                    parts = line.split(None, 3)
                    if len(parts) < 4:
                        continue
                    level, message = parts[1], parts[3].strip()
                if level in self.LEVELS:
                    # NOTE: one row per message, whatever request it was about.
                    seen[f"{level} " + re.sub(r"req-[0-9a-f]+", "req-…", message)[:150]] += 1
            found[f.stem] = seen
        return found


# --- report ------------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def report(load: Load, args: argparse.Namespace, wall: float, cpu: float,
           sampler: Sampler | None, logs: Logs | None) -> int:
    results = load.results
    ok = [r for r in results if r.failure is None]
    failed = Counter(r.failure for r in results if r.failure is not None)
    problems = Counter(p for r in results for p in r.problems)
    bad = sum(1 for r in results if r.problems)
    ttft = [r.ttft for r in ok if r.ttft is not None]
    gaps = [g for r in ok for g in r.gaps]
    tokens = sum(r.tokens for r in ok)
    mib = 1024.0
    print(f"{args.streams} streams for {args.seconds:g} s, then in-flight requests finished "
          f"({wall:.1f} s in all); OpenAI streaming chat, max_tokens {args.max_tokens}, "
          f"ignore_eos, temperature 0, {len(TOPICS)} prompts; Retry-After "
          f"{'honoured' if args.backoff else 'ignored'}")
    print(f"requests sent:      {len(results)}")
    print(f"requests completed: {len(ok)}  ({len(ok) / wall:.1f}/s)")
    print(f"requests failed:    {sum(failed.values())}")
    for reason, n in failed.most_common():
        print(f"  {n:8d}  {reason}")
    print(f"frames lost or duplicated: {bad} streams"
          + ("" if bad else "  (every completed or failed stream well-formed)"))
    for what, n in problems.most_common():
        print(f"  {n:8d}  {what}")
    diverged = sum(1 for r in results if r.diverged)
    print(f"text differs from the idle-server reference (not lost/duplicated): {diverged} "
          f"of {len(ok)} completed")
    print(f"TTFT (to first content):  p50 {pct(ttft, 0.5) * 1000:8.1f} ms   "
          f"p99 {pct(ttft, 0.99) * 1000:8.1f} ms   (n={len(ttft)})")
    print(f"inter-chunk latency:      p50 {pct(gaps, 0.5) * 1000:8.1f} ms   "
          f"p99 {pct(gaps, 0.99) * 1000:8.1f} ms   (n={len(gaps)})")
    mean_chunks = statistics.mean(len(r.gaps) + 1 for r in ok) if ok else 0.0
    print(f"aggregate: {tokens / wall:.1f} completion tokens/s ({tokens} tokens in "
          f"{wall:.1f} s; {mean_chunks:.1f} content deltas per {args.max_tokens}-token "
          "completion)")
    print(f"client CPU: {cpu:.1f} s = {cpu / wall * 100:.0f}% of one core "
          f"({os.cpu_count()} cores)")
    if sampler is not None:
        print("memory, RSS in MiB (each process with its children):")
        print(f"  {'process':<12} {'pid':>8} {'before':>8} {'peak':>8} {'after':>8} "
              f"{'VmHWM':>8} {'CPU s':>7}")
        for p in sampler.procs.values():
            hwm = sum(_status_kib(q, "VmHWM") for q in p.pids)
            note = f"  ({p.pid_changes} restarts during the run)" if p.pid_changes else ""
            print(f"  {p.name:<12} {p.pid:>8} {p.before / mib:8.1f} {p.peak / mib:8.1f} "
                  f"{p.last / mib:8.1f} {hwm / mib:8.1f} {sampler.cpu_seconds(p):7.1f}{note}")
        print("  (peak: sampled every 0.25 s during the load; VmHWM: each process's own "
              "peak since it started, summed)")
    if logs is not None:
        found = logs.problems()
        print("server log lines at WARNING or above during the load: "
              + (", ".join(f"{name} {sum(c.values())}" for name, c in found.items())
                 or "no logs found"))
        for name, c in found.items():
            for message, n in c.most_common(8):
                print(f"  {name}: {n:6d}  {message}")
    return 1 if bad else 0


# --- main --------------------------------------------------------------------------------


def _cli_status(config: str | None) -> Any:
    cmd = [SUPERVISOR, "status", "--json"] + (["--config", config] if config else [])
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=10)
    return json.loads(out.stdout)


@dataclass
class Summary:
    code: int
    completed: int
    diverged: int
    tokens_per_s: float


async def bench(url: str, args: argparse.Namespace, sampler: Sampler | None,
                logs_folder: Path | None) -> Summary:
    load = Load(url, args.streams, args.max_tokens, args.timeout, args.backoff)
    try:
        await load.warm()
        logs = Logs(logs_folder) if logs_folder is not None and logs_folder.is_dir() else None
        if sampler is not None:
            sampler.start()
        cpu0 = resource.getrusage(resource.RUSAGE_SELF)
        wall = await load.run(args.seconds)
        cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    finally:
        if sampler is not None and sampler.thread.is_alive():
            sampler.finish()
        await load.close()
    cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    code = report(load, args, wall, cpu, sampler, logs)
    ok = [r for r in load.results if r.failure is None]
    return Summary(code, len(ok), sum(1 for r in load.results if r.diverged),
                   sum(r.tokens for r in ok) / wall)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=512)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="32 streams for 10 s")
    parser.add_argument("--timeout", type=float, default=120.0,
                        help="client read timeout (s): the longest wait for the next bytes")
    parser.add_argument("--no-backoff", dest="backoff", action="store_false",
                        help="do not wait out Retry-After before a stream's next request")
    parser.add_argument("--deterministic", choices=("off", "on", "both"), default="off",
                        help="the private server's llm worker in deterministic mode; both: "
                             "one run each, compared")
    parser.add_argument("--url", help="a running server instead of a private one")
    parser.add_argument("--config", help="with --url: its npu-proxy.toml, to find the pids "
                                         "(default: npx-supervisor's own default)")
    args = parser.parse_args()
    if args.quick:
        args.streams, args.seconds = 32, 10.0
    # NOTE: 512 sockets plus the server's; the soft limit is often 1024.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = min(hard, max(soft, 4 * args.streams + 256))
    resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    with contextlib.suppress(ImportError):
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    if args.url:
        sampler = None
        with contextlib.suppress(Exception):
            sampler = Sampler(lambda: _cli_status(args.config))
        if sampler is None:
            print("(no supervisor answered `npx-supervisor status`: memory not sampled)")
        folder = None
        with contextlib.suppress(Exception):
            config = load_config(Path(args.config) if args.config else None)
            folder = config.runtime_path() / "logs"
        return asyncio.run(bench(args.url.rstrip("/"), args, sampler, folder)).code
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.deterministic]
    summaries = [private(args, mode) for mode in modes]
    if len(summaries) == 2:
        off, on = summaries
        print(f"\ndeterministic off: {off.diverged} of {off.completed} texts differ from the "
              f"idle server's, {off.tokens_per_s:.1f} tokens/s")
        ratio = on.tokens_per_s / max(off.tokens_per_s, 1e-9)
        print(f"deterministic on:  {on.diverged} of {on.completed} texts differ, "
              f"{on.tokens_per_s:.1f} tokens/s = x{ratio:.2f}")
    # NOTE: a deterministic worker whose text changed under load fails the run.
    broken = any(s.diverged for s, on in zip(summaries, modes, strict=True) if on)
    return max(s.code for s in summaries) or int(broken)


def private(args: argparse.Namespace, deterministic: bool) -> Summary:
    """The load on a private server of one llm worker (deterministic or not)."""
    with tempfile.TemporaryDirectory(prefix="npx-bench-load-") as tmp:
        server = Server(Path(tmp), workers=[
            {"name": "llm", "role": "llm", "deterministic": deterministic}]).start()
        try:
            def rows() -> dict[str, Any]:
                reply = server.status()
                return {"pid": reply.pid, "children": [c.as_json() for c in reply.children]}

            sampler = Sampler(rows)
            spec = server.config.worker("llm")
            print(f"\nprivate server {server.url}: one llm worker on CPU, deterministic "
                  f"{'on' if deterministic else 'off'} (max_running {spec.max_running}, "
                  f"max_queue {spec.max_queue})", flush=True)
            return asyncio.run(bench(server.url, args, sampler,
                                     server.config.runtime_path() / "logs"))
        finally:
            server.stop()


if __name__ == "__main__":
    sys.exit(main())
