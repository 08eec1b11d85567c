"""What the Ollama API says about the served models: /api/tags, /api/show and /api/ps.

The model files of each served model are described once (models/facts.py: the GGUF
header or the IR folder's config.json, a sha256 digest of the files) in a thread, so the
event loop never waits on hashing a model, and the result is kept for the gateway's life.

`keep_alive` is parsed here; the Switcher (gateway/core/switching.py) remembers it per model
with the time of the request, and /api/ps `expires_at` is computed from that (last use +
keep_alive, like Ollama). NOTE: a worker keeps its configured model loaded for its whole life;
only a model a worker was switched to is unloaded when its keep_alive runs out. A model not
used yet was loaded by its worker at start-up with no deadline, so it reports Ollama's
"forever" date.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import msgspec

from gateway.core.errors import invalid
from gateway.core.model_table import ServedModel
from gateway.core.router import Router
from models.capabilities import WHAT, Capabilities, capabilities
from models.created import CreatedModel, modelfile, parameter_lines
from models.facts import (
    ModelDetails,
    ModelInfoError,
    chat_template,
    context_length,
    describe_model,
)
from models.locate import configured_template, locate
from models.registry import ModelSourceMissing
from protocol.config import Config, WorkerSpec

log = logging.getLogger(__name__)

DEFAULT_KEEP_ALIVE = 300.0  # Ollama's default: five minutes
# Ollama stores "forever" as now + the largest Go duration (~292 years: a date in 2318).
FOREVER = timedelta(microseconds=(2**63 - 1) // 1000)

_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0,
                 "m": 60.0, "h": 3600.0}


def parse_keep_alive(value: float | str | None) -> float:
    """Seconds to keep a model loaded: `math.inf` for forever, 0 to unload.

    A number is seconds; a string is a Go duration ("5m", "1h30m", "-1s") or a plain number;
    anything negative means forever; absent means the five-minute default.
    """
    if value is None:
        return DEFAULT_KEEP_ALIVE
    if isinstance(value, str):
        text = value.strip()
        try:
            seconds = float(text)
        except ValueError:
            sign = -1.0 if text.startswith("-") else 1.0
            body = text.lstrip("+-")
            parts = _DURATION_PART.findall(body)
            if not body or "".join(n + u for n, u in parts) != body:
                raise invalid(f"keep_alive: invalid duration {value!r} (use e.g. 300, \"5m\","
                              " \"1h30m\" or -1)", param="keep_alive") from None
            seconds = sign * sum(float(n) * _UNIT_SECONDS[u] for n, u in parts)
    else:
        seconds = float(value)
    if math.isnan(seconds):
        raise invalid("keep_alive: not a number", param="keep_alive")
    return math.inf if seconds < 0 else seconds


def require(caps: Capabilities, capability: str, requested: str, param: str) -> None:
    """A 400 unless the model has the capability: the same fact /api/show, /api/tags and
    /v1/models report (ModelCatalog.capabilities)."""
    if capability not in caps:
        raise invalid(f"model '{requested}' does not support {WHAT[capability]}", param=param)


def iso(moment: datetime) -> str:
    return moment.isoformat().replace("+00:00", "Z")


def utc_now() -> str:
    return iso(datetime.now(UTC))


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

        NOTE: asked on every generation (gateway/api/flow.py), so it never waits for
        `details()`, which hashes the model's files the first time: the length alone is read
        once per model (in a thread) and kept, like the details, for the gateway's life.
        """
        if (found := self._details.get(_key(model))) is not None:
            return found.context_length
        if (known := self._contexts.get(_key(model))) is not None:
            return known
        try:
            length = await asyncio.to_thread(_context_length, self.router.config, model)
        except (ModelInfoError, ModelSourceMissing, OSError, ValueError) as exc:
            # NOTE: not kept, like details(): files that appear later are read then.
            log.debug("cannot read the context length of %s: %s", model.name, exc)
            return 0
        self._contexts[_key(model)] = length
        return length

    async def chat_template(self, model: ServedModel) -> str:
        """The model's chat template; "" when unknown. Like `context_length`, read alone (in a
        thread) and kept, since requests ask for it: it never waits for `details()`. A
        template set in the config (`[models."name"] chat_template`) comes first: the worker
        renders with it."""
        if configured := configured_template(self.router.config, model.runs):
            return configured
        if (found := self._details.get(model.name)) is not None:
            return found.chat_template
        if (known := self._templates.get(model.name)) is not None:
            return known
        try:
            template = await asyncio.to_thread(_chat_template, self.router.config, model)
        except (ModelInfoError, ModelSourceMissing, OSError, ValueError) as exc:
            # NOTE: not kept, like details(): files that appear later are read then.
            log.debug("cannot read the chat template of %s: %s", model.name, exc)
            return ""
        self._templates[model.name] = template
        return template

    async def capabilities(self, model: ServedModel) -> Capabilities:
        """What the model can do here (models/capabilities.py): from its kind and its chat
        template. The one source of `capabilities` and of the 400s that refuse what a model
        cannot do (`require`)."""
        if model.kind in ("embed", "rerank"):
            return capabilities(model.kind, "")
        return capabilities(model.kind, await self.chat_template(model))


    # --- keep_alive ----------------------------------------------------------------------

    def expires_at(self, model: ServedModel) -> datetime:
        when = self.router.switcher.expires_at(model.name)
        if math.isinf(when):
            return datetime.now(UTC) + FOREVER
        return datetime.fromtimestamp(when, UTC)

    # --- response bodies -----------------------------------------------------------------

    def _loaded(self, model: ServedModel) -> bool:
        links = self.router.broker.links
        return any(links[w].serving for w in model.workers if w in links)

    async def tags(self) -> dict[str, Any]:
        models = []
        for model in self.router.models.values():
            found = await self.details(model)
            name = display_name(model)
            entry = {
                "name": name,
                "model": name,
                "modified_at": iso(_modified(found, self.router)),
                "size": found.size if found else 0,
                "digest": _digest(found),
                "details": _details(found),
                "capabilities": (await self.capabilities(model)).names,
            }
            if model.created is not None:
                entry.update(_created_tags(model.created, entry))
            models.append(entry)
        return {"models": models}

    async def ps(self) -> dict[str, Any]:
        models = []
        for model in self.router.models.values():
            if not self._loaded(model):
                continue
            found = await self.details(model)
            name = display_name(model)
            models.append({
                "name": name,
                "model": name,
                "size": found.size if found else 0,
                "digest": _digest(found),
                "details": _details(found),
                "expires_at": iso(self.expires_at(model)),
                "size_vram": 0,
                "context_length": found.context_length if found else 0,
            })
        return {"models": models}

    async def show(self, model: ServedModel) -> dict[str, Any]:
        found = await self.details(model)
        info: dict[str, object] = (dict(found.model_info) if found
                                   else {"general.architecture": "unknown"})
        params: dict[str, object] = {}
        if found is not None and found.context_length and model.kind in ("llm", "vlm"):
            params["num_ctx"] = found.context_length
        template = await self.chat_template(model) if found else ""
        modelfile = f"# Modelfile of {display_name(model)} (served by npu-proxy)\n" + "".join(
            f"PARAMETER {key} {value}\n" for key, value in params.items())
        license_ = info.get("general.license")
        body: dict[str, Any] = {
            "license": license_ if isinstance(license_, str) else "",
            "modelfile": modelfile,
            # NOTE: Ollama's layout: the key padded to 30 columns, one parameter a line.
            "parameters": "\n".join(f"{key:<30} {value}" for key, value in params.items()),
            "template": template,
            "details": _details(found),
            "model_info": info,
            "capabilities": (await self.capabilities(model)).names,
            "modified_at": iso(_modified(found, self.router)),
        }
        speculative = [_speculative(self.router.config.worker(w)) for w in model.workers]
        if any(speculative):
            body["speculative_decoding"] = [s for s in speculative if s]
        if model.created is not None:
            body.update(_created_show(model.created, body["details"]))
        return body


