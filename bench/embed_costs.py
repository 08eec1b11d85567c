"""Where the fixed cost of one embedding request goes, stage by stage.

    python bench/embed_costs.py [--url URL --model-dir DIR] [--rounds 5] [--calls 40]

Each stage adds one layer to the one before it, on one short text per request (a new text
every call, the server's vector cache off), so the differences between medians are the
layers' costs:

    pipeline    TextEmbeddingPipeline.embed_documents([text]) in this process
    engine      the worker's EmbedEngine in this process (token count, queue, batch, bytes)
    zmq         an Embed pushed straight to the worker's socket, the reply read from its PUB
                (the worker process, two ZeroMQ hops, msgpack both ways)
    http        POST /v1/embeddings through the gateway (HTTP in, JSON, route, JSON out)
    GET /health the bare HTTP round trip of the same server, for scale

plus the gateway's own encoding work for one reply timed in-process. The stages take turns
in blocks (the order rotates every round) so load from elsewhere falls on all alike; medians.
Nothing here is in the server's hot path: the instrumentation is this script.
"""

from __future__ import annotations

import argparse
import base64
import http.client
import queue
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import msgspec
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import openvino_genai as ov_genai
from embeddings import MODEL, Direct, make_texts
from serverctl import MODEL_CACHE, Server

from npu_proxy.models.locate import MINILM_IR_FOLDER, minilm_ir_folder
from npu_proxy.protocol.config import Config, WorkerSpec, load_config
from npu_proxy.protocol.messages import Embed, Embeddings
from npu_proxy.workers.embed_engine import EmbedEngine
from npu_proxy.workers.embed_model import embedding_config


class Stages:
    def __init__(self, pipe: Any, folder: Path, config: Config, url: str,
                 worker: str) -> None:
        self.pipe = pipe
        self.texts = iter(make_texts(200_000, seed=11))
        # The worker's engine, in this process, on the same pipeline object.
        self.frames: list[Any] = []
        self.got = threading.Event()
        spec = WorkerSpec(name="bench", role="embed")
        self.engine = EmbedEngine(Config(embedding_cache_size=0), spec, str(folder),
                                  self._frame)
        self.engine.pipe = pipe
        self.engine.tokenizer = ov_genai.Tokenizer(str(folder))
        from npu_proxy.workers.embed_engine import _fast_counter
        self.engine.fast_tokenizer = _fast_counter(folder, self.engine.tokenizer)
        self.stop = threading.Event()
        self.jobs: queue.SimpleQueue[list[str]] = queue.SimpleQueue()
        self.done: queue.SimpleQueue[None] = queue.SimpleQueue()
        threading.Thread(target=self._pipe_loop, daemon=True).start()
        threading.Thread(target=self.engine.run, args=(self.stop,), daemon=True).start()
        # Straight to the worker: PUSH to its PULL, SUB to its PUB.
        self.direct = Direct(config, worker)
        parts = urlsplit(url)
        self.conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port,
                                               timeout=120)

    def _frame(self, frame: Any) -> None:
        self.frames.append(frame)
        self.got.set()

    def text(self) -> str:
        return next(self.texts)

    def _pipe_loop(self) -> None:
        while True:
            texts = self.jobs.get()
            self.pipe.embed_documents(texts)
            self.done.put(None)

    def pipeline(self) -> None:
        # NOTE: called from a thread of its own like the engine's: here, calls from the main
        # thread of a process whose other thread also calls the pipeline took twice as long.
        self.jobs.put([self.text()])
        self.done.get()

    def engine_call(self) -> None:
        self.got.clear()
        self.engine.submit(Embed(id=uuid.uuid4().hex, model=MODEL, texts=[self.text()],
                                 deadline=time.time() + 60))
        self.got.wait(60)
        assert isinstance(self.frames.pop(), Embeddings)

    def zmq_call(self) -> None:
        self.direct.run([self.text()])

    def _post(self, fmt: str) -> None:
        body = msgspec.json.encode({"model": MODEL, "input": self.text(),
                                    "encoding_format": fmt})
        self.conn.request("POST", "/v1/embeddings", body, {"content-type": "application/json"})
        resp = self.conn.getresponse()
        data = resp.read()
        assert resp.status == 200, data[:200]

    def http_float(self) -> None:
        self._post("float")

    def http_base64(self) -> None:
        self._post("base64")

    def health(self) -> None:
        self.conn.request("GET", "/health")
        self.conn.getresponse().read()

    def close(self) -> None:
        self.stop.set()
        self.conn.close()
        self.direct.close()


