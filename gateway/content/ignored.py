"""What a request sent that the server does not act on, said out loud.

The rule (docs/api-fields.md): a field, tool type, content block, role or input item the server
cannot act on is mapped to what it means, or ignored visibly: named in the response header
`X-NPU-Proxy-Ignored` (comma-separated) and in one INFO log line; a 400 only where going on
would change the meaning of the answer. Each dialect's translation adds what it leaves out to
the request's `Ignored`; the request path (gateway/api/request_path.py) writes the header and
the log line.
"""

from __future__ import annotations

import logging
import re

log = logging.getLogger(__name__)

HEADER = "X-NPU-Proxy-Ignored"
# NOTE: names come from the client's body (tool types, block types): only this alphabet goes
# into a header, so a crafted type cannot split it; at most MAX_NAMES, each at most 64 chars.
_SAFE = re.compile(r"[^A-Za-z0-9_.:\-\[\]]")
MAX_NAMES = 32


def _safe(name: str) -> str:
    return _SAFE.sub("?", name[:64])


class Ignored:
    """The names of what one request sent and the server left out (in first-seen order), and
    the few mappings that move the client's text (`moved`: logged, no header)."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.moved: list[str] = []

    def add(self, name: str) -> None:
        name = _safe(name)
        if name not in self.names and len(self.names) < MAX_NAMES:
            self.names.append(name)

    def move(self, note: str) -> None:
        if len(self.moved) < MAX_NAMES:
            self.moved.append(note)

    def __bool__(self) -> bool:
        return bool(self.names)

    def headers(self) -> dict[str, str]:
        return {HEADER: ", ".join(self.names)} if self.names else {}

    def report(self, path: str, request_id: str) -> None:
        if self.names:
            log.info("ignored what this server cannot act on: %s", ", ".join(self.names),
                     extra={"path": path, "request_id": request_id})
        if self.moved:
            log.info("mapped to what it means: %s", "; ".join(self.moved),
                     extra={"path": path, "request_id": request_id})
