"""Tool calling for every API, in one place: definitions, prompting, forcing and parsing.

Each dialect turns its wire format into the internal form here (`Tool`, `ToolChoice`,
`ToolCall`) and back; what happens in between is the same for OpenAI, Ollama and Anthropic.

How tools reach the model:
- A chat template that knows tools (its Jinja source mentions `tools`, e.g. Qwen2.5, Llama 3.x)
  gets them natively: `Generate.tools` in the Hugging Face format and assistant `tool_calls` /
  `tool` messages passed through to `apply_chat_template`.
- Otherwise (SmolLM2's template has no tools slot) the fallback prompt: a `# Tools` section
  appended to the system message lists each tool as `{"name", "description", "parameters"}`
  JSON inside `<tools></tools>` and asks for a call as one JSON object
  `{"name": ..., "arguments": {...}}` inside `<tool_call></tool_call>` tags (the Hermes/Qwen
  convention small models have seen most). Earlier calls in the history are written back the
  same way, and tool results become a user turn of `<tool_response>` JSON blocks (tool roles
  are unknown to such templates).

tool_choice:
- `none`: tools are not offered and the output is not parsed (history still rendered).
- `auto`: tools are offered and the output is parsed: if it is a call, it is a call, else text.
- `required` (OpenAI) / `any` (Anthropic) / a named function: generation is constrained
  (structured output, `SamplingParams.json_schema`) to `{"name": const, "arguments": <that
  tool's parameters schema>}` (`anyOf` over the tools; with parallel calls allowed and no
  named function, a JSON array of them), so even a 135M model returns a call whose arguments
  validate. A call cut short by max_tokens is not a call: the text comes back, finish `length`.
- Ollama has no tool_choice: tools given means `auto`; the extension option
  `options.tool_choice` ("auto", "none", "required" or a function name) forces a call the same
  way (real Ollama ignores unknown options, so clients may send it to either server).

Parsing (`CallParser`, the project's own; OpenVINO GenAI's parsers run inside the worker and
are bound to one model family each): the output is a call when, after leading whitespace, it
is JSON (bare, in a code fence, or after Mistral's `[TOOL_CALLS]`) or when a `<tool_call>` tag
appears anywhere; the JSON may be one object, several, or an array, each
`{"name", "arguments"|"parameters"}` (also OpenAI-style `{"function": {...}}`, arguments as an
object or a JSON string) naming an offered tool. Anything else is text. Streaming and
non-streaming responses use the same parser, so they agree.
"""

from __future__ import annotations

import copy
import json
import logging
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from npu_proxy.gateway.content.json_size import measure
from npu_proxy.gateway.core.catalog import ModelCatalog
from npu_proxy.gateway.core.errors import invalid
from npu_proxy.gateway.core.ids import new_id
from npu_proxy.gateway.core.model_table import ServedModel
from npu_proxy.protocol.messages import ChatMessage, SamplingParams

log = logging.getLogger(__name__)

Mode = Literal["none", "auto", "required"]

TAG_OPEN = "<tool_call>"
TAG_CLOSE = "</tool_call>"
_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")
_FENCE_INFO = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-")
_TAGGED = re.compile(re.escape(TAG_OPEN) + r"(.*?)(?:" + re.escape(TAG_CLOSE) + r"|$)", re.S)
# NOTE: bounds a forced list of parallel calls, so a looping small model still ends in JSON.
MAX_PARALLEL = 8
# The characters of one tool's JSON besides its name, description and parameters.
_TOOL_OVERHEAD = 44


# --- the internal form -------------------------------------------------------------------


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]
    # An upper bound of the characters its definition adds to the prompt (json_size.py).
    chars: int = field(default=0, compare=False)

    def as_json(self) -> dict[str, Any]:
        return {"name": self.name, "description": self.description,
                "parameters": self.parameters}

    def as_openai(self) -> dict[str, Any]:
        """The Hugging Face chat-template form (the same as OpenAI's)."""
        return {"type": "function", "function": self.as_json()}


@dataclass(frozen=True)
class ToolChoice:
    mode: Mode = "auto"
    name: str | None = None  # a forced function (mode "required")


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=lambda: new_id("call_"))

    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