def gateway_encoding(calls: int = 2000) -> dict[str, float]:
    """Seconds per reply of the gateway's own work on one 384-float vector, in-process."""
    vec = np.random.default_rng(1).standard_normal((1, 384)).astype("<f4")
    raw = vec.tobytes()
    wire = msgspec.msgpack.encode([raw, 1, 384])
    out: dict[str, float] = {}

    def time_it(fn: Callable[[], Any]) -> float:
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - started) / calls

    out["msgpack decode of the reply"] = time_it(lambda: msgspec.msgpack.decode(wire))
    out["float: tolist + JSON"] = time_it(lambda: msgspec.json.encode({"data": [
        {"embedding": np.frombuffer(raw, dtype="<f4").reshape(1, 384).tolist()[0]}]}))
    out["base64 + JSON"] = time_it(lambda: msgspec.json.encode({"data": [
        {"embedding": base64.b64encode(raw).decode("ascii")}]}))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running server, started with embedding_cache_size = 0")
    parser.add_argument("--config", help="that server's config.toml (with --url)")
    parser.add_argument("--model-dir", help="the IR folder that server loads (with --url)")
    parser.add_argument("--worker", default="embed")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=40, help="per stage per round")
    args = parser.parse_args()

    server: Server | None = None
    if args.url:
        url = args.url.rstrip("/")
        config = load_config(Path(args.config)) if args.config else Config()
        folder = Path(args.model_dir) if args.model_dir else MODEL_CACHE / MINILM_IR_FOLDER
    else:
        tmp = Path(tempfile.mkdtemp(prefix="npx-bench-costs-"))
        print(f"starting a private server in {tmp} (embed worker only, cache size 0)")
        server = Server(tmp, workers=[{"name": args.worker, "role": "embed"}],
                        embedding_cache_size=0).start()
        url, config = server.url, server.config
        folder = minilm_ir_folder(server.config)
    try:
        pipe = ov_genai.TextEmbeddingPipeline(str(folder), "CPU", embedding_config())
        st = Stages(pipe, folder, config, url, args.worker)
        stages: list[tuple[str, Callable[[], None]]] = [
            ("pipeline", st.pipeline), ("engine", st.engine_call), ("zmq", st.zmq_call),
            ("http float", st.http_float), ("http base64", st.http_base64),
            ("GET /health", st.health)]
        times: dict[str, list[float]] = {name: [] for name, _ in stages}
        try:
            for r in range(args.rounds):
                turn = stages[r % len(stages):] + stages[:r % len(stages)]
                for name, fn in turn:
                    fn()  # NOTE: not timed: the first call after another stage's turn
                    for _ in range(args.calls):
                        started = time.perf_counter()
                        fn()
                        times[name].append(time.perf_counter() - started)
        finally:
            st.close()
        med = {name: statistics.median(v) * 1e3 for name, v in times.items()}
        print(f"\nmedian ms per single-text request ({args.rounds} rounds x {args.calls} calls;"
              " each line adds one layer to the one above)")
        before = 0.0
        for name in ("pipeline", "engine", "zmq", "http float"):
            print(f"  {name:<12} {med[name]:7.2f} ms  (+{med[name] - before:5.2f})")
            before = med[name]
        print(f"  {'http base64':<12} {med['http base64']:7.2f} ms  "
              f"(+{med['http base64'] - med['zmq']:5.2f} over zmq)")
        print(f"  {'GET /health':<12} {med['GET /health']:7.2f} ms  (the HTTP floor)")
        print("the gateway's encoding work per reply, in-process:")
        for name, secs in gateway_encoding().items():
            print(f"  {name:<28} {secs * 1e6:7.1f} us")
    finally:
        if server is not None:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
