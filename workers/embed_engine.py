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
from collections import OrderedDict, deque
from pathlib import Path
from typing import Any

import numpy as np
import openvino_genai as ov_genai

from npu_proxy.protocol.config import Config, WorkerSpec
from npu_proxy.protocol.liveness import EMBED_BATCH_CLASSES, embed_batch_class
from npu_proxy.protocol.messages import Abort, Embed, Embeddings, ErrorCode, Failed
from npu_proxy.protocol.timings import Timings
from npu_proxy.workers.embed_model import (
    MAX_SEQ_LENGTH,
    count_tokens,
    embedding_config,
    ensure_minilm_ir,
    served_length,
)
from npu_proxy.workers.engine import Emit, InboxEngine

log = logging.getLogger(__name__)

# A batch waits for stragglers this long at most in all (max_batch also ends the gather).
GATHER_MAX_S = 0.05
# Seconds after a batch of several requests during which requests count as arriving together.
TOGETHER_S = 1.0
# Aborted request ids remembered so a queued request whose client left is skipped.
ABORTS_KEPT = 1024


def _size(msg: Embed) -> int:
    return len(msg.texts)


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


class EmbedEngine(InboxEngine[Embed]):
    def __init__(self, config: Config, spec: WorkerSpec, model_path: str, emit: Emit,
                 build_minilm: bool = False) -> None:
        super().__init__(spec, emit)
        self.model_path = model_path
        # The embedded MiniLM: its IR folder at model_path is built on first load.
        self.build_minilm = build_minilm
        self.cache = VectorCache(config.embedding_cache_size)
        # NOTE: a batch is cut at this many texts (the pipeline pads to the longest text in a
        # call, so huge calls of mixed lengths waste work) or after this wait for more.
        self.max_batch = max(1, config.embedding_max_batch)
        self.batch_wait = min(max(0.0, config.embedding_batch_wait), 1.0)
        # Pipeline calls by size class (EMBED_BATCH_CLASSES), cumulative: sent in heartbeats.
        self.batches = [0] * len(EMBED_BATCH_CLASSES)
        self._aborted: OrderedDict[str, None] = OrderedDict()
        # monotonic time of the last batch that held several requests, and the sizes of the
        # last two such batches (how many requests a burst brings).
        self._together_at = -TOGETHER_S
        self._sizes: deque[int] = deque(maxlen=2)
        # time.time() when the last gathering ended (arrivals are stamped with time.time()).
        self._gathered_at = 0.0
        # Token counts of the gathering batch's requests by id, counted as each is taken, so
        # counting overlaps the wait for the next instead of delaying the pipeline call.
        self._counted: dict[str, list[int]] = {}
        self.cache_hits = 0
        self.cache_misses = 0
        self.max_length = MAX_SEQ_LENGTH
        self.pipe: Any = None
        self.tokenizer: Any = None
        # Counts tokens much faster than `tokenizer` where the two agree (see _fast_counter).
        self.fast_tokenizer: Any = None

    def submit(self, msg: Any) -> None:
        # NOTE: an Abort is not queued (it would count against max_queue): it is remembered,
        # and a request still waiting is skipped when its batch starts; a running pipeline
        # call takes milliseconds and is never cut short.
        if isinstance(msg, Embed):
            self._inbox.put((time.time(), msg))
        elif isinstance(msg, Abort):
            self._aborted[msg.id] = None
            while len(self._aborted) > ABORTS_KEPT:
                self._aborted.popitem(last=False)

    @property
    def blocking(self) -> bool:
        # NOTE: a pipeline call is at most max_batch texts of at most MAX_SEQ_LENGTH tokens,
        # far below a heartbeat timeout even where the pipeline call holds the GIL.
        return False

    def load(self, properties: dict[str, Any]) -> None:
        if self.build_minilm:
            # NOTE: built by the worker that loads it, while it reports `loading` (under the
            # load deadline); models/locate.py only names the folder.
            ensure_minilm_ir(Path(self.model_path))
        # NOTE: the length the folder says it embeds (models/facts.py), which is what
        # /v1/models and /api/show report for it.
        self.max_length = served_length(Path(self.model_path))
        self.pipe = ov_genai.TextEmbeddingPipeline(
            self.model_path, self.spec.device, embedding_config(self.max_length), **properties)
        self.tokenizer = ov_genai.Tokenizer(self.model_path)
        self.fast_tokenizer = _fast_counter(Path(self.model_path), self.tokenizer)

    def warm_up(self) -> None:
        self.pipe.embed_documents(["warm up"])

    def abort_all(self, reason: str) -> None:
        pass  # NOTE: a batch takes milliseconds; draining simply lets it finish.

    def run(self, stop: threading.Event) -> None:
        for first in self._arrivals(stop):
            requests = self._gather(first)
            self._note_burst(first[0], requests)
            self._busy = len(requests)
            try:
                self._serve(requests)
            except Exception as exc:
                # NOTE: _serve answers a failing pipeline call per request; this is the net
                # for anything else: it fails this batch's requests, not the whole worker.
                log.exception("embedding batch of %d request(s) failed", len(requests))
                for _, req in requests:
                    self._fail(req, exc)
            finally:
                self._busy = 0
                self._counted.clear()

    def _note_burst(self, arrived: float, requests: list[tuple[float, Embed]]) -> None:
        """Learn how many requests a burst brings. A batch whose first request came within
        batch_wait of the last gathering's end holds that burst's stragglers: they count
        with it (else a burst of 16 cut at 15 would teach 15, and every later burst would be
        cut at 15 again, its 16th request a pipeline call of its own). A request that waited
        and found no company was a lone client's: the next one does not wait."""
        if self._sizes and arrived - self._gathered_at <= self.batch_wait:
            self._sizes[-1] += len(requests)
            self._together_at = time.monotonic()
        elif len(requests) > 1:
            self._together_at = time.monotonic()
            self._sizes.append(len(requests))
        else:
            self._together_at = -TOGETHER_S
        self._gathered_at = time.time()

    def _gather(self, first: tuple[float, Embed]) -> list[tuple[float, Embed]]:
        """`first` and the requests queued behind it, up to max_batch texts."""
        batch = [first]
        texts = _size(first[1])
        self._count_ahead(first[1])
        # NOTE: what queued up while the last batch ran is always taken at once. Once
        # requests are evidently arriving together (a batch of several within TOGETHER_S,
        # or more are queued behind this one), the worker also waits for stragglers, as long
        # as each comes within batch_wait of the one before, up to GATHER_MAX_S in all, and
        # only until the batch is as large as the recent bursts were (so a few clients
        # sending in turn never wait for company that is not coming). The gateway hands on
        # a burst of concurrent requests one by one, about a millisecond apart on an idle
        # machine, in fits tens of milliseconds apart on a busy one; a straggler missed
        # costs a pipeline call of its own. Requests of a lone client never wait.
        now = time.monotonic()
        recent = now - self._together_at < TOGETHER_S and bool(self._sizes)
        together = recent or not self._inbox.empty()
        wait = self.batch_wait if together else 0.0
        expect = max(self._sizes) if recent else self.max_batch
        deadline, limit = now + wait, now + GATHER_MAX_S
        while texts < self.max_batch:
            try:
                more = self._inbox.get_nowait()
            except queue.Empty:
                left = deadline - time.monotonic()
                if left <= 0 or len(batch) >= expect:
                    break
                try:
                    more = self._inbox.get(timeout=left)
                except queue.Empty:
                    break
            batch.append(more)
            texts += _size(more[1])
            self._count_ahead(more[1])
            deadline = min(limit, time.monotonic() + wait)
        return batch

    def _fail(self, req: Embed, exc: Exception) -> None:
        self.emit(Failed(id=req.id, seq=0, code=ErrorCode.INTERNAL,
                         message=f"embedding failed: {exc}"))

    def _serve(self, requests: list[tuple[float, Embed]]) -> None:
        now = time.time()
        live: list[tuple[float, Embed]] = []
        for arrived, req in requests:
            if req.id in self._aborted:
                # NOTE: the gateway closed the request when it sent the abort: no answer.
                del self._aborted[req.id]
                continue
            if now > req.deadline:
                self.emit(Failed(id=req.id, seq=0, code=ErrorCode.DEADLINE_EXCEEDED,
                                 message="request expired before it started"))
            else:
                live.append((arrived, req))
        ready: list[tuple[float, Embed, list[int]]] = []
        for arrived, req in live:
            mine = self._counted.pop(req.id, None)
            if mine is None:
                mine = self._token_counts(req.texts)
            too_long = [i for i, n in enumerate(mine) if n > self.max_length]
            if too_long and not req.truncate:
                i = too_long[0]
                self.emit(Failed(
                    id=req.id, seq=0, code=ErrorCode.PROMPT_TOO_LONG,
                    message=f"input {i} is {mine[i]} tokens, longer than the model's context "
                            f"of {self.max_length}; set truncate to true or shorten it",
                    prompt_tokens=mine[i], limit=self.max_length))
                continue
            ready.append((arrived, req, mine))
        # NOTE: hits are taken out now: putting this batch's new vectors in the cache may
        # evict them before the answers are assembled.
        hits: dict[str, np.ndarray[Any, Any]] = {}
        missing: dict[str, int] = {}
        for _, req, mine in ready:
            for text, n in zip(req.texts, mine, strict=True):
                if text in hits or text in missing:
                    continue
                hit = self.cache.get(text)
                if hit is None:
                    missing[text] = n
                else:
                    hits[text] = hit[0]
        started = time.time()
        try:
            fresh = self._embed(missing)
        except Exception as exc:
            if len(ready) == 1:
                log.exception("embedding request failed")
                self._fail(ready[0][1], exc)
                return
            # NOTE: one text the pipeline refuses must not fail the requests batched with
            # it: each request is embedded again on its own, and only those that fail fail.
            log.warning("embedding batch of %d requests failed (%s); retrying each alone",
                        len(ready), exc)
            for arrived, req, mine in ready:
                alone = {t: n for t, n in zip(req.texts, mine, strict=True) if t in missing}
                try:
                    self._answer(arrived, req, mine, hits, self._embed(alone), started)
                except Exception as one:
                    self._fail(req, one)
            return
        for arrived, req, mine in ready:
            self._answer(arrived, req, mine, hits, fresh, started)

    def _answer(self, arrived: float, req: Embed, mine: list[int],
                hits: dict[str, np.ndarray[Any, Any]], fresh: dict[str, np.ndarray[Any, Any]],
                started: float) -> None:
        done = time.time()
        rows = []
        for text in req.texts:
            vec = fresh.get(text)
            if vec is not None:
                self.cache_misses += 1
            else:
                self.cache_hits += 1
                vec = hits[text]
            rows.append(vec)
        matrix = np.ascontiguousarray(np.stack(rows), dtype="<f4")
        self.served += 1
        cut = sum(n > self.max_length for n in mine)
        if cut:
            shown = req.log_id or req.id
            log.info("request_id=%s: %d of %d inputs cut to the model's %d tokens (truncate)",
                     shown, cut, len(mine), self.max_length, extra={"request_id": shown})
        self.emit(Embeddings(
            id=req.id, seq=0, data=matrix.tobytes(), rows=matrix.shape[0], truncated=cut,
            dims=matrix.shape[1], prompt_tokens=[min(n, self.max_length) for n in mine],
            timings=Timings(queue_ns=int((started - arrived) * 1e9),
                            prompt_ns=int((done - started) * 1e9),
                            total_ns=int((time.time() - arrived) * 1e9))))

    def _embed(self, missing: dict[str, int]) -> dict[str, np.ndarray[Any, Any]]:
        """Vectors of texts not in the cache, in pipeline calls of similar lengths."""
        # NOTE: the pipeline pads a call to its longest text; sorting by length before
        # cutting into calls of max_batch keeps short texts out of long texts' padding.
        order = sorted(missing, key=missing.__getitem__)
        fresh: dict[str, np.ndarray[Any, Any]] = {}
        for at in range(0, len(order), self.max_batch):
            chunk = order[at:at + self.max_batch]
            self.batches[embed_batch_class(len(chunk))] += 1
            vectors = np.asarray(self.pipe.embed_documents(chunk), dtype="<f4")
            for text, vec in zip(chunk, vectors, strict=True):
                fresh[text] = vec
                self.cache.put(text, vec, missing[text])
        return fresh

    def _count_ahead(self, req: Embed) -> None:
        """Count a gathered request's tokens now (_serve takes them; a failure to count is
        left for _serve to meet and answer)."""
        try:
            self._counted[req.id] = self._token_counts(req.texts)
        except Exception:
            self._counted.pop(req.id, None)

    def _token_counts(self, texts: list[str]) -> list[int]:
        counts: list[int] = []
        for text in texts:
            hit = self.cache.get(text)
            counts.append(hit[1] if hit is not None else -1)
        unknown = [t for t, n in zip(texts, counts, strict=True) if n < 0]
        if unknown:
            fresh = iter(self._count(unknown))
            counts = [n if n >= 0 else next(fresh) for n in counts]
        return counts

    def _count(self, texts: list[str]) -> list[int]:
        if self.fast_tokenizer is not None:
            return [len(e.ids) for e in self.fast_tokenizer.encode_batch(texts)]
        return count_tokens(self.tokenizer, texts)


