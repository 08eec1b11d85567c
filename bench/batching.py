"""Aggregate decode tokens/s: one stream vs 8 concurrent streams, on the continuous-batching
`llm` worker and on the stateful one-at-a-time `npu` role worker (run on CPU here).

    python bench/batching.py [--tokens 64] [--streams 8]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from serverctl import Server

PROMPT = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]


def one(url: str, tokens: int) -> int:
    body = {"model": "smollm2:135m", "messages": PROMPT, "max_tokens": tokens,
            "temperature": 0, "ignore_eos": True}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
    r.raise_for_status()
    return int(r.json()["usage"]["completion_tokens"])


def aggregate(url: str, streams: int, tokens: int) -> float:
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(streams) as pool:
        total = sum(pool.map(lambda _: one(url, tokens), range(streams)))
    return total / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--streams", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        server = Server(Path(tmp), workers=[
            {"name": "npu", "role": "npu", "max_queue": 64},
            {"name": "llm", "role": "llm"},
        ]).start()
        try:
            server.cli("stop", "npu")
            server.wait_state("npu", ("stopped",))
            one(server.url, 8)
            llm_1 = aggregate(server.url, 1, args.tokens)
            llm_n = aggregate(server.url, args.streams, args.tokens)
            server.cli("start", "npu")
            server.wait_state("npu", ("ready",), timeout=300)
            server.cli("stop", "llm")
            server.wait_state("llm", ("stopped",))
            one(server.url, 8)
            npu_1 = aggregate(server.url, 1, args.tokens)
            npu_n = aggregate(server.url, args.streams, args.tokens)
        finally:
            server.stop()
    n = args.streams
    print(f"{args.tokens} tokens per stream, aggregate decode tokens/s over HTTP")
    print(f"llm (continuous batching): 1 stream {llm_1:6.1f}   {n} streams {llm_n:6.1f}"
          f"   ratio {llm_n / llm_1:.2f}x  (target >= 3.5x)")
    print(f"npu role (one at a time):  1 stream {npu_1:6.1f}   {n} streams {npu_n:6.1f}"
          f"   ratio {npu_n / npu_1:.2f}x")


if __name__ == "__main__":
    main()
