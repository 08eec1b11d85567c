"""The JSON schema of a tool call: the whole output of a forced call (tool_choice required,
any or a named function), or what follows a call marker under tool_choice auto, so even a
small model returns a call whose arguments validate."""

from __future__ import annotations

import json
from typing import Any

from npu_proxy.gateway.content.tools.definitions import MAX_PARALLEL, Tool, ToolRequest

# Moved to the root (the definitions) or left out (`$schema`) of a tool's parameters.
_MOVED = ("$defs", "definitions", "$schema")


def _rewrite_refs(node: Any, prefix: str) -> Any:
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                for root in ("#/$defs/", "#/definitions/"):
                    if value.startswith(root):
                        value = "#/$defs/" + prefix + value[len(root):]
                out[key] = value
            else:
                out[key] = _rewrite_refs(value, prefix)
        return out
    if isinstance(node, list):
        return [_rewrite_refs(v, prefix) for v in node]
    return node


def _one_call(req: ToolRequest) -> tuple[dict[str, Any], dict[str, Any]]:
    """The schema of one call to any offered tool (`{"name": const, "arguments": <its
    parameters>}`, `anyOf` over the tools), and the definitions it refers to.

    NOTE: each tool's `$defs`/`definitions` move to the root (renamed per tool), because its
    parameters schema is nested under `arguments` and its `#/$defs/...` refs must still resolve.
    """
    defs: dict[str, Any] = {}
    variants = []
    for i, tool in enumerate(req.offered):
        prefix = f"t{i}_"
        # NOTE: the client's schema is read, never copied (a deep copy of every tool ran on
        # the event loop for each forced call): only a tool with definitions of its own is
        # rebuilt, to move them to the root; its size is already within max_prompt_chars.
        params = tool.parameters
        if any(key in params for key in _MOVED):
            params = {k: v for k, v in params.items() if k not in _MOVED}
        own = [tool.parameters.get(key) for key in ("$defs", "definitions")]
        if any(isinstance(found, dict) and found for found in own):
            for found in own:
                for name, sub in (found if isinstance(found, dict) else {}).items():
                    defs[prefix + name] = _rewrite_refs(sub, prefix)
            params = _rewrite_refs(params, prefix)
        variants.append({
            "type": "object",
            "properties": {"name": {"const": tool.name}, "arguments": params},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        })
    return (variants[0] if len(variants) == 1 else {"anyOf": variants}), defs


def _dumps(schema: dict[str, Any], defs: dict[str, Any]) -> str:
    if defs:
        schema["$defs"] = defs
    return json.dumps(schema, ensure_ascii=False)


def call_schema(req: ToolRequest) -> str | None:
    """The JSON schema a forced call must satisfy, or None when nothing is forced."""
    if not req.forced:
        return None
    one, defs = _one_call(req)
    schema: dict[str, Any]
    if req.parallel and not req.named:
        schema = {"type": "array", "items": one, "minItems": 1, "maxItems": MAX_PARALLEL}
    else:
        schema = dict(one)
    return _dumps(schema, defs)


def tool_parameters(tool: Tool) -> str:
    """The JSON schema of one tool's arguments alone, with its own definitions (a call written
    as bare JSON: the tag's begin names the tool)."""
    params = {k: v for k, v in tool.parameters.items() if k != "$schema"}
    return json.dumps(params, ensure_ascii=False)


def auto_call_schema(req: ToolRequest) -> str | None:
    """Under tool_choice auto: the JSON schema of one call, which the model's output must
    satisfy between its template's call markers once it has begun a call (the worker's
    structural tag, `SamplingParams.tool_tags`), or None when no tool is offered."""
    if req.choice.mode != "auto" or not req.offered:
        return None
    one, defs = _one_call(req)
    return _dumps(dict(one), defs)
