"""Embeddings in two dialects: OpenAI /v1/embeddings and Ollama /api/embed, /api/embeddings.

Both translate their wire format to one Embed request; the worker answers with raw
little-endian float32 bytes and a shape, which are read with numpy and written as JSON
floats or (OpenAI base64) sent on as the very same bytes. Decoding and errors in each API's
shape are the shared request path (gateway/api/request_path.py); an embedding is not watched for a
client that goes away (it is one short batch, not a stream). `dimensions` below the model's
size keeps each vector's first components, renormalised to unit length (`shortened`).
"""

from __future__ import annotations

import base64
from typing import TYPE_CHECKING, Any

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from npu_proxy.gateway.api.request_path import (
    DialectRoutes,
    Embedded,
    GatewayError,
    RequestPath,
    ServedModel,
    invalid,
    parse_keep_alive,
)
from npu_proxy.gateway.http.preload import numpy_ready
from npu_proxy.gateway.http.util import dumps, request_id, request_key
from npu_proxy.protocol.messages import Embed, Embeddings

if TYPE_CHECKING:
    import numpy as np

# --- request shapes ----------------------------------------------------------------------


class OpenAIEmbeddingRequest(msgspec.Struct):
    model: str = ""
    # NOTE: Any, because msgspec cannot tell a list of strings from a list of token ids in
    # a union; _texts() checks the shape and says what is wrong.
    input: Any = None
    encoding_format: str | None = None
    dimensions: int | None = None
    user: str | None = None
    # Extension (as Ollama's): false turns over-long inputs into a 400 instead of truncating.
    truncate: bool | None = None


class OllamaEmbedRequest(msgspec.Struct):
    model: str = ""
    input: Any = None
    truncate: bool | None = None
    dimensions: int | None = None
    keep_alive: float | str | None = None
    options: dict[str, Any] | None = None


class OllamaEmbeddingsRequest(msgspec.Struct):
    model: str = ""
    prompt: Any = None
    keep_alive: float | str | None = None
    options: dict[str, Any] | None = None


# --- translation -------------------------------------------------------------------------


def _is_token_ids(value: Any) -> bool:
    if isinstance(value, int) and not isinstance(value, bool):
        return True
    return (isinstance(value, list) and bool(value)
            and all(isinstance(v, int) and not isinstance(v, bool) for v in value))


def _texts(value: Any, param: str, allow_empty: bool) -> list[str]:
    """The input as a list of strings, or a 400 that says what is wrong with it."""
    if isinstance(value, str):
        return [value]
    if value is None:
        if allow_empty:
            return []
        raise invalid(f"'{param}' is required: a string or a list of strings", param=param)
    if not isinstance(value, list):
        raise invalid(f"'{param}' must be a string or a list of strings", param=param)
    if not value:
        if allow_empty:
            return []
        raise invalid(f"'{param}' must not be an empty list", param=param)
    if all(isinstance(v, str) for v in value):
        return value
    if _is_token_ids(value) or all(_is_token_ids(v) for v in value):
        raise invalid(f"'{param}' holds token ids; this server embeds text only, "
                      "so send the input as a string or a list of strings", param=param)
    raise invalid(f"'{param}' must be a string or a list of strings", param=param)


