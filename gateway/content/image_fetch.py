"""Fetching an image URL (`image_urls = true`) without letting a client reach what it could not.

A server that fetches URLs for its clients can be made to reach every address it can (SSRF):
its own loopback services, the LAN, a cloud's metadata service at 169.254.169.254. So:

- only globally routable addresses are fetched (`is_public`): no loopback, private, shared
  (100.64/10), link-local, unspecified, multicast or reserved address, IPv4 or IPv6, and an
  IPv4 address written inside IPv6 (`::ffff:127.0.0.1`, NAT64's `64:ff9b::/96`) is judged as
  the IPv4 address it carries;
- a name is resolved once, every address it has must be public, and the connection is made
  to that address (the name goes in the Host header and, for https, in SNI and the
  certificate check), so a DNS answer that changes between the check and the connection
  (rebinding) changes nothing;
- redirects are followed here, at most MAX_REDIRECTS, each target checked as the first;
- every failure is the same 400 (`GENERIC`): an error that told a refused address from a
  closed port, a timeout or a non-image would make the server a port scanner;
- at most `cap` bytes are read (the caller's budget: the image cap and what is left of the
  request's own, gateway/content/images.py).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from typing import TYPE_CHECKING
from urllib.parse import urljoin, urlsplit, urlunsplit

if TYPE_CHECKING:
    import httpx

MAX_REDIRECTS = 5
MAX_URL_CHARS = 8192
GENERIC = "the image URL could not be fetched as an image"
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_SHARED = ipaddress.ip_network("100.64.0.0/10")


class FetchRefused(Exception):
    """Any reason a URL was not fetched; its text is for the log, never the client."""


def is_public(address: IPAddress) -> bool:
    """Whether `address` is globally routable (see the module's doc)."""
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return is_public(address.ipv4_mapped)
        if address in _NAT64:
            return is_public(ipaddress.IPv4Address(int(address) & 0xFFFFFFFF))
        if address.sixtofour is not None:
            return is_public(address.sixtofour)
        if address.teredo is not None:
            return is_public(address.teredo[1])
    if isinstance(address, ipaddress.IPv4Address) and address in _SHARED:
        return False
    return address.is_global and not (
        address.is_loopback or address.is_private or address.is_link_local
        or address.is_unspecified or address.is_multicast or address.is_reserved)


async def resolve(host: str, port: int) -> IPAddress:
    """The one address `host` is reached at, if every address it has is public."""
    try:
        literal: IPAddress | None = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        literal = None
    if literal is not None:
        found = [literal]
    else:
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(
                host, port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError) as exc:
            raise FetchRefused(f"{host!r} does not resolve: {exc}") from None
        found = [ipaddress.ip_address(str(info[4][0]).split("%", 1)[0]) for info in infos]
    if not found or not all(is_public(address) for address in found):
        raise FetchRefused(f"{host!r} resolves to an address that is not public: {found}")
    return found[0]


def _target(url: str) -> tuple[str, str, int, str]:
    """The scheme, host name, port and path-with-query of an http(s) URL."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise FetchRefused("not a URL") from None
    if (parts.scheme not in ("http", "https") or not parts.hostname or len(url) > MAX_URL_CHARS
            or parts.username is not None or parts.password is not None):
        raise FetchRefused("not a plain http(s) URL")
    port = port or (443 if parts.scheme == "https" else 80)
    path = urlunsplit(("", "", parts.path or "/", parts.query, ""))
    return parts.scheme, parts.hostname, port, path


async def fetch(url: str, cap: int, timeout: float) -> bytes:
    """The body of `url` (at most `cap` bytes), fetched as the module's doc says; raises
    FetchRefused for every failure."""
    # NOTE: imported here: httpx (with click, rich and pygments) was ~0.1 s of the gateway's
    # import time, for a fetch that is off unless configured (bench/start.py).
    import httpx

    headers = {"Accept": "image/*", "Accept-Encoding": "identity"}
    try:
        async with asyncio.timeout(timeout), httpx.AsyncClient(
                follow_redirects=False, trust_env=False, timeout=timeout) as client:
            for _ in range(MAX_REDIRECTS + 1):
                scheme, host, port, path = _target(url)
                address = await resolve(host, port)
                literal = f"[{address}]" if address.version == 6 else str(address)
                pinned = f"{scheme}://{literal}:{port}{path}"
                default = port == (443 if scheme == "https" else 80)
                hop = {**headers, "Host": host if default else f"{host}:{port}"}
                extensions = {"sni_hostname": host} if scheme == "https" else {}
                async with client.stream("GET", pinned, headers=hop,
                                         extensions=extensions) as resp:
                    if resp.is_redirect and "location" in resp.headers:
                        url = urljoin(url, resp.headers["location"])
                        continue
                    if resp.status_code != 200:
                        raise FetchRefused(f"HTTP {resp.status_code}")
                    return await _read(resp, cap)
    except (httpx.HTTPError, httpx.InvalidURL, httpx.StreamError, TimeoutError,
            ValueError) as exc:
        raise FetchRefused(type(exc).__name__) from None
    raise FetchRefused("too many redirects")


async def _read(resp: httpx.Response, cap: int) -> bytes:
    declared = resp.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > cap:
        raise FetchRefused("too large")
    body = bytearray()
    # NOTE: raw bytes: a body compressed against Accept-Encoding: identity is no image.
    async for chunk in resp.aiter_raw():
        body += chunk
        if len(body) > cap:
            raise FetchRefused("too large")
    return bytes(body)
