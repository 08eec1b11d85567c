"""Time to first token for one image: through the server versus the in-process VLMPipeline.

    python bench/vlm.py [--url URL --model NAME] [--rounds 8] [--size 224]

Without --url a private server is started with one `vlm` worker on the CPU serving the tiny test
VLM (tests/tiny_vlm.py, built into the test model cache on first use). Each round sends the
same chat (one image, a short question) both ways, taking turns, with a new random image every
round so no side answers from a prefix cache: the server as an OpenAI streaming request (image
as a data URL; first content chunk), in-process as VLMPipeline.generate and as the
ContinuousBatchingPipeline the worker runs (CPU/GPU), each with a streamer (first token).
Printed: the median of each and the ratios in-process / server (1.0 = the server adds nothing;
the gap is HTTP, base64 and Pillow decoding, two ZeroMQ hops and the engine loop).
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import openvino as ov
import openvino_genai as ov_genai
from PIL import Image
from serverctl import MODEL_CACHE, Server
from tiny_vlm import ensure

MODEL = "tiny-vlm"
QUESTION = "What is in this image?"


def random_png(seed: int, size: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


def server_ttft(url: str, model: str, image: bytes) -> float:
    body = {"model": model, "max_tokens": 8, "temperature": 0, "stream": True, "messages": [
        {"role": "user", "content": [
            {"type": "image_url", "image_url": {
                "url": "data:image/png;base64," + base64.b64encode(image).decode()}},
            {"type": "text", "text": QUESTION}]}]}
    started = time.perf_counter()
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            choices = json.loads(line[6:]).get("choices") or [{}]
            if choices[0].get("delta", {}).get("content"):
                return time.perf_counter() - started
    raise RuntimeError("the stream ended without content")


class _FirstToken(ov_genai.StreamerBase):  # type: ignore[misc]
    """Notes when the first token id arrives (token ids, as the worker reads them: a text
    streamer would hold back the first word)."""

    def __init__(self, started: float) -> None:
        super().__init__()
        self.started = started
        self.first = 0.0

    def write(self, token: object) -> ov_genai.StreamingStatus:
        if not self.first:
            self.first = time.perf_counter() - self.started
        return ov_genai.StreamingStatus.RUNNING

    def end(self) -> None:
        pass


class InProcess:
    """One in-process pipeline: VLMPipeline, or the ContinuousBatchingPipeline the worker runs
    on CPU/GPU (`batching`)."""

    def __init__(self, path: Path, batching: bool) -> None:
        self.batching = batching
        if batching:
            sched = ov_genai.SchedulerConfig()
            sched.enable_prefix_caching = True
            sched.cache_size = 1
            self.pipe = ov_genai.ContinuousBatchingPipeline(str(path), sched, "CPU")
        else:
            self.pipe = ov_genai.VLMPipeline(str(path), "CPU")
        self.prompt = str(self.pipe.get_tokenizer().apply_chat_template(
            [{"role": "user", "content": "<ov_genai_image_0>" + QUESTION}],
            add_generation_prompt=True))
        self.config = ov_genai.GenerationConfig()
        self.config.max_new_tokens = 8
        self.config.apply_chat_template = False

    def ttft(self, image: bytes) -> float:
        started = time.perf_counter()
        streamer = _FirstToken(started)
        # NOTE: the same work the worker does for an image: decode the file, then generate.
        tensor = ov.Tensor(np.asarray(Image.open(io.BytesIO(image)).convert("RGB"))[None])
        if self.batching:
            self.pipe.generate([self.prompt], images=[[tensor]],
                               generation_config=[self.config], streamer=streamer)
        else:
            self.pipe.generate(self.prompt, images=[tensor], generation_config=self.config,
                               streamer=streamer)
        return streamer.first


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running server (default: start a private one)")
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--path", type=Path, help="the model's IR folder for the in-process "
                        "side (default: the tiny test VLM)")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--size", type=int, default=224, help="image side in pixels")
    args = parser.parse_args()
    path = args.path or ensure(MODEL_CACHE)
    server: Server | None = None
    url = args.url
    if url is None:
        server = Server(Path(tempfile.mkdtemp(prefix="bench-vlm-")), workers=[
            {"name": "vlm", "role": "vlm", "device": "CPU", "model": args.model}],
            models={args.model: {"path": str(path), "kind": "vlm"}}).start()
        url = server.url
    try:
        sides: dict[str, Callable[[bytes], float]] = {
            "server": lambda im: server_ttft(url, args.model, im)}
        for name, batching in (("VLMPipeline", False), ("ContinuousBatchingPipeline", True)):
            sides[name] = InProcess(path, batching).ttft
        times: dict[str, list[float]] = {name: [] for name in sides}
        for run in sides.values():  # warm-up: compilation, first allocations
            run(random_png(0, args.size))
        for i in range(1, args.rounds + 1):
            image = random_png(i, args.size)
            order = list(sides.items())
            for name, run in order[i % len(order):] + order[:i % len(order)]:
                times[name].append(run(image))
        served = statistics.median(times["server"])
        print(f"vlm ttft, one {args.size}x{args.size} image, {args.rounds} rounds "
              f"(medians): server {served * 1000:.1f} ms")
        for name in ("VLMPipeline", "ContinuousBatchingPipeline"):
            local = statistics.median(times[name])
            print(f"  in-process {name}: {local * 1000:.1f} ms, "
                  f"ratio in-process/server {local / served:.2f}")
    finally:
        if server is not None:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
