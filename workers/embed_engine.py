"""The embedding engine: one TextEmbeddingPipeline, request batching and an LRU vector cache.

Requests that arrive together are embedded in one pipeline call (bounded by item count and
a short wait); vectors of recently seen texts come from the cache and never reach the
pipeline. Vectors leave as raw little-endian float32 bytes with their shape.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from typing import Any

import numpy as np
import openvino_genai as ov_genai

from protocol.config import Config, WorkerSpec
from protocol.messages import Abort, Embed, Embeddings, ErrorCode, Failed, Timings
from workers.embed_model import MAX_SEQ_LENGTH, count_tokens, embedding_config
from workers.llm_engine import Emit

log = logging.getLogger(__name__)

# NOTE: a batch is cut at this many texts (the pipeline pads to the longest text in a
# batch, so huge batches of mixed lengths waste work) or after this wait for more requests.
MAX_BATCH_TEXTS = 64
BATCH_WAIT_S = 0.003


class VectorCache:
    """(text) -> (vector, token count); the worker serves one model, so text is the key."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._items: OrderedDict[str, tuple[np.ndarray[Any, Any], int]] = OrderedDict()

    def get(self, text: str) -> tuple[np.ndarray[Any, Any], int] | None:
        item = self._items.get(text)
        if item is not None:
            self._items.move_to_end(text)
        return item

    def put(self, text: str, vector: np.ndarray[Any, Any], tokens: int) -> None:
        if self.size <= 0:
            return
        self._items[text] = (vector, tokens)
        self._items.move_to_end(text)
        while len(self._items) > self.size:
            self._items.popitem(last=False)


class EmbedEngine:
    def __init__(self, config: Config, spec: WorkerSpec, model_path: str, emit: Emit) -> None:
        self.spec = spec
        self.model_path = model_path
        self.emit = emit
        self.cache = VectorCache(config.embedding_cache_size)
        self._inbox: queue.SimpleQueue[Embed | Abort] = queue.SimpleQueue()
        self._busy = 0
        self.generated_tokens = 0
        self.served = 0
        self.cache_hits = 0
        self.cache_misses = 0
        self.max_length = MAX_SEQ_LENGTH
        self.pipe: Any = None
        self.tokenizer: Any = None

    def submit(self, msg: Any) -> None:
        if isinstance(msg, Embed | Abort):
            self._inbox.put(msg)

    @property
    def queue_depth(self) -> int:
        return self._inbox.qsize()

    @property
    def in_flight(self) -> int:
        return self._busy

    def load(self, properties: dict[str, Any]) -> None:
        self.pipe = ov_genai.TextEmbeddingPipeline(
            self.model_path, self.spec.device, embedding_config(self.max_length), **properties)
        self.tokenizer = ov_genai.Tokenizer(self.model_path)

    def warm_up(self) -> None:
        self.pipe.embed_documents(["warm up"])

    def abort_all(self, reason: str) -> None:
        pass  # NOTE: a batch takes milliseconds; draining simply lets it finish.

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                first = self._inbox.get(timeout=0.05)
            except queue.Empty:
                continue
            batch = [first]
            deadline = time.monotonic() + BATCH_WAIT_S
            texts = len(first.texts) if isinstance(first, Embed) else 0
            while texts < MAX_BATCH_TEXTS:
                try:
                    more = self._inbox.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty:
                    break
                batch.append(more)
                texts += len(more.texts) if isinstance(more, Embed) else 0
            requests = [m for m in batch if isinstance(m, Embed)]
            self._busy = len(requests)
            try:
                self._serve(requests)
            finally:
                self._busy = 0

    def _serve(self, requests: list[Embed]) -> None:
        received = time.time()
        live: list[tuple[Embed, list[int]]] = []
        for req in requests:
            if received > req.deadline:
                self.emit(Failed(id=req.id, seq=0, code=ErrorCode.DEADLINE_EXCEEDED,
                                 message="request expired before it started"))
                continue
            counts = self._token_counts(req.texts)
            too_long = [i for i, n in enumerate(counts) if n > self.max_length]
            if too_long and not req.truncate:
                i = too_long[0]
                self.emit(Failed(
                    id=req.id, seq=0, code=ErrorCode.PROMPT_TOO_LONG,
                    message=f"input {i} is {counts[i]} tokens, longer than the model's context "
                            f"of {self.max_length}; set truncate to true or shorten it",
                    prompt_tokens=counts[i], limit=self.max_length))
                continue
            live.append((req, counts))
        missing: dict[str, int] = {}
        for req, counts in live:
            for text, n in zip(req.texts, counts, strict=True):
                if self.cache.get(text) is None and text not in missing:
                    missing[text] = n
        started = time.time()
        if missing:
            vectors = np.asarray(self.pipe.embed_documents(list(missing)), dtype="<f4")
            for (text, n), vec in zip(missing.items(), vectors, strict=True):
                self.cache.put(text, vec, n)
        fresh: dict[str, np.ndarray[Any, Any]] = (
            {t: v for t, v in zip(missing, vectors, strict=True)} if missing else {})
        done = time.time()
        for req, counts in live:
            rows = []
            for text in req.texts:
                if text in fresh:
                    self.cache_misses += 1
                    rows.append(fresh[text])
                else:
                    hit = self.cache.get(text)
                    assert hit is not None
                    self.cache_hits += 1
                    rows.append(hit[0])
            matrix = np.stack(rows).astype("<f4", copy=False)
            self.served += 1
            self.emit(Embeddings(
                id=req.id, seq=0, data=matrix.tobytes(), rows=matrix.shape[0],
                dims=matrix.shape[1], prompt_tokens=[min(n, self.max_length) for n in counts],
                timings=Timings(queue_ns=int((started - received) * 1e9),
                                prompt_ns=int((done - started) * 1e9),
                                total_ns=int((time.time() - received) * 1e9))))

    def _token_counts(self, texts: list[str]) -> list[int]:
        counts: list[int] = []
        for text in texts:
            hit = self.cache.get(text)
            counts.append(hit[1] if hit is not None else -1)
        unknown = [t for t, n in zip(texts, counts, strict=True) if n < 0]
        if unknown:
            fresh = iter(count_tokens(self.tokenizer, unknown))
            counts = [n if n >= 0 else next(fresh) for n in counts]
        return counts
