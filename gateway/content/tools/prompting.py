"""Tools put before the model: natively through a chat template that knows them, or as the
fallback prompt (a `# Tools` section, earlier calls and results written as text); `Tooling`
prepares a request's messages either way (see the package docstring)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

import msgspec

from npu_proxy.gateway.content.tools.definitions import ToolRequest
from npu_proxy.gateway.content.tools.forcing import auto_call_schema, call_schema, tool_parameters
from npu_proxy.gateway.content.tools.parsing import BARE_CALL, TAG_CLOSE, TAG_OPEN
from npu_proxy.gateway.content.tools.streaming import CallParser
from npu_proxy.gateway.core.catalog import ModelFacts
from npu_proxy.protocol.messages import ChatMessage, SamplingParams, ToolTag, ToolTags

log = logging.getLogger(__name__)


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


def call_markers(native: bool, chat_template: str) -> tuple[str, str] | None:
    """The strings a call begins and ends with: the fallback prompt's `<tool_call>` tags, or a
    native template's when it writes them (Hermes, Qwen2.5, Qwen3); None for a template whose
    calls have no such pair (Llama 3.x writes bare JSON), which CallParser reads unmarked."""
    if not native or (TAG_OPEN in chat_template and TAG_CLOSE in chat_template):
        return TAG_OPEN, TAG_CLOSE
    return None


def auto_tags(req: ToolRequest, native: bool, chat_template: str) -> ToolTags | None:
    """Under tool_choice auto, what holds a call once the model begins one: from `{"name"`
    on, one tool's name, its arguments' key as the template writes it, its arguments and the
    closing brace; and, for a template with call markers, one call of any offered tool
    between them. None when no tool is offered.

    NOTE: Qwen2.5-Coder-1.5B under Codex CLI, whose template has `<tool_call>` markers,
    wrote a fenced `{"name": "create_file", ...}`, a tool Codex does not offer, and the
    call was lost as text (issue 42): bare JSON is held to the offered tools whatever the
    template. The cost: a compact JSON object that begins with a "name" key, written as
    text while tools are offered, becomes a call. A pretty-printed `{\n  "name"` is no
    trigger, on purpose: a package.json, and many JSON answers, begin so, and the constraint
    would force a tool's name into them (such a call, when the model writes one, is still
    parsed unconstrained).
    """
    schema = auto_call_schema(req)
    if schema is None:
        return None
    key = "parameters" if '"parameters"' in chat_template else "arguments"
    tags = tuple(ToolTag(f"{BARE_CALL}: {json.dumps(t.name, ensure_ascii=False)}, "
                         f'"{key}": ', tool_parameters(t), "}") for t in req.offered)
    single = not req.parallel
    markers = call_markers(native, chat_template)
    if markers is None:
        return ToolTags((BARE_CALL,), tags, single=single)
    marked = ToolTag(markers[0], schema, markers[1], padded=True)
    return ToolTags((markers[0], BARE_CALL), (marked, *tags), single=single)


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
class PreparedChat:
    """A chat request made ready for the worker: what to send, and how to read the output."""

    messages: list[ChatMessage]
    tools: list[dict[str, Any]] | None  # Generate.tools (native templates only)
    request: ToolRequest | None
    params: SamplingParams  # the request's, with the tool call's constraint when there is one

    def parser(self) -> CallParser | None:
        offered = self.request.offered if self.request is not None else []
        return CallParser(offered) if offered else None


def prepare_chat(facts: ModelFacts, messages: list[ChatMessage], req: ToolRequest | None,
                 params: SamplingParams) -> PreparedChat:
    """Messages, tools and parameters for the worker; a forced call sets the parameters'
    `json_schema`, a call under tool_choice auto their `tool_tags`."""
    if req is not None and not req.tools:
        req = None
    if req is None and not _has_tool_history(messages):
        return PreparedChat(messages, None, None, params)
    native = facts.capabilities.native_tools
    out, tools = prepare(messages, req, native)
    schema = call_schema(req) if req is not None else None
    if schema is not None:
        # NOTE: a forced call wins over a response format, as on OpenAI: the format is for
        # the text, and a forced call writes none (the Agents SDK sends both when an agent
        # with an output_type is made to call a tool).
        if params.json_schema is not None or params.regex is not None:
            log.info("tool_choice forces a call, which writes no text: the response format "
                     "is not applied")
        params = msgspec.structs.replace(params, json_schema=schema, regex=None)
    # NOTE: a response format the client asked for wins over the auto call's constraint:
    # it is the client's contract for the whole output (GenAI takes one constraint per
    # request), and a call it lets through is still parsed, only unconstrained.
    if req is not None and params.json_schema is None and params.regex is None and \
            (tags := auto_tags(req, native, facts.chat_template)) is not None:
        params = msgspec.structs.replace(params, tool_tags=tags)
    return PreparedChat(out, tools, req, params)