# NOTE: texts on which the fast and the OpenVINO tokenizer must agree before the fast one is
# trusted: accents, CJK, emoji, combining marks, control and zero-width characters, a long one.
_PROBES = [
    "The cat sits on the mat.", "Héllo wörld, naïve café!", "日本語のテキスト", "emoji 😀 test",
    "don't stop-believing...", "ÀÉÎÕÜ ß ﬁ", "\t\ttabs\nnewlines", "Ⅻ ½ ² ㎏", "مرحبا بالعالم",
    "Привет мир", "x\u200by zero width", "\u0301combining", "", "a" * 300, " ".join(["word"] * 300),
]


def _fast_counter(folder: Path, tokenizer: Any) -> Any:
    """The Rust `tokenizers` build of tokenizer.json, if it counts exactly as `tokenizer` does.

    Counting every uncached text with the OpenVINO tokenizer costs about 3 ms per call even
    for one short text (measured on 2 CPU cores), as much as 10-30 % of embedding it; the
    Rust tokenizer takes about 0.1 ms. Its counts are checked against OpenVINO's at load.
    """
    path = folder / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        import tokenizers

        fast = tokenizers.Tokenizer.from_file(str(path))
    except Exception as exc:  # NOTE: any failure only means the slower, exact path is used.
        log.info("counting tokens with the OpenVINO tokenizer (%s)", exc)
        return None
    # NOTE: sentence-transformers' tokenizer.json carries its own truncation (128 for
    # MiniLM); counts must be of the whole text, the pipeline applies its own max_length.
    fast.no_truncation()
    fast.no_padding()
    fast_counts = [len(e.ids) for e in fast.encode_batch(_PROBES)]
    exact = count_tokens(tokenizer, _PROBES)
    if fast_counts != exact:
        log.warning("tokenizer.json counts %s differ from the OpenVINO tokenizer's %s; "
                    "counting with the OpenVINO tokenizer", fast_counts, exact)
        return None
    return fast
