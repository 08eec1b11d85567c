"""Ollama's model management: POST /api/pull, DELETE /api/delete, POST /api/copy.

/api/pull resolves the name and lists the repository before answering, so an unknown or
unsafe name is a plain 404/400; then the download runs in a thread (models/pull/) and its
progress reaches the event loop through a queue, streamed as Ollama's NDJSON (`pulling
manifest`, per-file `digest`/`total`/`completed`, `verifying sha256 digest`, `writing
manifest`, `success`; a failure is a last `{"error": ...}` line) or, with `stream: false`,
answered once at the end. A client that goes away cancels the pull; the next pull resumes.

/api/copy makes an alias in the cache's alias store (no files copied); a later pull of that
name replaces it, as a pull replaces a copy in Ollama (models/store.py `install`).
/api/delete removes only the name given: a pulled model, a model made by /api/create
(gateway/admin/create.py) or an alias made by /api/copy, first switching a worker that runs it
back to its configured model. Built-in defaults, workers' configured models, aliases of the
config file (the message names the target), the base of a created model and a model that
copies point at cannot be deleted (400).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from npu_proxy.gateway.core.errors import GatewayError, invalid, model_not_found
from npu_proxy.gateway.core.router import Router
from npu_proxy.gateway.http.util import decode_body, dumps, unless_disconnected
from npu_proxy.models.pull.install import run_pull
from npu_proxy.models.pull.plan import Progress, PullError, PullPlan, plan_pull
from npu_proxy.models.registry import ModelNameError, canonical, embedded, normalize
from npu_proxy.models.upkeep import prune_blobs

log = logging.getLogger(__name__)

NDJSON = "application/x-ndjson"
T = TypeVar("T")


class PullRequest(msgspec.Struct):
    model: str = ""
    name: str = ""  # the legacy spelling
    stream: bool | None = None
    insecure: bool | None = None


class DeleteRequest(msgspec.Struct):
    model: str = ""
    name: str = ""


class CopyRequest(msgspec.Struct):
    source: str = ""
    destination: str = ""


def _error(status: int, message: str) -> Response:
    return JSONResponse({"error": message}, status_code=status)


def checked_name(name: str, param: str = "model") -> str:
    """The canonical form of a name a client gives, or a 400 (registry.canonical's check)."""
    try:
        return canonical(name)
    except ModelNameError as exc:
        raise invalid(str(exc), param=param) from exc


class ModelAdminRoutes:
    def __init__(self, router: Router) -> None:
        self.router = router
        self.config = router.config
        self._pulls: set[asyncio.Task[None]] = set()
        # NOTE: pulls (and pulls waiting on another's lock) hold a thread for as long as the
        # download takes: on the default executor they starved image decoding, model
        # switches and create/copy/delete. Their own pool bounds them; more wait their turn.
        self._pool = ThreadPoolExecutor(max(1, self.config.pull_threads),
                                        thread_name_prefix="pull")

    async def _on_pool(self, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def routes(self) -> list[Route]:
        return [
            Route("/api/pull", self.pull, methods=["POST"]),
            Route("/api/delete", self.delete, methods=["DELETE"]),
            Route("/api/copy", self.copy, methods=["POST"]),
        ]

    # --- pull ----------------------------------------------------------------------------

    async def pull(self, request: Request) -> Response:
        try:
            req = await decode_body(request, PullRequest)
            name = req.model or req.name
            if not name:
                raise invalid("model is required", param="model")
            # NOTE: planning is one metadata request with its own timeout: the default
            # executor; the download (and the wait for another pull's lock) is the pool's.
            plan = await asyncio.to_thread(plan_pull, self.config, name)
        except GatewayError as exc:
            return _error(exc.status, exc.message)
        except PullError as exc:
            return _error(exc.status, str(exc))
        queue: asyncio.Queue[Progress | PullError | None] = asyncio.Queue()
        cancel = threading.Event()
        task = asyncio.create_task(self._run(plan, queue, cancel))
        self._pulls.add(task)
        task.add_done_callback(self._pulls.discard)
        if req.stream is not False:
            return StreamingResponse(self._stream(queue, cancel), media_type=NDJSON)
        failure: PullError | None = None
        done = False
        try:
            failure = await unless_disconnected(request, self._outcome(queue))
            done = True
        except GatewayError:
            return Response(status_code=499)
        finally:
            if not done:
                # NOTE: the client left (or the request was cancelled): the download stops
                # at its next chunk, or before it starts; the next pull resumes.
                cancel.set()
                log.info("pull of %s: the client left; cancelled", plan.name)
        if failure is not None:
            return _error(failure.status, str(failure))
        return JSONResponse({"status": "success"})

    @staticmethod
    async def _outcome(queue: asyncio.Queue[Progress | PullError | None]) -> PullError | None:
        failure: PullError | None = None
        while (item := await queue.get()) is not None:
            if isinstance(item, PullError):
                failure = item
        return failure

    async def _run(self, plan: PullPlan, queue: asyncio.Queue[Progress | PullError | None],
                   cancel: threading.Event) -> None:
        loop = asyncio.get_running_loop()

        def emit(progress: Progress) -> None:
            # NOTE: called in the download thread; the queue belongs to the event loop.
            loop.call_soon_threadsafe(queue.put_nowait, progress)

        try:
            await self._on_pool(run_pull, self.config, plan, emit, cancel)
        except PullError as exc:
            log.warning("pull of %s failed: %s", plan.name, exc)
            queue.put_nowait(exc)
        except Exception as exc:
            log.exception("pull of %s failed", plan.name)
            queue.put_nowait(PullError(f"pull of {plan.name} failed: {exc}"))
        finally:
            queue.put_nowait(None)

    async def _stream(self, queue: asyncio.Queue[Progress | PullError | None],
                      cancel: threading.Event) -> AsyncIterator[bytes]:
        try:
            yield dumps(Progress(status="pulling manifest")) + b"\n"
            while (item := await queue.get()) is not None:
                if isinstance(item, PullError):
                    yield dumps({"error": str(item)}) + b"\n"
                else:
                    yield dumps(item) + b"\n"
        finally:
            cancel.set()  # NOTE: no-op once finished; stops the download if the client left

    # --- delete and copy -----------------------------------------------------------------

    async def delete(self, request: Request) -> Response:
        try:
            req = await decode_body(request, DeleteRequest)
            raw = req.model or req.name
            key = checked_name(raw)
            table = self.router.table
            target = table.aliases.get(key, key)
            if embedded(target) is not None:
                raise invalid(f"model '{raw}' is a built-in default model; it cannot be "
                              "deleted", param="model")
            if normalize(target) != key:
                # NOTE: a configured alias is only a name; deleting it once deleted its
                # target. Delete acts on the name given, and this one lives in the config.
                raise invalid(f"model '{raw}' is an alias of '{target}' in the config file; "
                              f"delete '{target}' by its own name, or remove the alias from "
                              "the config file", param="model")
            if await asyncio.to_thread(table.store.remove_alias, key):
                return Response(status_code=200)
            name = key
            created = table.store.created()
            if table.store.get(name) is None and name not in created:
                raise model_not_found(raw)
            workers = [s for s in self.config.workers if s.enabled]
            homes = [s.name for s in workers if table.default_model(s) == name]
            if homes:
                raise invalid(f"model '{raw}' is the configured model of worker "
                              f"{', '.join(homes)}; change the config file first",
                              param="model")
            users = sorted(r.name for r in created.values() if r.base == name)
            if users:
                raise invalid(f"model '{raw}' is the base of the created model(s) "
                              f"{', '.join(users)}; delete them first", param="model")
            copies = sorted(a for a, t in table.store.aliases().items() if t == name)
            if copies:
                # NOTE: in Ollama a copy outlives its source; here a copy is an alias, so
                # deleting the source would silently take the copies with it.
                raise invalid(f"model '{raw}' has the copies {', '.join(copies)} (made by "
                              "/api/copy); delete them first", param="model")
            for spec in workers:
                if table.current_model(spec) == name:
                    await self.router.switcher.load(spec.name, "")
            remove = table.store.remove_created if name in created else table.store.remove
            if not await asyncio.to_thread(remove, name):
                raise model_not_found(raw)
        except GatewayError as exc:
            return _error(exc.status, exc.message)
        log.info("deleted model %s", name)
        # NOTE: as Ollama prunes layers after a delete: blobs no model uses any more go too
        # (except recent uploads, whose /api/create may still come: models/upkeep.py).
        await asyncio.to_thread(prune_blobs, table.store)
        return Response(status_code=200)

    async def copy(self, request: Request) -> Response:
        try:
            req = await decode_body(request, CopyRequest)
            if not req.source or not req.destination:
                raise invalid("source and destination are required")
            dest = checked_name(req.destination, param="destination")
            source = self.router.resolve(req.source)
            if dest != source.name:
                table = self.router.table
                taken = self.router.models.get(dest)
                if taken is not None and dest not in table.store.aliases():
                    raise invalid(f"model '{req.destination}' already exists",
                                  param="destination")
                if normalize(table.aliases.get(dest, dest)) != dest:
                    raise invalid(f"model '{req.destination}' is an alias in the config file",
                                  param="destination")
                await asyncio.to_thread(table.store.add_alias, dest, source.name)
        except GatewayError as exc:
            return _error(exc.status, exc.message)
        return Response(status_code=200)
