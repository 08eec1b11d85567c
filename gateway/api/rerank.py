"""POST /v1/rerank, /rerank and /v2/rerank: the Cohere/Jina rerank shape vLLM serves.

The request names a reranking model, a `query` and `documents` (strings, or objects with a
`text`), optionally `top_n` (0 or absent: every document) and `return_documents` (default
true, as vLLM and Jina). The worker scores every document (one Rerank request, answered by
one Reranked frame); the answer lists the best `top_n` by `relevance_score`, highest first,
each with its `index` in the request and, unless turned off, its `document.text`. `usage`
has `total_tokens`, the tokens of every query-document pair the model read. `truncate` (an
extension, as on the embedding routes) set to false makes an over-long pair a 400 instead of
cutting it. Errors are in OpenAI's shape on all three paths (gateway/http/wire.py).
"""

from __future__ import annotations

import uuid
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from npu_proxy.gateway.api.request_path import DialectRoutes, GatewayError, invalid
from npu_proxy.gateway.http.util import dumps, request_id, request_key
from npu_proxy.protocol.messages import Rerank

PATHS = ("/v1/rerank", "/rerank", "/v2/rerank")


class RerankRequest(msgspec.Struct):
    model: str = ""
    query: Any = None
    # NOTE: Any, so that a wrong shape gets a 400 naming the document, not msgspec's union
    # message; _documents() checks it.
    documents: Any = None
    top_n: int | None = None
    return_documents: bool | None = None
    # Extension (as on /v1/embeddings): false turns an over-long pair into a 400.
    truncate: bool | None = None
    user: str | None = None


def _documents(value: Any) -> list[str]:
    """The documents as texts, or a 400 that says what is wrong with them."""
    if value is None:
        raise invalid("'documents' is required: a list of strings or of objects with a "
                      "'text'", param="documents")
    if not isinstance(value, list):
        raise invalid("'documents' must be a list of strings or of objects with a 'text'",
                      param="documents")
    if not value:
        raise invalid("'documents' must not be empty", param="documents")
    texts: list[str] = []
    for i, item in enumerate(value):
        if isinstance(item, dict):
            item = item.get("text")
        if not isinstance(item, str):
            raise invalid(f"'documents' item {i} must be a string or an object with a string "
                          "'text'", param="documents")
        texts.append(item)
    return texts


class RerankRoutes(DialectRoutes):
    def routes(self) -> list[Route]:
        return [self.requests.post(path, RerankRequest, self.rerank) for path in PATHS]

    def _check(self, req: RerankRequest) -> tuple[str, list[str]]:
        if not isinstance(req.query, str):
            raise invalid("'query' is required: a string", param="query")
        if not req.query.strip():
            raise invalid("'query' must not be empty", param="query")
        documents = _documents(req.documents)
        if req.top_n is not None and req.top_n < 0:
            raise invalid(f"'top_n' must be 0 (every document) or more, got {req.top_n}",
                          param="top_n")
        config = self.config
        if len(documents) > config.max_rerank_documents:
            raise invalid(f"'documents' has {len(documents)} items; the limit is "
                          f"{config.max_rerank_documents} per request (max_rerank_documents)",
                          param="documents")
        limit = config.max_rerank_chars
        if len(req.query) > limit:
            raise invalid(f"'query' is {len(req.query)} characters; the limit is {limit} "
                          "(max_rerank_chars)", param="query")
        for i, text in enumerate(documents):
            if len(text) > limit:
                raise invalid(f"'documents' item {i} is {len(text)} characters; the limit is "
                              f"{limit} per document (max_rerank_chars)", param="documents")
        return req.query, documents

    async def rerank(self, request: Request, req: RerankRequest) -> Response:
        query, documents = self._check(req)
        model = self.requests.resolve(req.model, kind="rerank")
        msg = Rerank(id=request_key(request), model=model.name, query=query,
                     documents=documents, deadline=self.requests.deadline(),
                     truncate=req.truncate is not False, log_id=request_id(request))
        try:
            done = await self.requests.rerank(request, model, msg)
        except GatewayError as exc:
            if exc.kind == "context_length_exceeded":
                exc.param = "documents"
            raise
        scores = done.frame.scores
        if len(scores) != len(documents):
            raise GatewayError(500, "internal", f"the worker scored {len(scores)} of "
                                                f"{len(documents)} documents")
        # NOTE: a stable sort: equal scores keep the documents' order.
        order = sorted(range(len(scores)), key=lambda i: -scores[i])
        if req.top_n:
            order = order[:req.top_n]
        with_text = req.return_documents is not False
        results: list[dict[str, Any]] = []
        for i in order:
            result: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
            if with_text:
                result["document"] = {"text": documents[i]}
            results.append(result)
        body = {
            "id": f"rerank-{uuid.uuid4().hex}",
            "model": req.model,
            "usage": {"total_tokens": sum(done.frame.prompt_tokens)},
            "results": results,
        }
        return Response(dumps(body), media_type="application/json", headers=done.headers)
