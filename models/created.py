"""Models made by Ollama's /api/create: what the request said, kept as a small record.

A created model is either an overlay of another model (`base`: it runs that model's weights,
so the workers serving the base serve it too, without a reload) or a model with weights of
its own: a GGUF file the client uploaded first as a blob (`blob`). Either way it carries what
an Ollama Modelfile adds: SYSTEM, TEMPLATE, PARAMETER, MESSAGE and LICENSE lines. Creating
from a created model copies its record (its base or blob, its settings under the new ones),
so a record never points at another record and deleting one never breaks another. A blob
that is byte for byte the file of a model already served (`shares`: found by its digest at
creation) runs on that model's pipeline while that model is served, so alternating the two
names loads nothing; the blob stays its own, so the record outlives that model.

Pure data: where records live is models/store.py's (`created/<folder>.json`), applying their
settings to a request is the gateway's (gateway/content/created_model.py).
"""

from __future__ import annotations

import json
import time
from typing import Any

import msgspec

# The roles a MESSAGE line of a Modelfile may have.
MESSAGE_ROLES = ("system", "user", "assistant")


class CreatedMessage(msgspec.Struct):
    role: str
    content: str


class CreatedModel(msgspec.Struct, omit_defaults=True):
    name: str  # canonical: `[namespace/]name:tag`
    kind: str = "llm"
    # The canonical name of the model whose weights it runs ("" when it has its own).
    base: str = ""
    # Its own weights: "sha256:<hex>" of an uploaded GGUF blob ("" for an overlay).
    blob: str = ""
    file: str = ""  # the file name the client gave that blob
    # A served model whose file is that blob, byte for byte, when it was created ("" if none).
    shares: str = ""
    parent: str = ""  # what `from` named (Ollama's details.parent_model)
    system: str | None = None
    template: str | None = None
    # Ollama option name -> value, checked at creation (gateway/content/created_model.py).
    parameters: dict[str, Any] = {}
    messages: list[CreatedMessage] = []
    license: list[str] = []
    created_at: float = 0.0


def derive(name: str, *, parent: CreatedModel | None, kind: str = "llm", base: str = "",
           blob: str = "", file: str = "", shares: str = "", parent_name: str = "",
           system: str | None = None,
           template: str | None = None, parameters: dict[str, Any] | None = None,
           messages: list[CreatedMessage] | None = None,
           license: list[str] | None = None) -> CreatedModel:
    """The record of a new model. From a created `parent`, its weights and settings are
    inherited and the request's override them (parameters key by key, as Ollama merges)."""
    if parent is not None:
        kind, base, blob, file = parent.kind, parent.base, parent.blob, parent.file
        shares = parent.shares
        system = parent.system if system is None else system
        template = parent.template if template is None else template
        parameters = {**parent.parameters, **(parameters or {})}
        messages = parent.messages if messages is None else messages
        license = parent.license if license is None else license
    if bool(base) == bool(blob):
        raise ValueError("a created model runs either a base model or its own blob")
    return CreatedModel(name=name, kind=kind, base=base, blob=blob, file=file, shares=shares,
                        parent=parent_name,
                        system=system, template=template, parameters=dict(parameters or {}),
                        messages=list(messages or []), license=list(license or []),
                        created_at=time.time())


def _value(value: Any) -> str:
    """A parameter's value as Ollama prints it: strings quoted, numbers and booleans bare."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    return str(value)


def parameter_lines(parameters: dict[str, Any]) -> list[tuple[str, str]]:
    """(name, value) per line; a list (stop) gives one line per item."""
    lines = []
    for key, value in parameters.items():
        for item in value if isinstance(value, list) else [value]:
            lines.append((key, _value(item)))
    return lines


def _quoted(text: str) -> str:
    return f'"""{text}"""'


def modelfile(record: CreatedModel) -> str:
    """The Modelfile that makes this model again with `ollama create -f`."""
    source = record.base or record.name
    out = [f"# Modelfile of {record.name} (made by /api/create, served by npu-proxy)",
           f"FROM {source}"]
    if record.template is not None:
        out.append(f"TEMPLATE {_quoted(record.template)}")
    if record.system is not None:
        out.append(f"SYSTEM {_quoted(record.system)}")
    out += [f"PARAMETER {key} {value}" for key, value in parameter_lines(record.parameters)]
    out += [f"MESSAGE {m.role} {_quoted(m.content)}" for m in record.messages]
    out += [f"LICENSE {_quoted(text)}" for text in record.license]
    return "\n".join(out) + "\n"
