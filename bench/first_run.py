"""A first run's answers: the examples of Ollama's API documentation and of the README, on the
embedded model with its own defaults (among them a frequency penalty of 0.3, the nearest
GenAI has to Ollama's repeat_penalty), beside the same requests with that penalty turned off
(`frequency_penalty: 0`), in one run.

    python bench/first_run.py [--seeds 3]

A server with the default workers is started in a scratch folder (tests/serverctl.py, the
shared model cache). Each example runs once per seed in each variant; printed per example and
variant: how many answers ended where the model stopped (`done_reason` / `finish_reason`
"stop") rather than at the output limit, the median output tokens and the median seconds,
then the ratio of the medians (without the penalty / the defaults). The seconds depend on the
machine and its load; the counts and the ratio are what carries over.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from serverctl import Server

MODEL = "smollm2:135m"
SKY = "Why is the sky blue?"
# (name, path, body): as Ollama's docs/api.md and the README write them (streaming off, to
# read one answer; the tokens are the same).
EXAMPLES: list[tuple[str, str, dict[str, Any]]] = [
    ("ollama /api/generate", "/api/generate", {"model": MODEL, "prompt": SKY, "stream": False}),
    ("ollama /api/chat", "/api/chat", {"model": MODEL, "stream": False, "messages": [
        {"role": "user", "content": "why is the sky blue?"}]}),
    ("README /v1/chat/completions", "/v1/chat/completions", {"model": MODEL, "messages": [
        {"role": "user", "content": "What is the capital of France?"}]}),
]


def _run(client: httpx.Client, path: str, body: dict[str, Any], seed: int,
         plain: bool) -> tuple[bool, int, float]:
    """(stopped by the model, output tokens, seconds) of one request."""
    body = dict(body)
    if path.startswith("/api/"):
        body["options"] = {"seed": seed, **({"frequency_penalty": 0.0} if plain else {})}
    else:
        body["seed"] = seed
        if plain:
            body["frequency_penalty"] = 0.0
    began = time.monotonic()
    reply = client.post(path, json=body, timeout=900.0)
    seconds = time.monotonic() - began
    reply.raise_for_status()
    data = reply.json()
    if path.startswith("/api/"):
        return data["done_reason"] == "stop", data["eval_count"], seconds
    return (data["choices"][0]["finish_reason"] == "stop", data["usage"]["completion_tokens"],
            seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="first-run-") as tmp:
        server = Server(Path(tmp)).start()
        try:
            with httpx.Client(base_url=server.url) as client:
                print(f"{'example':<30} {'variant':<26} {'stopped':>8} {'tokens':>7} "
                      f"{'seconds':>8}")
                for name, path, body in EXAMPLES:
                    medians: dict[bool, float] = {}
                    for plain in (False, True):
                        runs = [_run(client, path, body, seed, plain)
                                for seed in range(1, args.seeds + 1)]
                        stopped = sum(r[0] for r in runs)
                        tokens = statistics.median(r[1] for r in runs)
                        medians[plain] = statistics.median(r[2] for r in runs)
                        variant = "frequency_penalty 0" if plain else "the model's defaults"
                        print(f"{name:<30} {variant:<26} {stopped:>4}/{len(runs):<3} "
                              f"{tokens:>7.0f} {medians[plain]:>8.1f}", flush=True)
                    print(f"{'':<30} {'seconds, without / defaults':<26} "
                          f"{medians[True] / medians[False]:>21.2f}")
        finally:
            server.stop()


if __name__ == "__main__":
    main()
