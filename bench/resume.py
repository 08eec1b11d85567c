"""A worker SIGKILLed under N greedy streams (issue 43, point 5): how many complete, how many
end with the text they have when no worker dies, the longest pause a client saw, and the
wall time against the same streams without the kill.

    python bench/resume.py [--streams 8] [--tokens 64]

Two private servers, one after the other: a deterministic llm worker (streams are replayed)
and a batching one, the default (streams are continued from their tokens). Per server: the
streams once without a kill (their texts are what "the text it would have had" means), then
again with the worker killed once the first stream has sent a quarter of its tokens.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import itertools
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from serverctl import Server

LLM = "smollm2:135m"
TOPICS = ["a lighthouse keeper", "a lost robot", "the first snow of winter", "a river town",
          "an old clockmaker", "a night market", "a desert caravan", "a mountain school",
          "a paper boat", "a sleepy dragon", "a clock tower", "a garden at night"]


class Run:
    """N streams at once; `kill` SIGKILLs the worker once the first has `at` tokens."""

    def __init__(self, server: Server, streams: int, tokens: int, kill: bool) -> None:
        self.server, self.tokens, self.kill = server, tokens, kill
        self.texts: list[str | None] = [None] * streams
        self.chunk_times: list[list[float]] = [[] for _ in range(streams)]
        self.first_has = threading.Event()
        start = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(streams) as pool:
            futures = [pool.submit(self._stream, i) for i in range(streams)]
            if kill:
                self.first_has.wait(300)
                os.kill(int(server.children()["llm"]["pid"]), signal.SIGKILL)
            for f in futures:
                f.result()
        self.wall = time.monotonic() - start

    def _stream(self, i: int) -> None:
        body = {"model": LLM, "temperature": 0, "max_tokens": self.tokens, "stream": True,
                "ignore_eos": True, "messages": [
                    {"role": "user", "content": f"Write a short story about {TOPICS[i]}."}]}
        parts: list[str] = []
        failed = False
        with httpx.stream("POST", self.server.url + "/v1/chat/completions", json=body,
                          timeout=900) as r:
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                event: dict[str, Any] = httpx.Response(200, content=line[6:]).json()
                if "error" in event:
                    failed = True
                    break
                for choice in event.get("choices", []):
                    if choice["delta"].get("content"):
                        parts.append(choice["delta"]["content"])
                        self.chunk_times[i].append(time.monotonic())
                if i == 0 and len(parts) >= self.tokens // 4:
                    self.first_has.set()
        self.texts[i] = None if failed else "".join(parts)

    def longest_pause(self) -> float:
        gaps = [b - a for times in self.chunk_times for a, b in itertools.pairwise(times)]
        return max(gaps, default=0.0)


def resumptions(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("npu_proxy_stream_resumptions_total{"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    streams = min(args.streams, len(TOPICS))
    print(f"{streams} greedy streams of {args.tokens} tokens, the worker SIGKILLed once the "
          f"first has sent {args.tokens // 4}")
    print(f"{'worker':<14} {'completed':>9} {'same text':>9} {'resumed':>7} "
          f"{'pause s':>8} {'pause/gap':>9} {'wall vs no kill':>15}")
    with tempfile.TemporaryDirectory(prefix="bench-resume-") as tmp:
        for name, spec in (("deterministic", {"deterministic": True, "max_queue": 16}),
                           ("batching", {})):
            server = Server(Path(tmp) / name, workers=[{"name": "llm", "role": "llm", **spec}],
                            stream_resumes=1, backoff_initial=0.2).start()
            try:
                calm = Run(server, streams, args.tokens, kill=False)
                hit = Run(server, streams, args.tokens, kill=True)
                done = sum(t is not None for t in hit.texts)
                same = sum(t == c for t, c in zip(hit.texts, calm.texts, strict=True))
                print(f"{name:<14} {done:>5}/{streams:<3} {same:>5}/{streams:<3} "
                      f"{resumptions(server.url):>7.0f} {hit.longest_pause():>8.1f} "
                      f"{hit.longest_pause() / max(calm.longest_pause(), 1e-3):>9.1f} "
                      f"{hit.wall / calm.wall:>14.2f}x")
            finally:
                server.stop()


if __name__ == "__main__":
    main()
