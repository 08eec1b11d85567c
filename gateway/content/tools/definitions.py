"""The internal form of tools, whatever the API: `Tool`, `ToolChoice`, `ToolCall`,
`ToolRequest`, and earlier calls as a history holds them (`history_call`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

from npu_proxy.gateway.core.errors import invalid
from npu_proxy.protocol.ids import new_id

Mode = Literal["none", "auto", "required"]
Kind = Literal["function", "custom"]
# The one argument of a Responses `custom` tool (free text) as the model sees it.
CUSTOM_INPUT = "input"
# NOTE: bounds a forced list of parallel calls, so a looping small model still ends in JSON.
MAX_PARALLEL = 8


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]
    # Responses: the `namespace` tool this one was declared in (its calls name it), and
    # `custom` for a free-text tool (offered with one string argument, CUSTOM_INPUT).
    namespace: str | None = None
    kind: Kind = "function"
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
    namespace: str | None = None
    kind: Kind = "function"
    # A call the output's end cut off (max_tokens, the deadline): its arguments' text as far
    # as it came, which OpenAI's APIs return as the arguments; `arguments` is then empty.
    partial: str | None = None

    def arguments_json(self) -> str:
        if self.partial is not None:
            return self.partial
        return json.dumps(self.arguments, ensure_ascii=False)

    def custom_input(self) -> str:
        """A custom tool's free text (the model may also have written other arguments)."""
        value = self.arguments.get(CUSTOM_INPUT)
        if isinstance(value, str) and len(self.arguments) == 1:
            return value
        return value if isinstance(value, str) else self.arguments_json()


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

