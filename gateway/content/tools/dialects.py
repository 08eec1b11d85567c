"""Each API's `tools` and `tool_choice` in the internal form (tools/definitions.py)."""

from __future__ import annotations

import dataclasses
import logging
import re
from typing import Any

from npu_proxy.gateway.content.ignored import Ignored
from npu_proxy.gateway.content.json_size import ToolBudget, measure
from npu_proxy.gateway.content.tools.anthropic_defined import defined_description, defined_schema
from npu_proxy.gateway.content.tools.definitions import CUSTOM_INPUT, Tool, ToolChoice
from npu_proxy.gateway.core.errors import invalid

log = logging.getLogger(__name__)

_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")


def _schema(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {"type": "object", "properties": {}}
    if not isinstance(value, dict):
        raise invalid(f"{where} must be a JSON schema object", param="tools")
    return value


# The characters of one tool's JSON besides its name, description and parameters.
_TOOL_OVERHEAD = 44


def _tool(name: Any, description: Any, parameters: Any, where: str, budget: ToolBudget) -> Tool:
    if not isinstance(name, str) or not _NAME.match(name):
        raise invalid(f"{where}.name must be a string of letters, digits, _ . : or -",
                      param="tools")
    if description is not None and not isinstance(description, str):
        raise invalid(f"{where}.description must be a string", param="tools")
    schema = _schema(parameters, f"{where}.parameters")
    chars = budget.charge(schema, f"{where}.parameters") + budget.charge(name, where) \
        + budget.charge(description or "", where)
    return Tool(name=name, description=description or "", parameters=schema,
                chars=chars + _TOOL_OVERHEAD)


def openai_tools(raw: list[dict[str, Any]] | None, budget: ToolBudget) -> list[Tool]:
    """OpenAI and Ollama: `[{"type": "function", "function": {name, description, parameters}}]`."""
    tools = []
    for i, item in enumerate(raw or []):
        kind = item.get("type", "function")
        fn = item.get("function")
        if kind != "function" or not isinstance(fn, dict):
            raise invalid(f"tools[{i}]: only tools of type 'function' with a 'function' object "
                          "are supported", param="tools")
        tools.append(_tool(fn.get("name"), fn.get("description"), fn.get("parameters"),
                           f"tools[{i}].function", budget))
    return tools


def anthropic_tools(raw: list[dict[str, Any]] | None, budget: ToolBudget,
                    ignored: Ignored | None = None,
                    loaded: frozenset[str] = frozenset()) -> list[Tool]:
    """Anthropic: `[{name, description, input_schema}]` (custom tools; `cache_control` and
    `strict` change nothing here). Anthropic-defined client tools (`bash_*`, `text_editor_*`,
    `memory_*`: a `type` and no input_schema) get their published schemas; server tools (web
    search, code execution, ...) cannot run here: left out and named in `ignored`.

    A `defer_loading` tool is offered to the model only once it is `loaded`: named by a
    `tool_reference` block of a tool result (what a tool search returns), as Anthropic's API
    does. NOTE: Claude Code sends a "DeferredToolPlaceholder" ("never call this tool") so;
    offered, Qwen2.5-Coder called it, turn after turn.
    """
    tools = []
    for i, item in enumerate(raw or []):
        if item.get("defer_loading") is True and item.get("name") not in loaded:
            continue
        kind = item.get("type")
        if kind not in (None, "custom") and "input_schema" not in item:
            schema = defined_schema(kind)
            if schema is None:
                log.debug("leaving out the server tool %s (%s)", item.get("name"), kind)
                if ignored is not None:
                    ignored.add(f"tools:{kind}")
                continue
            tools.append(_tool(item.get("name"), defined_description(kind), schema,
                               f"tools[{i}]", budget))
            continue
        tools.append(_tool(item.get("name"), item.get("description"), item.get("input_schema"),
                           f"tools[{i}]", budget))
    return tools


def _custom(item: dict[str, Any], where: str, namespace: str | None,
            ignored: Ignored | None, budget: ToolBudget) -> Tool:
    """A Responses `custom` tool: free text in, offered as one string argument. A grammar
    `format` is not enforced (the text is not constrained): named in `ignored`."""
    fmt = item.get("format")
    if isinstance(fmt, dict) and fmt.get("type") not in (None, "text") and ignored is not None:
        ignored.add("tools:custom.format")
    base = _tool(item.get("name"), item.get("description"), None, where, budget)
    params = {"type": "object", "properties": {CUSTOM_INPUT: {
        "type": "string", "description": "the tool's input, as free text"}},
        "required": [CUSTOM_INPUT]}
    return Tool(base.name, base.description, params, namespace, "custom",
                base.chars + measure(params, where))


def _responses_tool(item: Any, where: str, namespace: str | None,
                    ignored: Ignored | None, budget: ToolBudget) -> Tool | None:
    if not isinstance(item, dict):
        raise invalid(f"{where} must be an object", param="tools")
    kind = item.get("type")
    if kind == "function":
        tool = _tool(item.get("name"), item.get("description"), item.get("parameters"), where,
                     budget)
        return dataclasses.replace(tool, namespace=namespace)
    if kind == "custom":
        return _custom(item, where, namespace, ignored, budget)
    if not isinstance(kind, str):
        raise invalid(f"{where}.type must be a string", param="tools")
    # NOTE: hosted tools (web_search, file_search, code_interpreter, mcp, computer use,
    # image_generation, ...) run on OpenAI's servers: not offered, and said so (Codex sends
    # web_search with every request and does not depend on it).
    log.debug("leaving out the hosted tool type %s", kind)
    if ignored is not None:
        ignored.add(f"tools:{kind}")
    return None


def responses_tools(raw: list[Any] | None, budget: ToolBudget,
                    ignored: Ignored | None = None) -> list[Tool]:
    """OpenAI Responses: flat `{"type": "function", name, description, parameters, strict}`,
    `{"type": "custom", name, description, format}`, and `{"type": "namespace", name,
    description, tools: [function | custom]}` whose inner tools are offered by their own names
    (the namespace's description leads each one's) and whose calls name the namespace."""
    tools: list[Tool] = []
    for i, item in enumerate(raw or []):
        where = f"tools[{i}]"
        if isinstance(item, dict) and item.get("type") == "namespace":
            space = item.get("name")
            if not isinstance(space, str) or not _NAME.match(space):
                raise invalid(f"{where}.name must be a string of letters, digits, _ . : or -",
                              param="tools")
            inner = item.get("tools")
            if not isinstance(inner, list):
                raise invalid(f"{where}.tools must be a list of function or custom tools",
                              param="tools")
            about = item.get("description")
            for j, sub in enumerate(inner):
                tool = _responses_tool(sub, f"{where}.tools[{j}]", space, ignored, budget)
                if tool is None:
                    continue
                if isinstance(about, str) and about:
                    tool = dataclasses.replace(
                        tool, description=f"{about} {tool.description}".strip(),
                        chars=tool.chars + budget.charge(about, where) + 1)
                tools.append(tool)
            continue
        found = _responses_tool(item, where, None, ignored, budget)
        if found is not None:
            tools.append(found)
    return tools


def responses_choice(value: Any, has_tools: bool) -> ToolChoice:
    """`none` | `auto` | `required` | `{"type": "function", "name"}` (the flat form)."""
    if value is None:
        return ToolChoice("auto" if has_tools else "none")
    if value in ("none", "auto", "required"):
        return ToolChoice(value)
    if isinstance(value, dict) and value.get("type") in ("function", "custom") and \
            isinstance(value.get("name"), str):
        return ToolChoice("required", value["name"])
    raise invalid("tool_choice must be 'none', 'auto', 'required' or "
                  '{"type": "function"|"custom", "name": ...}; hosted tools are not supported',
                  param="tool_choice")


def openai_choice(value: Any, has_tools: bool) -> ToolChoice:
    """`none` | `auto` | `required` | `{"type": "function", "function": {"name"}}`."""
    if value is None:
        return ToolChoice("auto" if has_tools else "none")
    if value in ("none", "auto", "required"):
        return ToolChoice(value)
    if isinstance(value, dict) and value.get("type") == "function":
        name = (value.get("function") or {}).get("name") or value.get("name")
        if isinstance(name, str):
            return ToolChoice("required", name)
    raise invalid("tool_choice must be 'none', 'auto', 'required' or "
                  '{"type": "function", "function": {"name": ...}}', param="tool_choice")


def anthropic_choice(value: Any, has_tools: bool) -> tuple[ToolChoice, bool]:
    """`{"type": "auto"|"any"|"tool"|"none", "name", "disable_parallel_tool_use"}`; also
    returns whether parallel calls are allowed."""
    if value is None:
        return ToolChoice("auto" if has_tools else "none"), True
    if not isinstance(value, dict):
        raise invalid("tool_choice must be an object with a type", param="tool_choice")
    parallel = not value.get("disable_parallel_tool_use", False)
    kind = value.get("type")
    if kind in ("auto", "none"):
        return ToolChoice(kind), parallel
    if kind == "any":
        return ToolChoice("required"), parallel
    if kind == "tool" and isinstance(value.get("name"), str):
        return ToolChoice("required", value["name"]), parallel
    raise invalid("tool_choice.type must be auto, any, tool (with a name) or none",
                  param="tool_choice")


def ollama_choice(value: Any, has_tools: bool) -> ToolChoice:
    """The `options.tool_choice` extension: "auto" | "none" | "required" | a function name."""
    if value is None or value == "":
        return ToolChoice("auto" if has_tools else "none")
    if value in ("none", "auto", "required"):
        return ToolChoice(value)
    if isinstance(value, str):
        return ToolChoice("required", value)
    return openai_choice(value, has_tools)