def _speculative(spec: WorkerSpec) -> dict[str, Any]:
    """How a worker decodes speculatively (npu-proxy's own field of /api/show), or {}."""
    if spec.prompt_lookup:
        return {"worker": spec.name, "method": "prompt_lookup", "tokens": spec.prompt_lookup,
                "max_ngram": spec.prompt_lookup_ngram}
    if spec.draft_model:
        rule: dict[str, Any] = ({"confidence": spec.draft_confidence}
                                if spec.draft_confidence > 0 else {"tokens": spec.draft_tokens})
        return {"worker": spec.name, "method": "draft_model", "draft_model": spec.draft_model,
                "draft_device": spec.draft_device or spec.device, **rule}
    return {}


def _key(model: ServedModel) -> str:
    """What details are kept by: the files (a created model and its base share them; a model
    deleted and made again under its name may not). A created model's own GGUF is always at
    the same path: the time it was made tells its files apart."""
    record = model.created
    if record is not None and record.blob:
        return f"{model.path}@{record.created_at}"
    return model.path or model.name


def _created_show(record: CreatedModel, details: dict[str, Any]) -> dict[str, Any]:
    """What /api/show says of a model made by /api/create, over what its files say."""
    body: dict[str, Any] = {"modelfile": modelfile(record),
                            "details": dict(details, parent_model=record.parent),
                            "modified_at": iso(datetime.fromtimestamp(record.created_at, UTC))}
    if record.parameters:
        body["parameters"] = "\n".join(
            f"{key:<30} {value}" for key, value in parameter_lines(record.parameters))
    if record.template is not None:
        body["template"] = record.template
    if record.system is not None:
        body["system"] = record.system
    if record.license:
        body["license"] = "\n".join(record.license)
    if record.messages:
        body["messages"] = [{"role": m.role, "content": m.content} for m in record.messages]
    return body


def _created_tags(record: CreatedModel, entry: dict[str, Any]) -> dict[str, Any]:
    """A created model's own digest (of its record, as Ollama's is of its manifest), time and
    parent, over its files' details."""
    details = dict(entry["details"], parent_model=record.parent)
    digest = hashlib.sha256(msgspec.json.encode(record)).hexdigest()
    return {"digest": digest, "details": details,
            "modified_at": iso(datetime.fromtimestamp(record.created_at, UTC))}


def _modified(found: ModelDetails | None, router: Router) -> datetime:
    if found is not None:
        return found.modified_at
    return datetime.fromtimestamp(router.started, UTC)


def _digest(found: ModelDetails | None) -> str:
    # NOTE: Ollama lists bare hex digests (no "sha256:" prefix) in /api/tags and /api/ps.
    return found.digest.removeprefix("sha256:") if found else ""


def _details(found: ModelDetails | None) -> dict[str, object]:
    if found is not None:
        return found.ollama_details()
    return {"parent_model": "", "format": "", "family": "", "families": [],
            "parameter_size": "", "quantization_level": ""}
