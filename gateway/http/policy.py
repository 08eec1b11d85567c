"""Who may talk to the HTTP port from a browser: Host allow-list, Origin policy with CORS,
Fetch Metadata, and JSON-only bodies from browsers — Ollama's policy. One middleware,
outside the API key check and the body limit (a refused request's body is read and dropped
within a budget, never kept: gateway/http/drain.py), configured by `host`, `allowed_hosts`
and `allowed_origins` (protocol/config/). Refusals are in the calling API's own error
shape (`dialect_for(scope)`).

In order, for every HTTP request:
1. Host (DNS rebinding): on a loopback bind, the loopback names, IP literals that are
   loopback, private, link-local or unspecified (0.0.0.0 reaches loopback), the machine's
   own hostname, names under `.localhost`, `.local` and `.internal` (Docker's
   `host.docker.internal`, mDNS names), the configured `host` and the `allowed_hosts`.
   Anything else is 403: a page whose public name was re-pointed at this machine sends its
   own name. A non-loopback bind accepts any Host, as Ollama does: it is reached by names
   this server cannot know, and it needs a key (protocol/config/ `remote_bind_refusal`).
2. Origin (sent by browsers on every cross-origin request and on every POST): Ollama's
   default origins (`DEFAULT_ORIGINS`: loopback and 0.0.0.0 pages on any port, desktop apps,
   editors' webviews) and the browser extensions, plus the `allowed_origins`, get CORS
   answers (preflight included); any other origin is 403 with no CORS header, so the page
   can neither call nor read the API. Without an Origin, `Sec-Fetch-Site: cross-site` marks
   a browser request from a foreign page (an `<img>` or `<script>`), refused unless it is a
   top-level navigation.
3. Body type, for browser requests only (an Origin, or `Sec-Fetch-Site` cross-site or
   same-site): text/plain, multipart/form-data and application/x-www-form-urlencoded — the
   three a page may send cross-origin without a preflight — are 415 on every route that
   takes a body, but for multipart/form-data on the routes whose API is multipart
   (`MULTIPART_PATHS`: OpenAI's audio uploads); any other type needs a preflight, which
   step 2 governs. A request without
   those markers may send its JSON with any Content-Type, as Ollama reads it: `curl -d`
   (Ollama's own docs) sends application/x-www-form-urlencoded, and so do PowerShell's
   Invoke-RestMethod and Python's urllib. NOTE: a browser cannot abuse that, because every
   cross-origin POST a browser makes carries Origin, which step 2 decides.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from urllib.parse import urlsplit

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from npu_proxy.gateway.core.errors import GatewayError
from npu_proxy.gateway.http.drain import DrainBudget, refuse
from npu_proxy.gateway.http.wire import dialect_for
from npu_proxy.protocol.config import Config, is_loopback_host

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
# Names no public DNS answers for, which only this machine or its LAN resolves (Ollama's list).
LOCAL_SUFFIXES = (".localhost", ".local", ".internal")
# Ollama's defaults (envconfig.AllowedOrigins; localhost/127.0.0.1/0.0.0.0 pages are
# `_loopback_page`). NOTE: Ollama asks OLLAMA_ORIGINS for the extension schemes; they are
# allowed by default here because an extension is software the user installed, and its
# requests to this port are its own choice rather than a visited page's.
DEFAULT_ORIGINS = ("app://*", "file://*", "tauri://*", "vscode-webview://*",
                   "vscode-file://*", "chrome-extension://*", "moz-extension://*",
                   "safari-extension://*", "safari-web-extension://*",
                   "ms-browser-extension://*")
# A Sec-Fetch-Site value that marks a request made by a page (not by a tool or the user).
PAGE_FETCH = frozenset({"cross-site", "same-site"})
# What a page may send cross-origin without asking first (the CORS "simple" body types).
SIMPLE_BODY_TYPES = frozenset({"text/plain", "multipart/form-data",
                               "application/x-www-form-urlencoded"})
# Routes whose API is multipart (OpenAI's audio uploads); step 2 still decides for browsers.
MULTIPART_PATHS = frozenset({"/v1/audio/transcriptions", "/v1/audio/translations"})
ALLOW_METHODS = "GET, HEAD, POST, PUT, DELETE, OPTIONS"
# What the official SDKs send from a browser (OpenAI's and Anthropic's generated clients add
# the x-stainless-* set; Anthropic's wants its direct-browser-access opt-in).
ALLOW_HEADERS = ", ".join((
    "Authorization", "Content-Type", "Accept", "User-Agent", "X-Requested-With",
    "X-Request-ID", "x-api-key", "anthropic-version", "anthropic-beta",
    "anthropic-dangerous-direct-browser-access", "OpenAI-Beta", "OpenAI-Organization",
    "OpenAI-Project", "x-stainless-arch", "x-stainless-async", "x-stainless-lang",
    "x-stainless-os", "x-stainless-package-version", "x-stainless-runtime",
    "x-stainless-runtime-version", "x-stainless-retry-count", "x-stainless-timeout",
    "x-stainless-helper-method", "x-stainless-poll-helper",
    "x-stainless-custom-poll-interval"))
EXPOSE_HEADERS = ", ".join((
    "X-Request-ID", "X-NPU-Proxy-Device", "X-NPU-Proxy-Worker", "X-NPU-Proxy-Route-Reason",
    "X-NPU-Proxy-Token-Count", "X-NPU-Proxy-Ignored", "Retry-After"))


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key == name:
            return str(value.decode("latin-1"))
    return None


def host_name(host: str) -> str:
    """The name of a Host header value: no port, no brackets, lower case, no final dot."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    if host.count(":") == 1:
        host = host.split(":", 1)[0]
    return host.rstrip(".")


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _origin_pattern(pattern: str) -> re.Pattern[str]:
    # NOTE: `*` stands for any run of characters within the origin (a subdomain, a port);
    # an origin has no path, so it never reaches past one.
    parts = (re.escape(part) for part in pattern.strip().lower().rstrip("/").split("*"))
    return re.compile("[^/]*".join(parts))


