"""Anthropic-defined client tools: the client runs them, the API declares them by `type` alone
(no input_schema), and Claude was trained on their input shapes. A local model gets the same
shapes as a schema, from Anthropic's tool documentation (bash, text editor, memory):

- `bash_20250124` / `bash_20241022`: `command`, `restart`;
- `text_editor_20250728` / `_20250429` (`str_replace_based_edit_tool`), `_20250124` /
  `_20241022` (`str_replace_editor`, which also has `undo_edit`): `command` view, create,
  str_replace, insert; `path`, `file_text`, `old_str`, `new_str`, `insert_line`,
  `insert_text` (`new_str` in the older versions), `view_range`;
- `memory_20250818`: `command` view, create, str_replace, insert, delete, rename; `path`,
  `view_range`, `file_text`, `old_str`, `new_str`, `insert_line`, `insert_text`, `old_path`,
  `new_path`.

Other typed tools (computer use, web search, code execution, ...) are not listed: computer use
needs screenshots a text model cannot take, the rest run on Anthropic's servers.
"""

from __future__ import annotations

from typing import Any

_S: dict[str, Any] = {"type": "string"}
_I: dict[str, Any] = {"type": "integer"}
_RANGE: dict[str, Any] = {"type": "array", "items": {"type": "integer"}, "minItems": 2,
                          "maxItems": 2,
                          "description": "[start, end] lines to view, 1-based; end -1 = to EOF"}

BASH: dict[str, Any] = {
    "type": "object",
    "properties": {
        "command": {**_S, "description": "The bash command to run."},
        "restart": {"type": "boolean", "description": "Restart the bash session."},
    },
}


def _editor(commands: list[str], insert_field: str) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "command": {"type": "string", "enum": commands},
            "path": {**_S, "description": "Absolute path to the file or directory."},
            "file_text": {**_S, "description": "The content of the file to create."},
            "old_str": {**_S, "description": "The exact text to replace."},
            "new_str": {**_S, "description": "The text that replaces old_str."},
            "insert_line": {**_I, "description": "The line after which to insert (0 = top)."},
            insert_field: {**_S, "description": "The text to insert."},
            "view_range": _RANGE,
        },
        "required": ["command", "path"],
    }


MEMORY: dict[str, Any] = {
    "type": "object",
    "properties": {
        "command": {"type": "string", "enum": ["view", "create", "str_replace", "insert",
                                               "delete", "rename"]},
        "path": {**_S, "description": "A path under /memories."},
        "view_range": _RANGE,
        "file_text": _S, "old_str": _S, "new_str": _S, "insert_line": _I, "insert_text": _S,
        "old_path": _S, "new_path": _S,
    },
    "required": ["command"],
}

_EDIT_NEW = ["view", "create", "str_replace", "insert"]
SCHEMAS: dict[str, dict[str, Any]] = {
    "bash_20250124": BASH,
    "bash_20241022": BASH,
    "text_editor_20250728": _editor(_EDIT_NEW, "insert_text"),
    "text_editor_20250429": _editor(_EDIT_NEW, "insert_text"),
    "text_editor_20250124": _editor([*_EDIT_NEW, "undo_edit"], "new_str"),
    "text_editor_20241022": _editor([*_EDIT_NEW, "undo_edit"], "new_str"),
    "memory_20250818": MEMORY,
}
DESCRIPTIONS = {
    "bash": "Run a command in a persistent bash shell.",
    "text_editor": "View, create and edit text files.",
    "memory": "View, create, edit, rename and delete files in the /memories directory.",
}


def defined_schema(kind: Any) -> dict[str, Any] | None:
    """The input schema of an Anthropic-defined client tool type, or None."""
    return SCHEMAS.get(kind) if isinstance(kind, str) else None


def defined_description(kind: str) -> str:
    return DESCRIPTIONS.get(kind.rsplit("_", 1)[0], "")
