"""Ollama's model creation: POST /api/create, HEAD and POST /api/blobs/sha256:<hex>.

`ollama create -f Modelfile` parses the Modelfile itself: `FROM <model>` becomes `from`,
`FROM ./model.gguf` an upload of the file as a blob (HEAD to see whether the server has it,
POST to send it) and then `files: {"model.gguf": "sha256:<hex>"}`; SYSTEM, TEMPLATE,
PARAMETER, MESSAGE and LICENSE become `system`, `template`, `parameters`, `messages` and
`license`. The ollama Python client sends the same fields (`create`, `create_blob`).

A created model is a small record in the model cache (models/created.py, models/store.py):
listed, shown, copied, deleted and switched to like any other, and its settings apply to
every request for it (gateway/content/created_model.py). Everything is checked before anything is
written, so a refusal is a plain 400/404 `{"error": ...}`; the answer is Ollama's progress
lines (`{"status": ...}`, the last `{"status": "success"}`) or, with `stream: false`, the
last one alone.

Decisions: only GGUF files are taken (one per model; safetensors would need a conversion
step this server does not run at request time); `quantize` and `adapters` are refused; a
name that is already a pulled, built-in, configured or copied model is refused (Ollama would
replace it; here it is someone else's files), while a created model may be created again.

A blob is checked while it streams in (models/blobs.py): at most `max_blob_bytes`, its
sha256 equal to the digest in its URL, written to a temporary file that is renamed into
place only then; no partial file stays behind. The body limit of other routes
(`max_body_bytes`) does not apply to blobs, which are never held in memory. Both an upload
and the copy of a blob made where the cache cannot hard-link it are held to
`max_cache_bytes` (a 413 and a 400).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import msgspec
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from npu_proxy.gateway.admin.manage import NDJSON, checked_name
from npu_proxy.gateway.content.created_model import check_parameters
from npu_proxy.gateway.core.errors import GatewayError, invalid
from npu_proxy.gateway.core.router import Router
from npu_proxy.gateway.http.util import decode_body, dumps
from npu_proxy.models.blobs import BlobError, BlobUpload, parse_digest
from npu_proxy.models.created import MESSAGE_ROLES, CreatedMessage, CreatedModel, derive
from npu_proxy.models.digests import DigestCache
from npu_proxy.models.gguf import ModelInfoError, read_gguf_header, unreadable
from npu_proxy.models.store import STAGING, safe_relative
from npu_proxy.models.upkeep import QuotaExceeded, check_room, room

log = logging.getLogger(__name__)

BLOBS_PREFIX = "/api/blobs/"
# Bytes of an upload gathered before they are hashed and written (in a thread).
FLUSH_BYTES = 1 << 20


class CreateMessage(msgspec.Struct):
    role: str
    content: str = ""


class CreateRequest(msgspec.Struct):
    model: str = ""
    name: str = ""  # the legacy spelling
    from_: str = msgspec.field(default="", name="from")
    files: dict[str, str] | None = None
    adapters: dict[str, str] | None = None
    template: str | None = None
    license: str | list[str] | None = None
    system: str | None = None
    parameters: dict[str, Any] | None = None
    messages: list[CreateMessage] | None = None
    quantize: str | None = None
    quantization: str | None = None  # the legacy spelling
    modelfile: str | None = None  # Ollama before 0.5.5: not read (see _missing_source)
    stream: bool | None = None


def _error(status: int, message: str) -> Response:
    return JSONResponse({"error": message}, status_code=status)


def _missing_source(req: CreateRequest) -> GatewayError:
    message = "neither 'from' or 'files' was specified"
    if req.modelfile:
        message += ("; the 'modelfile' field of Ollama before 0.5.5 is not read here: send "
                    "from, files, system, template, parameters, messages and license, as "
                    "ollama clients since 0.5.5 do")
    return invalid(message, param="from")


def _messages(req: CreateRequest) -> list[CreatedMessage] | None:
    if req.messages is None:
        return None
    for m in req.messages:
        if m.role not in MESSAGE_ROLES:
            raise invalid(f"unknown message role '{m.role}' (use system, user or assistant)",
                          param="messages")
    return [CreatedMessage(role=m.role, content=m.content) for m in req.messages]


def _licenses(value: str | list[str] | None) -> list[str] | None:
    if value is None:
        return None
    return [value] if isinstance(value, str) else list(value)


async def _drain(request: Request) -> None:
    """Read the rest of a body that is refused, keeping none of it (see limits.py's NOTE on
    answering a client that is still sending)."""
    try:
        async for _ in request.stream():
            pass
    except ClientDisconnect:
        pass


class CreateRoutes:
    def __init__(self, router: Router) -> None:
        self.router = router
        self.config = router.config
        self.store = router.table.store
        self.digests = DigestCache(self.store.root)

    def routes(self) -> list[Route]:
        return [
            Route("/api/create", self.create, methods=["POST"]),
            Route(BLOBS_PREFIX + "{digest}", self.blob_exists, methods=["HEAD"]),
            Route(BLOBS_PREFIX + "{digest}", self.blob_upload, methods=["POST"]),
        ]

    # --- create --------------------------------------------------------------------------

    async def create(self, request: Request) -> Response:
        try:
            req = await decode_body(request, CreateRequest)
            record, steps = await self._record(req)
            await asyncio.to_thread(self.store.add_created, record, self._room_for_copy)
        except GatewayError as exc:
            return _error(exc.status, exc.message)
        except QuotaExceeded as exc:
            return _error(400, str(exc))
        except BlobError as exc:
            return _error(exc.status, exc.message)
        except OSError as exc:
            log.exception("writing created model failed")
            return _error(500, f"cannot write the model into the model cache: {exc}")
        log.info("created model %s (%s)", record.name, record.base or record.blob)
        if req.stream is False:
            return JSONResponse({"status": "success"})
        lines = [*steps, "writing manifest", "success"]
        return Response(b"".join(dumps({"status": s}) + b"\n" for s in lines),
                        media_type=NDJSON)

    async def _record(self, req: CreateRequest) -> tuple[CreatedModel, list[str]]:
        """The record the request makes and the progress lines that say how; checks all."""
        raw = req.model or req.name
        if not raw:
            raise invalid("model is required", param="model")
        name = checked_name(raw)
        if req.quantize or req.quantization:
            raise invalid("quantize is not supported: models are served as their files are; "
                          "quantize the GGUF before uploading it, or pull a quantized model",
                          param="quantize")
        if req.adapters:
            raise invalid("adapters (LoRA) are not supported", param="adapters")
        if req.from_ and req.files:
            raise invalid("give either 'from' or 'files', not both", param="from")
        if not req.from_ and not req.files:
            raise _missing_source(req)
        self._check_free(raw, name)
        parameters = check_parameters(req.parameters) if req.parameters is not None else None
        fields: dict[str, Any] = {
            "parent_name": req.from_, "system": req.system, "template": req.template,
            "parameters": parameters, "messages": _messages(req),
            "license": _licenses(req.license)}
        steps = []
        if req.from_:
            source = self.router.resolve(req.from_)
            steps.append(f"using existing model {source.name}")
            record = derive(name, parent=source.created, kind=source.kind,
                            base="" if source.created is not None else source.name, **fields)
        else:
            file, digest = await asyncio.to_thread(self._gguf_blob, req.files or {})
            steps += ["parsing GGUF", f"using existing layer {digest}"]
            shares = await asyncio.to_thread(self._served_with, digest)
            if shares:
                steps.append(f"using the loaded weights of {shares}")
            record = derive(name, parent=None, blob=digest, file=file, shares=shares,
                            **fields)
        steps += [f"creating new layer {what}" for what in
                  ("template", "system", "parameters", "messages", "license")
                  if getattr(req, what) is not None]
        return record, steps

    def _room_for_copy(self, need: int) -> None:
        """A QuotaExceeded when the copy of a blob the cache cannot hard-link would not fit
        `max_cache_bytes` (runs in a thread)."""
        check_room(self.store.root, self.config.max_cache_bytes, need,
                   "copying the blob into the created model (hard links fail in this model "
                   "cache)")

    def _check_free(self, raw: str, name: str) -> None:
        """A created model may be made again; any other model of that name is not replaced."""
        if name in self.store.created():
            return
        try:
            taken = self.router.resolve(name)
        except GatewayError:
            return
        raise invalid(f"model '{raw}' already exists ({taken.name}) and was not made by "
                      "/api/create; delete it first or choose another name", param="model")

    def _served_with(self, digest: str) -> str:
        """A served model (not a created one) whose file is the blob `digest`, byte for byte,
        or "": the created model then runs on its pipeline (runs in a thread). Only files of
        the blob's size are hashed, once each (models/digests.py keeps the digests)."""
        size = self.store.blob_path(digest).stat().st_size
        for model in self.router.models.values():
            path = Path(model.path) if model.path else None
            if (model.created is not None or model.kind not in ("llm", "vlm") or path is None
                    or not path.is_file() or path.stat().st_size != size):
                continue
            if f"sha256:{self.digests.file_sha256(path)}" == digest:
                return model.name
        return ""

    def _gguf_blob(self, files: dict[str, str]) -> tuple[str, str]:
        """The one GGUF file of `files` and its digest, uploaded before (runs in a thread)."""
        if len(files) != 1:
            raise invalid(f"files names {len(files)} files; a model here is one GGUF file",
                          param="files")
        [(file, digest)] = files.items()
        if not safe_relative(file) or "/" in file:
            raise invalid(f"file name {file[:80]!r} must be a plain file name", param="files")
        if not file.lower().endswith(".gguf"):
            raise invalid(f"{file!r} is not a .gguf file; only GGUF models are supported",
                          param="files")
        hex_digest = parse_digest(digest)
        path = self.store.blob_path(digest)
        if not path.is_file():
            raise BlobError(400, f"blob sha256:{hex_digest} for {file!r} not found; upload it "
                                 f"first with POST /api/blobs/sha256:{hex_digest}")
        try:
            header = read_gguf_header(path)  # NOTE: the header only: a worker never loads garbage
        # NOTE: RecursionError and MemoryError too: whatever a hostile header makes of the
        # reader is the client's file at fault, never a 500.
        except (ModelInfoError, OSError, ValueError, RecursionError, MemoryError) as exc:
            raise BlobError(400, f"{file!r} (sha256:{hex_digest}) is not in GGUF format: "
                                 f"{str(exc).removeprefix(str(path) + ': ')}") from exc
        if why := unreadable(header):
            raise BlobError(400, f"{file!r} cannot be served here: {why}")
        return file, f"sha256:{hex_digest}"

    # --- blobs ---------------------------------------------------------------------------

    async def blob_exists(self, request: Request) -> Response:
        try:
            path = self.store.blob_path(request.path_params["digest"])
        except BlobError as exc:
            return _error(exc.status, exc.message)
        found = await asyncio.to_thread(path.is_file)
        return Response(status_code=200 if found else 404)

    async def blob_upload(self, request: Request) -> Response:
        digest = request.path_params["digest"]
        limit, setting = self.config.max_blob_bytes, "max_blob_bytes"
        try:
            hex_digest = parse_digest(digest)
            declared = request.headers.get("content-length")
            if declared is not None and declared.isdigit() and int(declared) > limit:
                raise BlobError(413, f"the blob is {declared} bytes; the limit is {limit} "
                                     "bytes (max_blob_bytes)")
            left = await asyncio.to_thread(room, self.store.root, self.config.max_cache_bytes)
            if left is not None and left < limit:
                limit, setting = left, "max_cache_bytes"
            if declared is not None and declared.isdigit() and int(declared) > limit:
                raise BlobError(413, f"the blob is {declared} bytes; the model cache has "
                                     f"{limit} bytes left under its quota (max_cache_bytes)")
        except BlobError as exc:
            await _drain(request)
            return _error(exc.status, exc.message)
        try:
            upload = await asyncio.to_thread(BlobUpload, self.store.blob_path(digest),
                                             self.store.root / STAGING, hex_digest, limit,
                                             setting)
        except OSError as exc:
            log.exception("blob upload failed")
            await _drain(request)
            return _error(500, f"cannot write the blob into the model cache: {exc}")
        received = False
        try:
            buffer = bytearray()
            async for chunk in request.stream():
                buffer += chunk
                if len(buffer) >= FLUSH_BYTES:
                    await asyncio.to_thread(upload.write, bytes(buffer))
                    buffer.clear()
            received = True
            await asyncio.to_thread(upload.write, bytes(buffer))
            await asyncio.to_thread(upload.commit)
        except BlobError as exc:
            upload.discard()
            if not received:
                await _drain(request)
            return _error(exc.status, exc.message)
        except ClientDisconnect:
            log.info("blob upload sha256:%s ended by the client after %d bytes", hex_digest,
                     upload.size)
            return Response(status_code=499)
        except OSError as exc:
            log.exception("blob upload failed")
            return _error(500, f"cannot write the blob into the model cache: {exc}")
        finally:
            upload.discard()  # NOTE: also on cancellation; a no-op once committed
        log.info("received blob sha256:%s (%d bytes)", hex_digest, upload.size)
        return Response(status_code=201)