@dataclass
class ToolRequest:
    """What one request asks for: the tools, the choice, whether several calls may come."""

    tools: list[Tool]
    choice: ToolChoice = ToolChoice()
    parallel: bool = True

    def __post_init__(self) -> None:
        names = {t.name for t in self.tools}
        if len(names) != len(self.tools):
            raise invalid("tool names must be unique", param="tools")
        if self.choice.name is not None and self.choice.name not in names:
            raise invalid(f"tool_choice names '{self.choice.name}', which is not in tools",
                          param="tool_choice")
        if self.choice.mode == "required" and not self.tools:
            raise invalid("tool_choice requires a call but no tools were given",
                          param="tool_choice")

    @property
    def offered(self) -> list[Tool]:
        """The tools the model sees: none for `none`, only the named one when forced."""
        if self.choice.mode == "none":
            return []
        if self.choice.name is not None:
            return [t for t in self.tools if t.name == self.choice.name]
        return self.tools

    @property
    def forced(self) -> bool:
        return self.choice.mode == "required" and bool(self.tools)

    @property
    def named(self) -> bool:
        return self.choice.name is not None

    def parser(self) -> CallParser | None:
        return CallParser(self.offered) if self.offered else None


def _schema(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {"type": "object", "properties": {}}
    if not isinstance(value, dict):
        raise invalid(f"{where} must be a JSON schema object", param="tools")
    return value


def _tool(name: Any, description: Any, parameters: Any, where: str) -> Tool:
    if not isinstance(name, str) or not _NAME.match(name):
        raise invalid(f"{where}.name must be a string of letters, digits, _ . : or -",
                      param="tools")
    if description is not None and not isinstance(description, str):
        raise invalid(f"{where}.description must be a string", param="tools")
    schema = _schema(parameters, f"{where}.parameters")
    chars = measure(schema, f"{where}.parameters") + measure(name, where) \
        + measure(description or "", where)
    return Tool(name=name, description=description or "", parameters=schema,
                chars=chars + _TOOL_OVERHEAD)


def openai_tools(raw: list[dict[str, Any]] | None) -> list[Tool]:
    """OpenAI and Ollama: `[{"type": "function", "function": {name, description, parameters}}]`."""
    tools = []
    for i, item in enumerate(raw or []):
        kind = item.get("type", "function")
        fn = item.get("function")
        if kind != "function" or not isinstance(fn, dict):
            raise invalid(f"tools[{i}]: only tools of type 'function' with a 'function' object "
                          "are supported", param="tools")
        tools.append(_tool(fn.get("name"), fn.get("description"), fn.get("parameters"),
                           f"tools[{i}].function"))
    return tools


def anthropic_tools(raw: list[dict[str, Any]] | None) -> list[Tool]:
    """Anthropic: `[{name, description, input_schema}]`; server tools (web search, code
    execution: a `type` and no input_schema) cannot run here and are left out."""
    tools = []
    for i, item in enumerate(raw or []):
        if item.get("type") not in (None, "custom") and "input_schema" not in item:
            log.debug("leaving out the server tool %s (%s)", item.get("name"), item.get("type"))
            continue
        tools.append(_tool(item.get("name"), item.get("description"), item.get("input_schema"),
                           f"tools[{i}]"))
    return tools


def responses_tools(raw: list[Any] | None) -> list[Tool]:
    """OpenAI Responses: flat `[{"type": "function", name, description, parameters, strict}]`.
    Hosted tools (web_search, file_search, computer_use, mcp, ...) run on OpenAI's servers
    only: a 400 that names the type, since a request counting on them cannot be answered."""
    tools = []
    for i, item in enumerate(raw or []):
        if not isinstance(item, dict):
            raise invalid(f"tools[{i}] must be an object", param="tools")
        kind = item.get("type")
        if kind != "function":
            raise invalid(f"tools[{i}]: tool type {kind!r} is not supported by this server; "
                          "only tools of type 'function' are", param="tools")
        tools.append(_tool(item.get("name"), item.get("description"), item.get("parameters"),
                           f"tools[{i}]"))
    return tools


def responses_choice(value: Any, has_tools: bool) -> ToolChoice:
    """`none` | `auto` | `required` | `{"type": "function", "name"}` (the flat form)."""
    if value is None:
        return ToolChoice("auto" if has_tools else "none")
    if value in ("none", "auto", "required"):
        return ToolChoice(value)
    if isinstance(value, dict) and value.get("type") == "function" and \
            isinstance(value.get("name"), str):
        return ToolChoice("required", value["name"])
    raise invalid("tool_choice must be 'none', 'auto', 'required' or "
                  '{"type": "function", "name": ...}; hosted tools are not supported',
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


def loads_arguments(value: Any) -> dict[str, Any] | str:
    """Arguments sent back in a history: an object, or a JSON string of one (kept as the raw
    string when it is not JSON, so nothing the client sent is lost)."""
    if isinstance(value, dict):
        return value
    if isinstance(value, str):
        try:
            decoded = json.loads(value) if value.strip() else {}
        except (json.JSONDecodeError, RecursionError):
            return value
        if isinstance(decoded, dict):
            return decoded
        return value
    return {} if value is None else str(value)


def history_call(call_id: str | None, name: str, arguments: Any) -> dict[str, Any]:
    """One earlier call in a history, as ChatMessage.tool_calls holds it."""
    return {"id": call_id or new_id("call_"), "type": "function",
            "function": {"name": name, "arguments": loads_arguments(arguments)}}


# --- prompting ---------------------------------------------------------------------------


def _call_text(name: str, arguments: Any) -> str:
    return TAG_OPEN + "\n" + json.dumps({"name": name, "arguments": arguments},
                                        ensure_ascii=False) + "\n" + TAG_CLOSE


def _section(req: ToolRequest) -> str:
    listed = "\n".join(json.dumps(t.as_json(), ensure_ascii=False) for t in req.offered)
    lines = [
        "# Tools",
        "",
        "You may call functions to help with the user's request. Each function is described "
        "by a JSON schema:",
        "<tools>", listed, "</tools>", "",
    ]
    if req.named:
        lines.append(f'You must call the function "{req.choice.name}" now. Reply with only a '
                     f'JSON object: {{"name": "{req.choice.name}", "arguments": {{...}}}} '
                     "with the arguments its schema asks for.")
    elif req.forced and req.parallel:
        lines.append('You must call a function now. Reply with only a JSON array of calls, '
                     'each {"name": <function name>, "arguments": {...}}.')
    elif req.forced:
        lines.append('You must call a function now. Reply with only a JSON object: '
                     '{"name": <function name>, "arguments": {...}}.')
    else:
        lines += [
            "To call a function, reply with only a JSON object with the function name and its "
            "arguments, inside <tool_call></tool_call> tags:",
            _call_text("<function name>", {"<argument>": "<value>"}),
            "If no function is needed, answer in plain text.",
        ]
    return "\n".join(lines)


def _fallback_history(messages: list[ChatMessage]) -> list[ChatMessage]:
    """Calls and results written as text, for templates that know neither."""
    out: list[ChatMessage] = []
    names: dict[str, str] = {}
    merging = False  # the last message out is a user turn of tool responses
    for m in messages:
        if m.role == "assistant" and m.tool_calls:
            parts = [m.content] if m.content else []
            for call in m.tool_calls:
                fn = call.get("function") or {}
                name = str(fn.get("name", ""))
                if call.get("id"):
                    names[str(call["id"])] = name
                parts.append(_call_text(name, fn.get("arguments", {})))
            out.append(ChatMessage(role="assistant", content="\n".join(parts)))
            merging = False
        elif m.role in ("tool", "function"):
            name = m.name or names.get(m.tool_call_id or "", "")
            block = "<tool_response>\n" + json.dumps({"name": name, "content": m.content},
                                                     ensure_ascii=False) + "\n</tool_response>"
            if merging:
                out[-1] = ChatMessage(role="user", content=out[-1].content + "\n" + block)
            else:
                out.append(ChatMessage(role="user", content=block))
            merging = True
        else:
            out.append(ChatMessage(role=m.role, content=m.content, name=m.name, images=m.images))
            merging = False
    return out


def _named_results(messages: list[ChatMessage]) -> list[ChatMessage]:
    """Tool results carry the called function's name (templates print it), found by the id of
    the call they answer when the client did not send it."""
    names: dict[str, str] = {}
    out = []
    for m in messages:
        for call in m.tool_calls or []:
            names[str(call.get("id"))] = str((call.get("function") or {}).get("name", ""))
        if m.role == "tool" and not m.name and m.tool_call_id in names:
            m = ChatMessage(role="tool", content=m.content, tool_call_id=m.tool_call_id,
                            name=names[m.tool_call_id])
        out.append(m)
    return out


def _with_system(messages: list[ChatMessage], section: str) -> list[ChatMessage]:
    if messages and messages[0].role == "system":
        first = messages[0]
        text = f"{first.content}\n\n{section}" if first.content else section
        return [ChatMessage(role="system", content=text, images=first.images), *messages[1:]]
    return [ChatMessage(role="system", content=section), *messages]


def _has_tool_history(messages: list[ChatMessage]) -> bool:
    return any(m.tool_calls or m.role in ("tool", "function") for m in messages)


def prepare(messages: list[ChatMessage], req: ToolRequest | None,
            native: bool) -> tuple[list[ChatMessage], list[dict[str, Any]] | None]:
    """The messages and `Generate.tools` to send for a request, native or fallback."""
    offered = req.offered if req is not None else []
    if native:
        return _named_results(messages), [t.as_openai() for t in offered] or None
    if _has_tool_history(messages):
        messages = _fallback_history(messages)
    if req is not None and offered:
        messages = _with_system(messages, _section(req))
    return messages, None


@dataclass
class Prepared:
    """A chat request made ready for the worker: what to send, and how to read the output."""

    messages: list[ChatMessage]
    tools: list[dict[str, Any]] | None  # Generate.tools (native templates only)
    request: ToolRequest | None

    def parser(self) -> CallParser | None:
        return self.request.parser() if self.request is not None else None


class Tooling:
    """Per served model, whether its chat template takes tools (read once from the model
    files, like /api/show), and the preparation of a request's messages accordingly."""

    def __init__(self, catalog: ModelCatalog) -> None:
        self.catalog = catalog

    async def native(self, model: ServedModel) -> bool:
        return (await self.catalog.capabilities(model)).native_tools

    async def prepare(self, model: ServedModel, messages: list[ChatMessage],
                      req: ToolRequest | None, params: SamplingParams) -> Prepared:
        """Messages and tools for the worker; a forced call sets `params.json_schema`."""
        if req is not None and not req.tools:
            req = None
        if req is None and not _has_tool_history(messages):
            return Prepared(messages, None, None)
        out, tools = prepare(messages, req, await self.native(model))
        schema = call_schema(req) if req is not None else None
        if schema is not None:
            if params.json_schema is not None:
                raise invalid("a forced tool call cannot be combined with a response format",
                              param="tool_choice")
            params.json_schema = schema
        return Prepared(out, tools, req)


# --- forcing -----------------------------------------------------------------------------


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


def call_schema(req: ToolRequest) -> str | None:
    """The JSON schema a forced call must satisfy, or None when nothing is forced.

    NOTE: each tool's `$defs`/`definitions` move to the root (renamed per tool), because its
    parameters schema is nested under `arguments` and its `#/$defs/...` refs must still resolve.
    """
    if not req.forced:
        return None
    defs: dict[str, Any] = {}
    variants = []
    for i, tool in enumerate(req.offered):
        params = copy.deepcopy(tool.parameters)
        prefix = f"t{i}_"
        for key in ("$defs", "definitions"):
            for name, sub in (params.pop(key, None) or {}).items():
                defs[prefix + name] = _rewrite_refs(sub, prefix)
        params.pop("$schema", None)
        variants.append({
            "type": "object",
            "properties": {"name": {"const": tool.name},
                           "arguments": _rewrite_refs(params, prefix)},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        })
    one: dict[str, Any] = variants[0] if len(variants) == 1 else {"anyOf": variants}
    schema: dict[str, Any]
    if req.parallel and not req.named:
        schema = {"type": "array", "items": one, "minItems": 1, "maxItems": MAX_PARALLEL}
    else:
        schema = dict(one)
    if defs:
        schema["$defs"] = defs
    return json.dumps(schema, ensure_ascii=False)


# --- parsing -----------------------------------------------------------------------------


def _as_call(obj: Any, names: set[str]) -> ToolCall | None:
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("function"), dict):
        obj = obj["function"]
    name = obj.get("name")
    if not isinstance(name, str) or name not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except (json.JSONDecodeError, RecursionError):
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(name=name, arguments=args)


def _unfence(text: str) -> str:
    """The inside of a Markdown code fence (```json ... ```, the closing fence optional).

    NOTE: scanned, not matched with a regex: `\\s*(.*?)\\s*(?:```)?\\s*$` backtracked
    quadratically on model output with long runs of spaces (issue 14).
    """
    if not text.startswith("```"):
        return text
    pos = 3
    while pos < len(text) and text[pos] in _FENCE_INFO:
        pos += 1
    body = text[pos:].strip()
    if body.endswith("```"):
        body = body[:-3].rstrip()
    return body


def _json_calls(text: str, names: set[str]) -> list[ToolCall] | None:
    """Calls from a text that is nothing but JSON: one value or several in a row."""
    text = text.strip()
    if text.startswith("[TOOL_CALLS]"):
        text = text[len("[TOOL_CALLS]"):].lstrip()
    text = _unfence(text)
    decoder = json.JSONDecoder()
    calls: list[ToolCall] = []
    pos = 0
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,;":
            pos += 1
        if pos >= len(text):
            break
        try:
            value, pos = decoder.raw_decode(text, pos)
        except (json.JSONDecodeError, RecursionError):
            return None
        for item in value if isinstance(value, list) else [value]:
            call = _as_call(item, names)
            if call is None:
                return None
            calls.append(call)
    return calls or None


def parse_calls(text: str, tools: list[Tool]) -> tuple[str, list[ToolCall]]:
    """Split a finished output into text and calls (see the module docstring)."""
    names = {t.name for t in tools}
    if TAG_OPEN in text:
        rest: list[str] = []
        calls: list[ToolCall] = []
        pos = 0
        for match in _TAGGED.finditer(text):
            found = _json_calls(match.group(1), names)
            rest.append(text[pos:match.start()])
            if found is None:
                rest.append(match.group(0))
            else:
                calls += found
            pos = match.end()
        rest.append(text[pos:])
        if calls:
            return "".join(rest).strip(), calls
        return text, []
    stripped = text.lstrip()
    if stripped[:1] in ("{", "[", "`"):
        found = _json_calls(stripped, names)
        if found:
            return "", found
    return text, []


class CallParser:
    """Incremental: `feed` returns the text that is surely not part of a call, `finish` the
    rest of the text and the calls.

    Output that starts as JSON (after whitespace) is held back whole; otherwise text flows at
    once, except a tail that could be the start of a `<tool_call>` tag, and everything from
    such a tag on.
    """

    def __init__(self, tools: list[Tool]) -> None:
        self.tools = tools
        self._buf = ""
        self._mode: Literal["start", "text", "held"] = "start"

    def feed(self, text: str) -> str:
        self._buf += text
        if self._mode == "start":
            head = self._buf.lstrip()
            if not head:
                return ""
            if head[0] in "{[" or head.startswith((TAG_OPEN, "```")):
                self._mode = "held"
                return ""
            if TAG_OPEN.startswith(head) or "```".startswith(head):
                return ""
            self._mode = "text"
        if self._mode == "held":
            return ""
        at = self._buf.find(TAG_OPEN)
        if at >= 0:
            out, self._buf, self._mode = self._buf[:at], self._buf[at:], "held"
            return out
        keep = next((k for k in range(len(TAG_OPEN) - 1, 0, -1)
                     if self._buf.endswith(TAG_OPEN[:k])), 0)
        out = self._buf[:len(self._buf) - keep]
        self._buf = self._buf[len(out):]
        return out

    def finish(self) -> tuple[str, list[ToolCall]]:
        text, self._buf = self._buf, ""
        if self._mode != "held":
            return text, []
        return parse_calls(text, self.tools)


def split_calls(text: str, parser: CallParser | None) -> tuple[str, list[ToolCall]]:
    """A whole (non-streamed) output through the same parser a stream uses."""
    if parser is None:
        return text, []
    head = parser.feed(text)
    rest, calls = parser.finish()
    return (head + rest).strip() if calls else head + rest, calls


def fragments(text: str, size: int = 24) -> list[str]:
    """A call's arguments JSON cut into stream-sized pieces (clients concatenate them)."""
    return [text[i:i + size] for i in range(0, len(text), size)] or [""]