class EmbeddingRoutes(DialectRoutes):
    def __init__(self, requests: RequestPath) -> None:
        super().__init__(requests)
        # NOTE: a model's vector size is learnt from its first answer; until then a
        # `dimensions` request is checked against the answer instead of before it.
        self._dims: dict[str, int] = {}

    def routes(self) -> list[Route]:
        return [
            self.requests.post("/v1/embeddings", OpenAIEmbeddingRequest, self.openai_embeddings),
            self.requests.post("/api/embed", OllamaEmbedRequest, self.ollama_embed),
            self.requests.post("/api/embeddings", OllamaEmbeddingsRequest, self.ollama_embeddings),
        ]

    # --- shared --------------------------------------------------------------------------

    def _check_limits(self, texts: list[str], param: str) -> None:
        limit = self.config.max_embed_items
        if len(texts) > limit:
            raise invalid(f"'{param}' has {len(texts)} items; the limit is {limit} per request "
                          "(max_embed_items)", param=param)
        limit = self.config.max_embed_chars
        for i, text in enumerate(texts):
            if len(text) > limit:
                raise invalid(f"'{param}' item {i} is {len(text)} characters; the limit is "
                              f"{limit} per item (max_embed_chars)", param=param)

    def _check_dimensions(self, model: ServedModel, wanted: int | None,
                          native: int | None) -> None:
        if wanted is None or native is None or wanted <= native:
            return
        raise invalid(f"model '{model.name}' makes {native}-dimensional vectors; 'dimensions' "
                      f"is {wanted}, more than that: omit it or set it to at most {native}",
                      param="dimensions")

    async def _embed(self, request: Request, model: ServedModel, texts: list[str],
                     truncate: bool, dimensions: int | None,
                     param: str) -> Embedded:
        if dimensions is not None and dimensions <= 0:
            raise invalid(f"'dimensions' must be a positive integer, got {dimensions}",
                          param="dimensions")
        self._check_dimensions(model, dimensions, self._dims.get(model.name))
        self._check_limits(texts, param)
        # NOTE: the vectors are read with numpy, imported by the first request needing it
        # (preload.py).
        await numpy_ready()
        msg = Embed(id=request_key(request), model=model.name, texts=texts,
                    deadline=self.requests.deadline(), truncate=truncate,
                    log_id=request_id(request))
        try:
            done = await self.requests.embed(request, model, msg)
        except GatewayError as exc:
            if exc.kind == "context_length_exceeded":
                exc.param = param
            raise
        self._dims[model.name] = done.frame.dims
        if done.frame.truncated:  # NOTE: cut to the model's length (truncate): said, not silent
            done.headers["X-NPU-Proxy-Truncated-Inputs"] = str(done.frame.truncated)
        self._check_dimensions(model, dimensions, done.frame.dims)
        if dimensions is not None and dimensions < done.frame.dims:
            done.frame = shortened(done.frame, dimensions)
        return done

    # --- OpenAI --------------------------------------------------------------------------

    async def openai_embeddings(self, request: Request, req: OpenAIEmbeddingRequest) -> Response:
        fmt = req.encoding_format or "float"
        if fmt not in ("float", "base64"):
            raise invalid(f"encoding_format must be 'float' or 'base64', got '{fmt}'",
                          param="encoding_format")
        texts = _texts(req.input, "input", allow_empty=False)
        model = self.requests.resolve(req.model, kind="embed")
        done = await self._embed(request, model, texts, req.truncate is not False,
                                 req.dimensions, "input")
        frame = done.frame
        if fmt == "base64":
            raw = memoryview(frame.data)
            size = frame.dims * 4
            vectors: list[Any] = [base64.b64encode(raw[i * size:(i + 1) * size]).decode("ascii")
                                  for i in range(frame.rows)]
        else:
            vectors = _matrix(frame).tolist()
        tokens = sum(frame.prompt_tokens)
        body = {
            "object": "list",
            "data": [{"object": "embedding", "index": i, "embedding": v}
                     for i, v in enumerate(vectors)],
            "model": req.model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
        return Response(dumps(body), media_type="application/json", headers=done.headers)

    # --- Ollama --------------------------------------------------------------------------

    async def ollama_embed(self, request: Request, req: OllamaEmbedRequest) -> Response:
        texts = _texts(req.input, "input", allow_empty=True)
        model = self.requests.resolve(req.model, kind="embed")
        keep = parse_keep_alive(req.keep_alive)
        # NOTE: Ollama answers an empty input with no vectors (it only loads the model).
        if not texts:
            self.requests.keep(model, keep)
            return JSONResponse({"model": req.model, "embeddings": [], "total_duration": 0,
                                 "load_duration": 0, "prompt_eval_count": 0})
        # NOTE: Ollama sends 0 for "not set".
        done = await self._embed(request, model, texts, req.truncate is not False,
                                 req.dimensions or None, "input")
        self.requests.keep(model, keep)
        frame = done.frame
        # NOTE: a lazy embed worker is started by the request that needs it: that wait is
        # Ollama's load_duration (the worker reports no load time of its own per request).
        waited = done.load_wait_ns
        body = {
            "model": req.model,
            "embeddings": _matrix(frame).tolist(),
            "total_duration": waited + frame.timings.total_ns,
            "load_duration": waited,
            "prompt_eval_count": sum(frame.prompt_tokens),
        }
        return Response(dumps(body), media_type="application/json", headers=done.headers)

    async def ollama_embeddings(self, request: Request, req: OllamaEmbeddingsRequest) -> Response:
        if req.prompt is not None and not isinstance(req.prompt, str):
            raise invalid("'prompt' must be a string", param="prompt")
        model = self.requests.resolve(req.model, kind="embed")
        keep = parse_keep_alive(req.keep_alive)
        if not req.prompt:
            self.requests.keep(model, keep)
            return JSONResponse({"embedding": []})
        done = await self._embed(request, model, [req.prompt], True, None, "prompt")
        self.requests.keep(model, keep)
        body = {"embedding": _matrix(done.frame)[0].tolist()}
        return Response(dumps(body), media_type="application/json", headers=done.headers)


def _matrix(frame: Embeddings) -> np.ndarray[Any, Any]:
    import numpy as np  # NOTE: loaded by then (numpy_ready in _embed), a dict lookup

    return np.frombuffer(frame.data, dtype="<f4").reshape(frame.rows, frame.dims)


def shortened(frame: Embeddings, dims: int) -> Embeddings:
    """Each vector's first `dims` components, renormalised to unit length, as OpenAI and
    Ollama answer `dimensions`. NOTE: it keeps meaning only for models trained for it
    (Matryoshka: nomic-embed, OpenAI's text-embedding-3); for others it is a rough cut."""
    import numpy as np

    head = _matrix(frame)[:, :dims].astype(np.float64)
    norms = np.linalg.norm(head, axis=1, keepdims=True)
    head /= np.where(norms > 0.0, norms, 1.0)  # NOTE: an all-zero head stays zero
    return msgspec.structs.replace(frame, data=head.astype("<f4").tobytes(), dims=dims)