class HttpPolicy:
    """The decisions, apart from the ASGI plumbing."""

    def __init__(self, config: Config) -> None:
        self.hosts = set(LOOPBACK_NAMES) | {host_name(h) for h in config.allowed_hosts}
        self.hosts.add(host_name(config.host))
        self.hosts.add(socket.gethostname().lower())
        self.any_host = "*" in self.hosts or not is_loopback_host(config.host)
        self.origins = [_origin_pattern(o) for o in (*DEFAULT_ORIGINS, *config.allowed_origins)]
        # NOTE: `null` is the origin of sandboxed frames and of pages opened from files or
        # data: URLs — any page can make itself one, so only naming it lets it in ("*" not).
        listed = {o.strip().lower() for o in config.allowed_origins}
        self.null_allowed = "null" in listed
        # NOTE: a lone "*" is every origin (a `*` inside a pattern stays within one part).
        self.any_origin = "*" in listed

    def host_allowed(self, host: str | None) -> bool:
        if host is None or self.any_host:
            return True  # NOTE: HTTP/1.0 without Host: not a browser
        name = host_name(host)
        if name in self.hosts or name.endswith(LOCAL_SUFFIXES):
            return True
        if not _is_ip(name):
            return False
        # NOTE: no browser sends an IP literal for a name it resolved, so an IP literal is
        # never a rebound name; `OLLAMA_HOST=0.0.0.0` clients send Host 0.0.0.0.
        address = ipaddress.ip_address(name)
        return (address.is_loopback or address.is_private or address.is_link_local
                or address.is_unspecified)

    def origin_allowed(self, origin: str) -> bool:
        origin = origin.strip().lower()
        if origin == "null":
            return self.null_allowed
        if self.any_origin:
            return True
        try:
            parts = urlsplit(origin)
        except ValueError:  # NOTE: an unbalanced `[` in the authority
            return False
        if parts.scheme in ("http", "https") and _loopback_page(parts.hostname):
            return True
        return any(p.fullmatch(origin) for p in self.origins)


