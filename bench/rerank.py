"""Rerank throughput (pairs/s) through the server versus the in-process TextRerankPipeline.

    python bench/rerank.py [--url URL] [--rounds 4] [--seconds 3] [--concurrency 4]

Without --url a private server is started with only the rerank worker (the embedded
reranker). Both sides score the same query against the same documents with the same IR folder
and pipeline settings, taking turns in short blocks so load from other processes on the
machine falls on both alike; the in-process side makes one pipeline call per request (all its
documents), the server cuts a request into calls of at most 32 pairs, shortest first. Ratios
are HTTP / in-process (medians over the rounds). The last lines put `--concurrency` clients
with their own queries on the server at once against the same requests sent one by one.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import openvino_genai as ov_genai
from serverctl import MODEL_CACHE, Server

from npu_proxy.models.locate import MINILM_RERANK_FOLDER
from npu_proxy.workers.rerank_model import MAX_PAIR_LENGTH, rerank_config

MODEL = "all-minilm-rerank:l6-v2"
DOCUMENT_COUNTS = (8, 32, 128)
# Seconds each side runs before the other takes its turn.
BLOCK_S = 0.5
WORDS = [
    "the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "river",
    "stones", "glitter", "under", "pale", "morning", "light", "and", "distant", "bells", "ring",
    "across", "quiet", "valleys", "where", "farmers", "gather", "grain", "markets", "open",
    "traders", "argue", "prices", "rise", "engineers", "measure", "voltage", "silicon",
    "wafers", "students", "read", "history", "poems", "recall", "ancient", "harbours", "ships",
]


def make_documents(n: int, seed: int) -> list[str]:
    """Passages of 20 to 80 words, as a retriever's chunks."""
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(20, 80))) + "." for _ in range(n)]


def make_query(seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choices(WORDS, k=8)) + "?"


def rate(work: Callable[[], int], seconds: float) -> float:
    """Pairs per second of `work` (which returns the pairs it scored), run for `seconds`."""
    pairs = 0
    started = time.perf_counter()
    while True:
        pairs += work()
        elapsed = time.perf_counter() - started
        if elapsed >= seconds:
            return pairs / elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running server with a rerank worker")
    parser.add_argument("--model-dir", help="the IR folder that server loads (with --url)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=3.0, help="per side per round")
    parser.add_argument("--concurrency", type=int, default=4)
    args = parser.parse_args()

    server: Server | None = None
    if args.url:
        url = args.url.rstrip("/")
        folder = Path(args.model_dir) if args.model_dir else MODEL_CACHE / MINILM_RERANK_FOLDER
    else:
        tmp = Path(tempfile.mkdtemp(prefix="npx-bench-rerank-"))
        print(f"starting a private server in {tmp} (rerank worker only)")
        server = Server(tmp, workers=[{"name": "rerank", "role": "rerank"}]).start()
        url = server.url
        folder = server.config.model_cache_path() / MINILM_RERANK_FOLDER
    client = httpx.Client(base_url=url, timeout=600)
    try:
        pipe = ov_genai.TextRerankPipeline(str(folder), "CPU", rerank_config(MAX_PAIR_LENGTH))
        query = make_query(1)

        def local(documents: list[str]) -> int:
            pipe.rerank(query, documents)
            return len(documents)

        def remote(documents: list[str]) -> int:
            r = client.post("/v1/rerank", json={"model": MODEL, "query": query,
                                                "documents": documents,
                                                "return_documents": False})
            r.raise_for_status()
            return len(r.json()["results"])

        print(f"model {MODEL} ({folder}); {args.rounds} alternating rounds of "
              f"~{args.seconds:.1f} s per side; documents of 20-80 words")
        print(f"{'docs':>5} {'in-process pairs/s':>19} {'HTTP pairs/s':>13} {'ratio':>6}  "
              "ratio per round")
        for count in DOCUMENT_COUNTS:
            documents = make_documents(count, seed=count)
            local(documents)
            remote(documents)  # NOTE: untimed first calls: compile caches, connections
            locals_: list[float] = []
            remotes: list[float] = []
            for _ in range(args.rounds):
                local_rate = remote_rate = 0.0
                blocks = max(1, round(args.seconds / BLOCK_S))
                for _ in range(blocks):
                    local_rate += rate(lambda d=documents: local(d), BLOCK_S) / blocks
                    remote_rate += rate(lambda d=documents: remote(d), BLOCK_S) / blocks
                locals_.append(local_rate)
                remotes.append(remote_rate)
            ratios = [r / loc for r, loc in zip(remotes, locals_, strict=True)]
            per_round = " ".join(f"{r:.2f}" for r in ratios)
            print(f"{count:>5} {statistics.median(locals_):>19.1f} "
                  f"{statistics.median(remotes):>13.1f} {statistics.median(ratios):>6.3f}  "
                  f"{per_round}")
        concurrent_gain(url, args.concurrency, args.rounds)
    finally:
        client.close()
        if server is not None:
            server.stop()
    return 0


def concurrent_gain(url: str, clients: int, rounds: int) -> None:
    """`clients` requests of 32 documents (each its own query) at once vs one by one."""
    bodies = [{"model": MODEL, "query": make_query(100 + i),
               "documents": make_documents(32, seed=100 + i), "return_documents": False}
              for i in range(clients)]

    async def run(together: bool) -> float:
        async with httpx.AsyncClient(base_url=url, timeout=600) as client:
            started = time.perf_counter()
            if together:
                answers = await asyncio.gather(*(client.post("/v1/rerank", json=b)
                                                 for b in bodies))
            else:
                answers = [await client.post("/v1/rerank", json=b) for b in bodies]
            for r in answers:
                r.raise_for_status()
            return time.perf_counter() - started

    asyncio.run(run(True))
    one_by_one, at_once = [], []
    for _ in range(rounds):
        one_by_one.append(asyncio.run(run(False)))
        at_once.append(asyncio.run(run(True)))
    pairs = clients * 32
    seq, con = statistics.median(one_by_one), statistics.median(at_once)
    print(f"\n{clients} clients x 32 documents over HTTP (median of {rounds}):")
    print(f"  one by one {seq * 1e3:8.1f} ms  ({pairs / seq:.1f} pairs/s)")
    print(f"  at once    {con * 1e3:8.1f} ms  ({pairs / con:.1f} pairs/s)  x{seq / con:.2f}")


if __name__ == "__main__":
    sys.exit(main())
