"""What a lazy worker costs its first request, and what it saves while idle.

    python bench/lazy.py [--rounds 5] [--keep-alive 2]

Starts a private server with the default workers (llm resident; embed and rerank lazy, the
embed worker with a short keep_alive so it unloads between rounds). Each round waits until
/health/devices says the embed worker is idle (not loaded), times one embedding request
against it (the worker's start, load and warm-up, then the request: the lazy first request)
and then one against the now warm worker, each with a text never sent before (the worker's
vector cache never answers). Prints the medians, the ratio lazy / warm and the added
milliseconds.

Then the resident memory of the whole process tree (RSS summed over the supervisor and its
children) with embed and rerank idle, and with both loaded (one request each), per process.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from _proc import rss_kib
from serverctl import Server, descendants, wait_for


def tree(server: Server) -> dict[str, int]:
    """RSS (KiB) of the supervisor and of each child, named by worker (or its pid)."""
    assert server.proc is not None
    names = {str(c["pid"]): name for name, c in server.children().items() if c["pid"]}
    rows = {"supervisor": rss_kib(server.proc.pid)}
    for pid in sorted(descendants(server.proc.pid)):
        rows[names.get(str(pid), f"pid {pid}")] = rss_kib(pid)
    return {name: kib for name, kib in rows.items() if kib}


def state(server: Server, worker: str) -> str:
    rows = httpx.get(server.url + "/health/devices", timeout=10).json()["workers"]
    return str(next(w for w in rows if w["name"] == worker)["state"])


def embed_ms(client: httpx.Client) -> float:
    start = time.perf_counter()
    r = client.post("/v1/embeddings", json={"model": "all-minilm",
                                            "input": f"a text never sent {uuid.uuid4()}"})
    elapsed = (time.perf_counter() - start) * 1000
    r.raise_for_status()
    return elapsed


def show(label: str, rows: dict[str, int]) -> None:
    parts = ", ".join(f"{name} {kib / 1024:.0f}" for name, kib in rows.items())
    print(f"{label}: {sum(rows.values()) / 1024:,.0f} MiB ({parts})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--keep-alive", type=float, default=2.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-lazy-") as tmp:
        server = Server(Path(tmp), workers=[
            {"name": "llm", "role": "llm"},
            {"name": "embed", "role": "embed", "keep_alive": args.keep_alive},
            {"name": "rerank", "role": "rerank"},
        ]).start()
        try:
            idle_tree = tree(server)
            lazy: list[float] = []
            warm: list[float] = []
            with httpx.Client(base_url=server.url, timeout=600) as client:
                for _ in range(args.rounds):
                    wait_for(lambda: state(server, "embed") == "idle", timeout=120,
                             every=0.05, what="the embed worker did not unload")
                    lazy.append(embed_ms(client))
                    warm.append(embed_ms(client))
                client.post("/v1/rerank", json={"model": "all-minilm-rerank", "query": "q",
                                                "documents": ["d"]}).raise_for_status()
                embed_ms(client)
                loaded_tree = tree(server)
        finally:
            server.stop()
    first, hot = statistics.median(lazy), statistics.median(warm)
    print(f"embedding request, median of {args.rounds}: lazily started worker {first:,.0f} ms, "
          f"warm worker {hot:.1f} ms: x{first / hot:,.0f}, +{first - hot:,.0f} ms")
    print(f"  lazy: {', '.join(f'{v:,.0f}' for v in lazy)} ms; "
          f"warm: {', '.join(f'{v:.1f}' for v in warm)} ms")
    show("RSS, embed and rerank idle  ", idle_tree)
    show("RSS, embed and rerank loaded", loaded_tree)
    saved = sum(loaded_tree.values()) - sum(idle_tree.values())
    print(f"not resident while idle: {saved / 1024:,.0f} MiB "
          f"({saved / sum(loaded_tree.values()):.0%} of the loaded tree)")


if __name__ == "__main__":
    main()