def _loopback_page(name: str | None) -> bool:
    if name is None:
        return False
    if name in LOOPBACK_NAMES:
        return True
    if not _is_ip(name):
        return False
    address = ipaddress.ip_address(name)
    return address.is_loopback or address.is_unspecified


def browser_request(scope: Scope) -> bool:
    """Whether a page in a browser made this request (Fetch's markers), not a tool."""
    return (_header(scope, b"origin") is not None
            or _header(scope, b"sec-fetch-site") in PAGE_FETCH)


def _refuse(scope: Scope, status: int, kind: str, message: str) -> Response:
    response = dialect_for(scope).error_response(GatewayError(status, kind, message))
    response.headers["Vary"] = "Origin"
    return response


class HttpPolicyMiddleware:
    def __init__(self, app: ASGIApp, config: Config) -> None:
        self.app = app
        self.policy = HttpPolicy(config)
        self.budget = DrainBudget.from_config(config)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        method = scope.get("method", "GET")
        host = _header(scope, b"host")
        if not self.policy.host_allowed(host):
            response = _refuse(scope, 403, "forbidden",
                          f"Host {host!r} is not served here; add it to allowed_hosts "
                          "(NPU_PROXY_ALLOWED_HOSTS) if it names this server")
            await refuse(response, scope, receive, send, self.budget)
            return
        origin = _header(scope, b"origin")
        if origin is not None and not self.policy.origin_allowed(origin):
            response = _refuse(scope, 403, "forbidden",
                          f"origin {origin!r} is not allowed; add it to allowed_origins "
                          "(NPU_PROXY_ORIGINS) to let its pages use this server")
            await refuse(response, scope, receive, send, self.budget)
            return
        if origin is None and _header(scope, b"sec-fetch-site") == "cross-site" and not (
                method in ("GET", "HEAD") and _header(scope, b"sec-fetch-mode") == "navigate"):
            response = _refuse(scope, 403, "forbidden",
                          "a request from another site's page is not allowed")
            await refuse(response, scope, receive, send, self.budget)
            return
        if (origin is not None and method == "OPTIONS"
                and _header(scope, b"access-control-request-method") is not None):
            await refuse(self._preflight(scope, origin), scope, receive, send, self.budget)
            return

        async def send_with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                headers.append((b"vary", b"Origin"))
                if origin is not None:
                    headers.append((b"access-control-allow-origin", origin.encode("latin-1")))
                    headers.append((b"access-control-expose-headers", EXPOSE_HEADERS.encode()))
                message["headers"] = headers
            await send(message)

        media = (_header(scope, b"content-type") or "").split(";", 1)[0].strip().lower()
        if (method not in ("GET", "HEAD", "OPTIONS") and media in SIMPLE_BODY_TYPES
                and browser_request(scope) and not (
                    media == "multipart/form-data" and scope.get("path") in MULTIPART_PATHS)):
            # NOTE: an allowed page may read why (CORS headers added by send_with_cors).
            error = GatewayError(415, "unsupported_media_type",
                                 f"Content-Type {media} is not accepted: send the JSON body "
                                 "as application/json")
            await refuse(dialect_for(scope).error_response(error), scope, receive,
                         send_with_cors, self.budget)
            return
        await self.app(scope, receive, send_with_cors)

    def _preflight(self, scope: Scope, origin: str) -> Response:
        headers = {
            "Access-Control-Allow-Origin": origin,
            "Access-Control-Allow-Methods": ALLOW_METHODS,
            "Access-Control-Allow-Headers": ALLOW_HEADERS,
            "Access-Control-Max-Age": "600",
            "Vary": "Origin",
        }
        # NOTE: Chrome's Private Network Access asks this before a public page (an allowed
        # origin) may reach a loopback or LAN address.
        if _header(scope, b"access-control-request-private-network") == "true":
            headers["Access-Control-Allow-Private-Network"] = "true"
        return Response(status_code=204, headers=headers)
