"""The rerank engine: one TextRerankPipeline scoring (query, document) pairs.

Requests that wait together and share a query are scored in the same pipeline calls; the
documents of a round are sorted by length and cut into calls of at most MAX_BATCH_PAIRS
pairs, so short documents are not padded to a long one's length. Each request gets one score
per document in its own order (the gateway sorts and cuts to top_n) and the tokens of each
pair the model read. A pair longer than the model's max length is cut by the pipeline (the
longer of query and document first), or fails the request when it asked not to truncate.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from pathlib import Path
from typing import Any

import openvino_genai as ov_genai

from npu_proxy.protocol.config import WorkerSpec
from npu_proxy.protocol.messages import Abort, ErrorCode, Failed, Rerank, Reranked
from npu_proxy.protocol.timings import Timings
from npu_proxy.workers.engine import Emit, InboxEngine
from npu_proxy.workers.rerank_model import (
    MAX_PAIR_LENGTH,
    ensure_minilm_rerank_ir,
    pair_safe_folder,
    rerank_config,
)

log = logging.getLogger(__name__)

# NOTE: pairs per pipeline call: the call pads every pair to the longest one, and 32 pairs of
# 512 tokens take a few seconds on 2 CPU cores (the call releases the GIL; heartbeats go on).
MAX_BATCH_PAIRS = 32
# NOTE: a model's own length beyond this is not trusted (tokenizer_config.json often holds
# a placeholder such as 1e30).
_MAX_TRUSTED_LENGTH = 32768


def model_max_length(folder: Path) -> int:
    """The longest pair the model reads: its tokenizer's model_max_length, else 512."""
    try:
        value = json.loads((folder / "tokenizer_config.json").read_text()).get(
            "model_max_length")
    except (OSError, ValueError, AttributeError):
        value = None
    if isinstance(value, int) and 2 <= value <= _MAX_TRUSTED_LENGTH:
        return value
    return MAX_PAIR_LENGTH


