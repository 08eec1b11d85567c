"""Prompt-lookup decoding on an input-grounded task, through the server: the same requests to
an llm worker with `prompt_lookup` on and to one without, one server busy at a time.

The task repeats or edits a given text (what rewriting, extraction and code edits look like),
greedy, so both workers must produce the same text; printed: median end-to-end completion
tokens/s of each, min-max, the ratio, and whether every text matched.

    python bench/lookup.py [--runs 5] [--lookup 5] [--tokens 160]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from serverctl import Server

CODE = '''def load_config(path):
    with open(path) as f:
        data = json.load(f)
    if "workers" not in data:
        data["workers"] = []
    for worker in data["workers"]:
        worker.setdefault("device", "CPU")
        worker.setdefault("max_queue", 4)
    return data
'''
TASKS = [
    "Rename the function load_config to read_config in this code and return the whole code:\n"
    + CODE,
    "Repeat this code exactly, adding a docstring to the function:\n" + CODE,
]


def run(url: str, task: str, tokens: int) -> tuple[float, str]:
    body = {"model": "smollm2:135m", "max_tokens": tokens, "temperature": 0,
            "messages": [{"role": "user", "content": task}]}
    start = time.perf_counter()
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
    elapsed = time.perf_counter() - start
    r.raise_for_status()
    out = r.json()
    return out["usage"]["completion_tokens"] / elapsed, out["choices"][0]["message"]["content"]


def measure(tmp: Path, lookup: int, runs: int, tokens: int) -> tuple[list[float], list[str]]:
    worker: dict[str, object] = {"name": "llm", "role": "llm"}
    if lookup:
        worker["prompt_lookup"] = lookup
    server = Server(tmp, workers=[worker]).start()
    try:
        for task in TASKS:  # warm: prompts in the prefix cache, as in every measured run
            run(server.url, task, tokens)
        rates, texts = [], []
        for _ in range(runs):
            for task in TASKS:
                rate, text = run(server.url, task, tokens)
                rates.append(rate)
                texts.append(text)
        return rates, texts
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--lookup", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=160)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "off").mkdir()
        (Path(tmp) / "on").mkdir()
        off, off_texts = measure(Path(tmp) / "off", 0, args.runs, args.tokens)
        on, on_texts = measure(Path(tmp) / "on", args.lookup, args.runs, args.tokens)
    print(f"input-grounded task (edit a given code snippet), greedy, {len(TASKS)} prompts x "
          f"{args.runs} runs, up to {args.tokens} tokens, end-to-end completion tokens/s:")
    print(f"  prompt lookup off: {statistics.median(off):6.1f}  ({min(off):.1f}-{max(off):.1f})")
    print(f"  prompt lookup {args.lookup}:  {statistics.median(on):6.1f}  "
          f"({min(on):.1f}-{max(on):.1f})")
    print(f"  speedup: {statistics.median(on) / statistics.median(off):.2f}x; identical text: "
          f"{sum(a == b for a, b in zip(off_texts, on_texts, strict=True))} of {len(on_texts)}")


if __name__ == "__main__":
    main()
