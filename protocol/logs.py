"""Logging set-up shared by every process: key=value text or JSON lines.

Records carry the structured fields request_id, worker and device (`extra=`); a process
that is one worker stamps its own worker and device on every record it logs.
"""

from __future__ import annotations

import json
import logging
import sys
import time

_FIELDS = ("request_id", "worker", "device")


def printable(text: str) -> str:
    """`text` with every character a terminal or a log reader would act on escaped.

    NOTE: messages carry what clients sent (paths, model names): a raw newline forged log
    lines and ESC sequences reached the operator's terminal through the supervisor's echo.
    """
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else _escape(ord(c)) for c in text)


def _escape(code: int) -> str:
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


class _JsonFormatter(logging.Formatter):
    def __init__(self, process: str) -> None:
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "process": self.process,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key in _FIELDS:
            value = getattr(record, key, None)
            if value is not None:
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


class _TextFormatter(logging.Formatter):
    def __init__(self, process: str) -> None:
        super().__init__()
        self.process = process

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(record.created))
        message = printable(record.getMessage())
        pairs = (f"{key}={printable(str(getattr(record, key)))}" for key in _FIELDS
                 if getattr(record, key, None))
        # NOTE: a message that already says `request_id=...` is not repeated.
        extra = "".join(f" {pair}" for pair in pairs if pair not in message)
        line = (f"{stamp}.{int(record.msecs):03d} {record.levelname:<5} {self.process} "
                f"{record.name}: {message}{extra}")
        if record.exc_info:
            # NOTE: a traceback's own lines stay lines; what an exception quotes is escaped.
            trace = self.formatException(record.exc_info).split("\n")
            line += "\n" + "\n".join(printable(part) for part in trace)
        return line


class _StaticFields(logging.Filter):
    def __init__(self, fields: dict[str, str]) -> None:
        super().__init__()
        self.fields = fields

    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in self.fields.items():
            if getattr(record, key, None) is None:
                setattr(record, key, value)
        return True


def setup_logging(process: str, level: str = "INFO", fmt: str = "text",
                  fields: dict[str, str] | None = None) -> None:
    """Log to stderr; `fields` (e.g. a worker's name and device) go on every record."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter(process) if fmt == "json" else _TextFormatter(process))
    if fields:
        handler.addFilter(_StaticFields(fields))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
