"""What the Ollama API says about the served models: the bodies of /api/tags, /api/show and
/api/ps, from the gateway's one catalog (gateway/core/catalog.py)."""

from __future__ import annotations

import hashlib
import time
from datetime import UTC, datetime
from typing import Any

import msgspec

from npu_proxy.gateway.api.request_path import ModelCatalog, ServedModel, display_name
from npu_proxy.models.created import CreatedModel, modelfile, parameter_lines
from npu_proxy.models.facts import ModelDetails
from npu_proxy.protocol.config import WorkerSpec


def iso(moment: datetime) -> str:
    return moment.isoformat().replace("+00:00", "Z")


# The current second's "YYYY-MM-DDTHH:MM:SS" (utc_now).
_second: list[tuple[int, str]] = [(-1, "")]


def utc_now() -> str:
    """Now, as `iso` writes it (microseconds, left out when 0, as isoformat does).

    NOTE: every streamed Ollama chunk carries one; datetime.now + isoformat cost ~9 us a
    chunk, a twentieth of the gateway's CPU per token (bench/gateway_cpu.py), so the
    second's text is made once a second."""
    seconds, micros = divmod(time.time_ns() // 1000, 1_000_000)
    second, head = _second[0]
    if second != seconds:
        head = datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%S")
        _second[0] = (seconds, head)
    return f"{head}.{micros:06d}Z" if micros else head + "Z"


async def tags(catalog: ModelCatalog) -> dict[str, Any]:
    models = []
    for model in catalog.models().values():
        found = await catalog.details(model)
        name = display_name(model)
        entry = {
            "name": name,
            "model": name,
            "modified_at": iso(_modified(found, catalog)),
            "size": await catalog.size(model, found),
            "digest": _digest(found),
            "details": _details(found),
            "capabilities": (await catalog.capabilities(model)).names,
        }
        if model.created is not None:
            entry.update(_created_tags(model.created, entry))
        models.append(entry)
    return {"models": models}


async def ps(catalog: ModelCatalog) -> dict[str, Any]:
    models = []
    for model in catalog.models().values():
        if not catalog.loaded(model):
            continue
        found = await catalog.details(model)
        name = display_name(model)
        models.append({
            "name": name,
            "model": name,
            "size": await catalog.size(model, found),
            "digest": _digest(found),
            "details": _details(found),
            "expires_at": iso(catalog.expires_at(model)),
            "size_vram": 0,
            "context_length": found.context_length if found else 0,
        })
    return {"models": models}

async def show(catalog: ModelCatalog, model: ServedModel) -> dict[str, Any]:
    found = await catalog.details(model)
    info: dict[str, object] = (dict(found.model_info) if found
                               else {"general.architecture": "unknown"})
    params: dict[str, object] = {}
    if found is not None and found.context_length and model.kind in ("llm", "vlm"):
        params["num_ctx"] = found.context_length
    # NOTE: the model's own defaults, under Ollama's option names, as its library's
    # Modelfiles list them.
    params |= {OLLAMA_OPTION.get(key, key): value
               for key, value in catalog.own_sampling(model).items()}
    template = await catalog.chat_template(model) if found else ""
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
        "capabilities": (await catalog.capabilities(model)).names,
        "modified_at": iso(_modified(found, catalog)),
    }
    speculative = [_speculative(catalog.worker_spec(w)) for w in model.workers]
    if any(speculative):
        body["speculative_decoding"] = [s for s in speculative if s]
    if model.created is not None:
        body.update(_created_show(model.created, body["details"]))
    return body


# SamplingParams fields whose Ollama option has another name.
OLLAMA_OPTION = {"repetition_penalty": "repeat_penalty", "max_tokens": "num_predict"}


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


def _modified(found: ModelDetails | None, catalog: ModelCatalog) -> datetime:
    if found is not None:
        return found.modified_at
    return datetime.fromtimestamp(catalog.started, UTC)


def _digest(found: ModelDetails | None) -> str:
    # NOTE: Ollama lists bare hex digests (no "sha256:" prefix) in /api/tags and /api/ps.
    return found.digest.removeprefix("sha256:") if found else ""


def _details(found: ModelDetails | None) -> dict[str, object]:
    if found is not None:
        return found.ollama_details()
    return {"parent_model": "", "format": "", "family": "", "families": [],
            "parameter_size": "", "quantization_level": ""}
