"""What the gateway knows of each served model, looked up once per model and kept: its details
(models/facts.py: the GGUF header or the IR folder's config.json, a sha256 digest of the
files), its context length, its chat template and so its capabilities.

Every API asks this one catalog (one for the whole gateway): the Ollama routes to describe
models (/api/tags, /api/show, /api/ps), every generation for the context length and the
capabilities it is held to (`require`). Files are read in a thread, so the event loop never
waits on hashing a model.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TypeVar

from npu_proxy.gateway.core.errors import invalid
from npu_proxy.gateway.core.model_table import ServedModel
from npu_proxy.gateway.core.router import Router
from npu_proxy.models.capabilities import WHAT, Capabilities, capabilities, fim_form
from npu_proxy.models.facts import (
    ModelDetails,
    ModelInfoError,
    chat_template,
    context_length,
    describe_model,
    special_tokens,
)
from npu_proxy.models.locate import configured_template, locate
from npu_proxy.models.registry import ModelSourceMissing, sampling_defaults, source_size
from npu_proxy.models.sampling import file_sampling
from npu_proxy.protocol.config import Config, WorkerSpec

log = logging.getLogger(__name__)
_T = TypeVar("_T")

# Kinds of model with no chat template: their capabilities come from the kind alone.
_TEMPLATELESS = ("embed", "rerank", "asr", "tts")
# Ollama stores "forever" as now + the largest Go duration (~292 years: a date in 2318).
FOREVER = timedelta(microseconds=(2**63 - 1) // 1000)


def require(caps: Capabilities, capability: str, requested: str, param: str) -> None:
    """A 400 unless the model has the capability: the same fact /api/show, /api/tags and
    /v1/models report (ModelCatalog.capabilities)."""
    if capability not in caps:
        raise invalid(f"model '{requested}' does not support {WHAT[capability]}", param=param)


@dataclass(frozen=True)
class ModelFacts:
    """What one request needs to know of its model, looked up once when the request is
    translated (RequestPath.facts) and handed to everything that decides on it: the dialect's
    translation, the thinking switch, the tool preparation."""

    model: ServedModel
    capabilities: Capabilities
    chat_template: str  # "" when unknown (an embedding model, files not readable yet)
    context_length: int  # 0 when unknown


def display_name(model: ServedModel) -> str:
    """`name:tag` as Ollama lists it; a model served under a bare name gets `:latest`."""
    last = model.name.rsplit("/", 1)[-1]
    return model.name if ":" in last else f"{model.name}:latest"


def _locate(config: Config, model: ServedModel) -> Path:
    if model.path:  # found by models/locate.py for the model table (gateway/core/model_table.py)
        return Path(model.path)
    if not model.workers:
        raise ModelSourceMissing(f"model {model.name!r} has no files here")
    # NOTE: a worker whose model is a local path serves it under the normalized name, which is
    # no longer that path; the worker's own model name still is.
    return locate(config, config.worker(model.workers[0]).model_name).path


def _describe(config: Config, model: ServedModel) -> ModelDetails:
    """Runs in a thread: locating a packaged model reads metadata, describing hashes files."""
    return describe_model(_locate(config, model), cache_dir=config.model_cache_path())


def _context_length(config: Config, model: ServedModel) -> int:
    """Runs in a thread: reads the GGUF header or config.json, hashes nothing."""
    return context_length(_locate(config, model))


def _file_sampling(config: Config, model: ServedModel) -> dict[str, float]:
    """Runs in a thread: reads generation_config.json (or only sees a GGUF), hashes nothing."""
    return file_sampling(_locate(config, model))


def _special_tokens(config: Config, model: ServedModel) -> set[str]:
    """Runs in a thread: reads the GGUF's token list or the folder's added tokens."""
    return special_tokens(_locate(config, model))


def _chat_template(config: Config, model: ServedModel) -> str:
    """Runs in a thread: reads the GGUF header or the tokenizer files, hashes nothing."""
    return chat_template(_locate(config, model))


class ModelCatalog:
    """Details of every served model, described once (one catalog for the whole gateway)."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self._details: dict[str, ModelDetails] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._contexts: dict[str, int] = {}
        self._templates: dict[str, str] = {}
        self._sampling: dict[str, dict[str, float]] = {}
        # NOTE: all kept by _key: the files, so a name made again over other files is new.
        self._capabilities: dict[tuple[str, str], Capabilities] = {}

    def models(self) -> dict[str, ServedModel]:
        """Every served model by name (gateway/core/model_table.py), for the listings."""
        return self.router.models

    @property
    def started(self) -> int:
        """When the gateway started (Unix seconds): the date of a model with no file date."""
        return self.router.started

    def worker_spec(self, worker: str) -> WorkerSpec:
        return self.router.config.worker(worker)

    def own_sampling(self, model: ServedModel) -> dict[str, float]:
        """The model's own sampling defaults (models/registry.py: an embedded model's, like an
        Ollama Modelfile's PARAMETER lines), by SamplingParams field."""
        return sampling_defaults(model.runs, self.router.config.model_aliases)

    async def file_sampling(self, model: ServedModel) -> dict[str, float]:
        """The sampling defaults the model's files set (models/sampling.py), by SamplingParams
        field; read once (in a thread) and kept. {} when the files cannot be read (yet)."""
        return await self._kept(self._sampling, model, _file_sampling, "sampling defaults", {})

    async def _kept(self, store: dict[str, _T], model: ServedModel,
                    read: Callable[[Config, ServedModel], _T], what: str, unknown: _T) -> _T:
        """`read` of the model's files (in a thread), once, kept in `store` by the files' key;
        `unknown` when they cannot be read (yet), not kept: files that appear later (the
        embedding IR its worker builds at first start) are read then."""
        key = _key(model)
        if (known := store.get(key)) is not None:
            return known
        try:
            found = await asyncio.to_thread(read, self.router.config, model)
        except (ModelInfoError, ModelSourceMissing, OSError, ValueError) as exc:
            log.debug("cannot read the %s of %s: %s", what, model.name, exc)
            return unknown
        store[key] = found
        return found

    async def size(self, model: ServedModel, found: ModelDetails | None) -> int:
        """Bytes of the model's files; of the package files it is built from while its
        worker has not built it yet (the embedding, rerank and Whisper IR)."""
        if found is not None:
            return found.size
        return await asyncio.to_thread(source_size, model.runs,
                                       self.router.config.model_aliases)

    async def details(self, model: ServedModel) -> ModelDetails | None:
        """The model's details, or None when its files cannot be read (yet)."""
        key = _key(model)
        if (hit := self._details.get(key)) is not None:
            return hit
        lock = self._locks.setdefault(key, asyncio.Lock())
        async with lock:
            if (hit := self._details.get(key)) is not None:
                return hit
            try:
                found = await asyncio.to_thread(_describe, self.router.config, model)
            except (ModelInfoError, ModelSourceMissing, OSError, ValueError) as exc:
                # NOTE: not cached, so a model whose folder appears later (the embedding IR is
                # built by its worker at first start) is described on the next request.
                log.warning("cannot describe model %s: %s", model.name, exc)
                return None
            self._details[key] = found
            return found

    async def context_length(self, model: ServedModel) -> int:
        """The model's context length in tokens; 0 when unknown.

        NOTE: asked on every generation (gateway/api/request_path.py), so it never waits for
        `details()`, which hashes the model's files the first time: the length alone is read
        once per model (in a thread) and kept, like the details, for the gateway's life.
        """
        if (found := self._details.get(_key(model))) is not None:
            return found.context_length
        return await self._kept(self._contexts, model, _context_length, "context length", 0)

    async def chat_template(self, model: ServedModel) -> str:
        """The model's chat template; "" when unknown. Like `context_length`, read alone (in a
        thread) and kept, since requests ask for it: it never waits for `details()`. A
        template set in the config (`[models."name"] chat_template`) comes first: the worker
        renders with it."""
        if configured := configured_template(self.router.config, model.runs):
            return configured
        if (found := self._details.get(_key(model))) is not None:
            return found.chat_template
        return await self._kept(self._templates, model, _chat_template, "chat template", "")

    async def facts(self, model: ServedModel) -> ModelFacts:
        """The model's facts for one request: its capabilities, template and context."""
        caps = await self.capabilities(model)
        template = "" if model.kind in _TEMPLATELESS else await self.chat_template(model)
        return ModelFacts(model, caps, template, await self.context_length(model))

    async def capabilities(self, model: ServedModel) -> Capabilities:
        """What the model can do here (models/capabilities.py): from its kind and its chat
        template. The one source of `capabilities` and of the 400s that refuse what a model
        cannot do (`require`). Derived once per model and kept, like the template it comes
        from: a chat asks for them several times (tools, thinking, images)."""
        key = (model.name, _key(model))
        if (known := self._capabilities.get(key)) is not None:
            return known
        if model.kind in _TEMPLATELESS:
            found = capabilities(model.kind, "")
        elif template := await self.chat_template(model):
            try:
                specials = (await asyncio.to_thread(_special_tokens, self.router.config, model)
                            if model.kind == "llm" else set())
            except (ModelInfoError, ModelSourceMissing, OSError, ValueError) as exc:
                log.debug("cannot read the special tokens of %s: %s", model.name, exc)
                return capabilities(model.kind, template)
            found = capabilities(model.kind, template, fim_form(specials))
        else:
            # NOTE: not kept: a template that cannot be read yet ("") may be read later.
            return capabilities(model.kind, "")
        self._capabilities[key] = found
        return found


    # --- keep_alive ----------------------------------------------------------------------

    def expires_at(self, model: ServedModel) -> datetime:
        when = self.router.switcher.expires_at(model.name)
        if math.isinf(when):
            return datetime.now(UTC) + FOREVER
        return datetime.fromtimestamp(when, UTC)

    def loaded(self, model: ServedModel) -> bool:
        links = self.router.broker.links
        return any(links[w].serving for w in model.workers if w in links)


def _key(model: ServedModel) -> str:
    """What details are kept by: the files (a created model and its base share them; a model
    deleted and made again under its name may not). A created model's own GGUF is always at
    the same path: the time it was made tells its files apart."""
    record = model.created
    if record is not None and record.blob:
        return f"{model.path}@{record.created_at}"
    return model.path or model.name