class RerankEngine(InboxEngine[Rerank]):
    def __init__(self, spec: WorkerSpec, model_path: str, emit: Emit, cache: Path,
                 build_minilm: bool = False) -> None:
        super().__init__(spec, emit)
        self.model_path = model_path
        # The model cache, where a pulled reranker's pair-safe folder is kept.
        self.cache = cache
        # The embedded reranker: its folder at model_path is built on first load.
        self.build_minilm = build_minilm
        self.max_length = MAX_PAIR_LENGTH
        self.pipe: Any = None
        self.tokenizer: Any = None
        # Pipeline calls made (one per pairs_per_call pairs of a round), for tests and logs.
        self.calls = 0
        # 1 when the model's tokenizer could not be made pair-safe (see _pair_safe).
        self.pairs_per_call = MAX_BATCH_PAIRS

    # --- the worker process's side ------------------------------------------------------

    def submit(self, msg: Any) -> None:
        # NOTE: aborts are not queued: a round is never cut short (see abort_all).
        if isinstance(msg, Rerank):
            self._inbox.put((time.time(), msg))
        elif not isinstance(msg, Abort):
            # NOTE: the gateway routes only Rerank here; anything else is answered, not lost.
            self.emit(Failed(id=msg.id, seq=0, code=ErrorCode.BAD_REQUEST,
                             message=f"worker {self.spec.name} only reranks"))

    @property
    def blocking(self) -> bool:
        # NOTE: TextRerankPipeline.rerank releases the GIL (measured: another thread runs
        # throughout a call), so heartbeats keep coming while it scores.
        return False

    def load(self, properties: dict[str, Any]) -> None:
        folder = Path(self.model_path)
        if self.build_minilm:
            ensure_minilm_rerank_ir(folder)
            self.max_length = MAX_PAIR_LENGTH
        else:
            self.max_length = model_max_length(folder)
            folder = self._pair_safe(folder)
        self.pipe = ov_genai.TextRerankPipeline(
            str(folder), self.spec.device, rerank_config(self.max_length), **properties)
        # NOTE: add_second_input as the pipeline opens it, so pairs are counted as it reads
        # them; a tokenizer that cannot take pairs is fed query + document, as there.
        self.tokenizer = ov_genai.Tokenizer(str(folder), add_second_input=True)

    def _pair_safe(self, folder: Path) -> Path:
        """The folder to load a pulled reranker from: one whose tokenizer never broadcasts
        the query (see workers/rerank_model.py), checked to tokenize pairs exactly as the
        model's own tokenizer does. When that cannot be made, the model's own folder, and one
        document per pipeline call (a lone query and a lone document are never broadcast)."""
        own = ov_genai.Tokenizer(str(folder), add_second_input=True)
        if not own.supports_paired_input():
            return folder  # NOTE: the pipeline feeds it query + document: no broadcast.
        try:
            safe = pair_safe_folder(folder, self.cache)
            same = _same_pairs(own, ov_genai.Tokenizer(str(safe), add_second_input=True))
        except Exception as exc:
            log.warning("cannot make the tokenizer of %s pair-safe (%s); scoring one "
                        "document per pipeline call", folder, exc)
            self.pairs_per_call = 1
            return folder
        if not same:
            log.warning("the pair-safe tokenizer of %s tokenizes differently; scoring one "
                        "document per pipeline call", folder)
            self.pairs_per_call = 1
            return folder
        log.info("loading %s with its pair-safe tokenizer from %s", folder, safe)
        return safe

    def warm_up(self) -> None:
        self.pipe.rerank("warm up", ["warm up"])

    def abort_all(self, reason: str) -> None:
        pass  # NOTE: draining lets the round finish; each call takes seconds at most.

    def run(self, stop: threading.Event) -> None:
        for first in self._arrivals(stop):
            batch = [first]
            while True:
                try:
                    batch.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            self._busy = len(batch)
            try:
                self._round(batch)
            finally:
                self._busy = 0

    # --- one round -----------------------------------------------------------------------

    def _round(self, batch: list[tuple[float, Rerank]]) -> None:
        groups: dict[str, list[tuple[float, Rerank, list[int]]]] = {}
        now = time.time()
        for arrived, req in batch:
            if now > req.deadline:
                self.emit(Failed(id=req.id, seq=0, code=ErrorCode.DEADLINE_EXCEEDED,
                                 message="request expired before it started"))
                continue
            try:
                counts = self._count(req.query, req.documents)
            except Exception as exc:
                log.exception("counting the tokens of rerank request %s failed", req.log_id)
                self.emit(Failed(id=req.id, seq=0, code=ErrorCode.INTERNAL,
                                 message=f"rerank failed: {exc}"))
                continue
            too_long = [i for i, n in enumerate(counts) if n > self.max_length]
            if too_long and not req.truncate:
                i = too_long[0]
                self.emit(Failed(
                    id=req.id, seq=0, code=ErrorCode.PROMPT_TOO_LONG,
                    message=f"the query with document {i} is {counts[i]} tokens, longer than "
                            f"the model's {self.max_length}; set truncate to true or shorten "
                            "them", prompt_tokens=counts[i], limit=self.max_length))
                continue
            groups.setdefault(req.query, []).append((arrived, req, counts))
        for query, members in groups.items():
            try:
                self._score(query, members)
            except Exception as exc:
                # NOTE: a pipeline error fails this query's requests, not the worker.
                log.exception("rerank of %d request(s) failed", len(members))
                for _, req, _ in members:
                    self.emit(Failed(id=req.id, seq=0, code=ErrorCode.INTERNAL,
                                     message=f"rerank failed: {exc}"))

    def _score(self, query: str, members: list[tuple[float, Rerank, list[int]]]) -> None:
        # (member, document index, tokens) of every pair, shortest first.
        pairs = [(m, i, n) for m, (_, _, counts) in enumerate(members)
                 for i, n in enumerate(counts)]
        pairs.sort(key=lambda pair: pair[2])
        scores: list[list[float]] = [[0.0] * len(req.documents) for _, req, _ in members]
        started = time.time()
        for at in range(0, len(pairs), self.pairs_per_call):
            chunk = pairs[at:at + self.pairs_per_call]
            texts = [members[m][1].documents[i] for m, i, _ in chunk]
            ranked = self.pipe.rerank(query, texts)
            self.calls += 1
            self.progress_at = time.monotonic()
            if len(ranked) != len(chunk):
                raise RuntimeError(f"the pipeline scored {len(ranked)} of {len(chunk)} pairs")
            for index, score in ranked:
                m, i, _ = chunk[index]
                scores[m][i] = float(score)
        done = time.time()
        for (arrived, req, counts), mine in zip(members, scores, strict=True):
            used = [min(n, self.max_length) for n in counts]
            self.served += 1
            self.emit(Reranked(
                id=req.id, seq=0, scores=mine, prompt_tokens=used,
                timings=Timings(queue_ns=int((started - arrived) * 1e9),
                                prompt_ns=int((done - started) * 1e9),
                                total_ns=int((time.time() - arrived) * 1e9))))

    def _count(self, query: str, documents: list[str]) -> list[int]:
        """Tokens of each (query, document) pair with the special tokens, before truncation."""
        if not documents:
            return []  # NOTE: Tokenizer.encode([]) segfaults (openvino-genai 2026.4).
        if self.tokenizer.supports_paired_input():
            # NOTE: the query repeated, never broadcast: a lone first string against 16 or
            # more second ones corrupts memory in openvino-tokenizers 2026.4 (rerank_model).
            encoded = self.tokenizer.encode([query] * len(documents), documents)
        else:
            encoded = self.tokenizer.encode([query + text for text in documents])
        return [int(row.sum()) for row in encoded.attention_mask.data]


# NOTE: pairs the pair-safe tokenizer must encode exactly as the model's own: short and long
# queries against shorter and longer documents, accents, CJK, an empty document.
_PROBE_QUERIES = ["what is a panda?", "Héllo wörld, naïve café! " * 12, "日本語のテキスト"]
_PROBE_DOCUMENTS = ["hi", "The giant panda is a bear species endemic to China. " * 8, "",
                    "emoji 😀 test\tand\nnewlines"]


def _same_pairs(own: Any, safe: Any) -> bool:
    for query in _PROBE_QUERIES:
        # NOTE: the query repeated for the model's own tokenizer: broadcasting corrupts memory.
        mine = own.encode([query] * len(_PROBE_DOCUMENTS), _PROBE_DOCUMENTS)
        theirs = safe.encode([query], _PROBE_DOCUMENTS)
        if mine.input_ids.data.tolist() != theirs.input_ids.data.tolist():
            return False
    return True
