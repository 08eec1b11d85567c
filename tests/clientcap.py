"""A capturing loopback proxy for the agent-client tests, and the prompt-free "shape" of a
request body that tests/fixtures/clients/ keeps.

`CaptureProxy(upstream)` listens on a free loopback port, forwards every request to the real
server unchanged (streamed replies are relayed chunk by chunk, as they come) and records each
exchange: method, path, headers, the JSON body, the reply's status and body.

`skeleton(body)` keeps a body's structure and drops its text: every key, every array element
in order, `type`/`role`/`name`-like values and small config knobs verbatim; any other string
becomes `{"str": length}`, any other number its type name. `signature` is a skeleton without
the lengths (what a client update must keep for the fixture to match); `synthesize` turns a
skeleton back into a body with short filler text, to replay a client's shape without node.
"""

from __future__ import annotations

import http.client
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

# Values kept verbatim: they name a type, a role, a tool or a setting, not prompt text.
ENUM_KEYS = frozenset({
    "type", "role", "model", "tool_choice", "effort", "summary", "status", "display", "keep",
    "detail", "format", "object", "name", "verbosity", "service_tier", "truncation", "phase",
})
ENUM_LISTS = frozenset({"include", "required", "enum", "modalities"})
KEEP_SCALARS = frozenset({
    "max_tokens", "max_output_tokens", "max_completion_tokens", "temperature", "top_p",
    "stream", "store", "parallel_tool_calls", "budget_tokens", "strict", "defer_loading",
    "external_web_access", "include_usage", "n",
})
HEADER_KEEP = frozenset({
    "anthropic-beta", "anthropic-version", "content-type", "accept", "x-app", "originator",
    "openai-beta", "x-stainless-retry-count", "content-encoding", "x-codex-beta-features",
})
HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade",
    "proxy-connection", "content-length", "host",
})


def skeleton(value: Any, key: str | None = None) -> Any:
    if isinstance(value, dict):
        return {k: skeleton(v, k) for k, v in value.items()}
    if isinstance(value, list):
        if key in ENUM_LISTS and all(isinstance(x, str) for x in value):
            return list(value)
        return [skeleton(x, key) for x in value]
    if isinstance(value, str):
        return value if key in ENUM_KEYS and len(value) <= 80 else {"str": len(value)}
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int | float):
        return value if key in KEEP_SCALARS else type(value).__name__
    return type(value).__name__


def _is_text(node: Any) -> bool:
    return isinstance(node, dict) and set(node) == {"str"} and isinstance(node["str"], int)


def signature(node: Any) -> Any:
    """A skeleton without string lengths: what must stay the same across runs."""
    if _is_text(node):
        return "str"
    if isinstance(node, dict):
        return {k: signature(v) for k, v in node.items()}
    if isinstance(node, list):
        return [signature(x) for x in node]
    return node


FILLER = "Say OK. "


def synthesize(node: Any) -> Any:
    """A body of the skeleton's shape: short filler text, 0 or 0.0 for numbers."""
    if _is_text(node):
        n = node["str"]
        return (FILLER * (1 + n // len(FILLER)))[:min(n, 24)].strip() or ("x" if n else "")
    if isinstance(node, dict):
        return {k: synthesize(v) for k, v in node.items()}
    if isinstance(node, list):
        return [synthesize(x) for x in node]
    if node == "int":
        return 0
    if node == "float":
        return 0.0
    return node


def headers_subset(headers: dict[str, str]) -> dict[str, str]:
    out: dict[str, str] = {}
    for k, v in headers.items():
        kl = k.lower()
        if kl in HEADER_KEEP:
            out[kl] = v
        elif kl == "authorization":
            out[kl] = v.split(" ")[0] + " <redacted>"
        elif kl == "x-api-key" or kl.startswith(("x-", "anthropic")):
            out[kl] = "<present>"
    return dict(sorted(out.items()))


@dataclass
class Exchange:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    status: int = 0
    chunks: list[bytes] = field(default_factory=list)

    @property
    def reply(self) -> bytes:
        """The reply's body as relayed so far (all of it once the exchange is over)."""
        return b"".join(self.chunks)

    def json(self) -> Any:
        return json.loads(self.body) if self.body else None

    def reply_json(self) -> Any:
        return json.loads(self.reply)

    def shape(self) -> dict[str, Any]:
        """The fixture record of this request (no prompt text)."""
        body = self.json()
        return {"method": self.method, "path": self.path,
                "headers": headers_subset(self.headers), "body_bytes": len(self.body),
                "body": skeleton(body) if body is not None else None}


@dataclass
class CaptureProxy:
    upstream: str
    exchanges: list[Exchange] = field(default_factory=list)
    # Seconds the relay waits for the server's next bytes: a long prompt's prefill sends
    # nothing after the stream's opening events until its first token.
    read_timeout: float = 120.0

    def __post_init__(self) -> None:
        target = urlsplit(self.upstream)
        host, port = target.hostname or "127.0.0.1", target.port or 80
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _read_body(self) -> bytes:
                if self.headers.get("transfer-encoding", "").lower() == "chunked":
                    parts = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0], 16)
                        if size == 0:
                            self.rfile.readline()
                            return b"".join(parts)
                        parts.append(self.rfile.read(size))
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("content-length") or 0))

            def _relay(self) -> None:
                body = self._read_body()
                ex = Exchange(self.command, self.path,
                              {k.lower(): v for k, v in self.headers.items()}, body)
                proxy.exchanges.append(ex)
                conn = http.client.HTTPConnection(host, port, timeout=proxy.read_timeout)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
                headers["Host"] = f"{host}:{port}"
                conn.request(self.command, self.path, body=body or None, headers=headers)
                resp = conn.getresponse()
                ex.status = resp.status
                self.send_response(resp.status, resp.reason)
                for k, v in resp.getheaders():
                    if k.lower() not in HOP_BY_HOP:
                        self.send_header(k, v)
                if self.command != "HEAD":
                    self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                try:
                    while chunk := resp.read1(65536):
                        ex.chunks.append(chunk)
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                        self.wfile.flush()
                    if self.command != "HEAD":
                        self.wfile.write(b"0\r\n\r\n")
                    self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    # NOTE: the client left mid-reply (its own timeout): recorded as it got it.
                    self.close_connection = True
                finally:
                    conn.close()

            do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = do_OPTIONS = _relay

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def inference(self) -> list[Exchange]:
        """The exchanges that asked the model for something (a POST with a JSON body)."""
        return [e for e in self.exchanges if e.method == "POST" and e.json() is not None]
