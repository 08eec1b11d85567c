"""Images in requests, decoded and checked by the gateway before anything reaches a worker.

Every API hands its images here as text: base64 (Ollama's `images`, Anthropic's base64
source), a `data:` URL (OpenAI's `image_url`, the Responses API's `input_image`), or an
`http(s)` URL (OpenAI, Responses, Anthropic's url source). What a worker receives is the
image file's own bytes (`ChatMessage.images`), each of them:

- valid base64 (strict: the standard alphabet with its padding; line breaks are dropped as
  Go's decoder, which Ollama uses, drops them), checked against the byte cap from its length
  before it is decoded;
- at most `max_image_bytes` bytes;
- a file Pillow reads as PNG, JPEG, WebP, GIF (a worker takes its first frame) or BMP,
  sniffed from its bytes (a data URL's or a media_type's claim is not trusted; it only has
  to name an image type);
- at most `max_image_pixels` pixels, read from the header: Pillow's lazy open reads the size
  without decoding the pixels, and its own decompression-bomb check is subsumed by this one.
  A PNG's chunks are checked whole (CRCs, no decompression), so a cut or corrupt PNG is
  refused here rather than in a worker;
- one of at most `max_images` in the request.

`http(s)` URLs are fetched only when `image_urls` is on (off by default: a 400 says so),
with httpx on the event loop (never blocking it), within `image_url_timeout` seconds in all,
the byte cap and what is left of the request's `max_body_bytes` after its earlier fetched
images; only public addresses, pinned, redirects checked, every failure the same 400
(gateway/content/image_fetch.py).

Every refusal is a 400 in the caller's API's shape that names the field (its `param` is the
request's top-level field, its message the exact place, e.g.
`messages[0].content[1].image_url`). The settings are in protocol/config/.
"""

from __future__ import annotations

import asyncio
import binascii
import importlib
import io
import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from npu_proxy.gateway.content.image_fetch import GENERIC, MAX_URL_CHARS, FetchRefused, fetch
from npu_proxy.gateway.core.errors import GatewayError, invalid
from npu_proxy.protocol.config import Config

if TYPE_CHECKING:
    from PIL import Image

log = logging.getLogger(__name__)
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
_LINE_BREAKS = str.maketrans("", "", "\r\n")


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int = 20 * 1024 * 1024
    max_pixels: int = 40_000_000
    max_count: int = 16
    urls: bool = False
    url_timeout: float = 10.0
    # Bytes all the images fetched for one request may add to it (its max_body_bytes).
    fetched_bytes: int = 32 * 1024 * 1024

    @classmethod
    def from_config(cls, config: Config) -> ImageLimits:
        return cls(config.max_image_bytes, config.max_image_pixels, config.max_images,
                   config.image_urls, config.image_url_timeout, config.max_body_bytes)


def _bad(field: str, param: str, why: str) -> GatewayError:
    return invalid(f"{field}: {why}", param=param)


def decode_base64_image(text: str, field: str, limits: ImageLimits,
                        param: str | None = None) -> bytes:
    """An image sent as base64, or as a data URL: its checked bytes. `field` names the place
    in the request, `param` the top-level field (default: `field`)."""
    param = param or field
    if text.startswith("data:"):
        return decode_data_url(text, field, limits, param)
    return check_image(_b64decode(text, field, param, limits), field, limits, param)


def decode_data_url(url: str, field: str, limits: ImageLimits,
                    param: str | None = None) -> bytes:
    """`data:image/<type>[;params];base64,<data>`: its checked bytes."""
    param = param or field
    head, comma, data = url.partition(",")
    if not head.startswith("data:") or not comma:
        raise _bad(field, param, "not a data URL (data:image/<type>;base64,<data>)")
    parts = head[5:].split(";")
    if parts[-1].strip().lower() != "base64":
        raise _bad(field, param, "a data URL of an image must be base64 "
                   "(data:image/<type>;base64,<data>)")
    media = parts[0].strip().lower()
    if media and not media.startswith("image/"):
        raise _bad(field, param, f"a data URL of type {media[:64]!r} is not an image")
    return check_image(_b64decode(data, field, param, limits), field, limits, param)


def _b64decode(text: str, field: str, param: str, limits: ImageLimits) -> bytes:
    text = text.translate(_LINE_BREAKS)
    if not text:
        raise _bad(field, param, "the image is empty")
    if len(text) // 4 * 3 > limits.max_bytes + 2:
        raise _too_large(field, param, len(text) // 4 * 3, limits)
    try:
        return binascii.a2b_base64(text.encode("ascii"), strict_mode=True)
    except (binascii.Error, UnicodeEncodeError):
        raise _bad(field, param, "not valid base64") from None


def _too_large(field: str, param: str, size: int, limits: ImageLimits) -> GatewayError:
    return _bad(field, param, f"the image is {size} bytes, more than the {limits.max_bytes} "
                "this server takes (max_image_bytes)")


def _too_many_pixels(field: str, param: str, pixels: str, limits: ImageLimits
                     ) -> GatewayError:
    return _bad(field, param, f"the image has {pixels} pixels, more than the "
                f"{limits.max_pixels} this server takes (max_image_pixels)")


def check_image(data: bytes, field: str, limits: ImageLimits, param: str | None = None
                ) -> bytes:
    """`data` itself if it is an image within the limits, else the 400 that says why."""
    param = param or field
    if not data:
        raise _bad(field, param, "the image is empty")
    if len(data) > limits.max_bytes:
        raise _too_large(field, param, len(data), limits)
    unreadable = _bad(field, param, "not an image this server reads (PNG, JPEG, WebP, GIF "
                      "or BMP), or a corrupt one")
    from PIL import Image  # NOTE: loaded by then (_pillow_ready), a dict lookup

    try:
        kind, width, height = _header(data)
    except Image.DecompressionBombError:
        raise _too_many_pixels(field, param, "too many", limits) from None
    except Exception:  # NOTE: Pillow's readers raise many kinds on hostile bytes
        raise unreadable from None
    if width < 1 or height < 1:
        raise _bad(field, param, f"the image is {width}x{height} pixels")
    if width * height > limits.max_pixels:
        raise _too_many_pixels(field, param, f"{width}x{height}", limits)
    if kind == "PNG":
        try:
            _verify(data)
        except Exception:  # NOTE: as above
            raise unreadable from None
    return data


def _open(data: bytes) -> Image.Image:
    from PIL import Image

    with warnings.catch_warnings():
        # NOTE: the pixel cap is checked by the caller; Pillow's warning would only repeat it.
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        return Image.open(io.BytesIO(data), formats=FORMATS)


def _header(data: bytes) -> tuple[str, int, int]:
    """The format and size a file's header gives, without decoding its pixels; raises if
    Pillow cannot read it."""
    with _open(data) as img:
        return str(img.format), int(img.size[0]), int(img.size[1])


def _verify(data: bytes) -> None:
    """Every chunk of a PNG read and its CRC checked (the pixels are not decompressed)."""
    with _open(data) as img:
        img.verify()


async def fetch_image(url: str, field: str, limits: ImageLimits, param: str | None = None,
                      cap: int | None = None) -> bytes:
    """An http(s) image URL's checked bytes (at most `cap`, default the image cap), if this
    server fetches URLs; every failure is the same 400 (gateway/content/image_fetch.py)."""
    param = param or field
    if not limits.urls:
        raise _bad(field, param, "image URLs are not fetched by this server (image_urls is off "
                   "in its configuration); send the image inline as base64 or a data: URL")
    cap = limits.max_bytes if cap is None else min(cap, limits.max_bytes)
    try:
        data = await fetch(url, cap, limits.url_timeout)
        await _pillow_ready()
        return check_image(data, field, limits, param)
    except (FetchRefused, GatewayError) as exc:
        log.info("image URL in %s not fetched: %s", field, exc)
        raise _bad(field, param, GENERIC) from None


def _http_url(url: str, field: str, param: str) -> None:
    try:
        parts = urlsplit(url)
    except ValueError:
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or \
            len(url) > MAX_URL_CHARS:
        raise _bad(field, param, "an image URL must be an http(s) URL or a data: URL")


# Images sent inline with more base64 than this are decoded and checked in a thread: a 20 MiB
# one takes tens of milliseconds, which every other stream of the gateway would wait out.
OFF_LOOP_CHARS = 256 * 1024


_pillow = False


async def _pillow_ready() -> None:
    """Pillow imported: by the preload thread an embedding or speech request began
    (gateway/http/preload.py), else here in a thread, never on the event loop."""
    global _pillow
    if not _pillow:
        # NOTE: not a sys.modules check: a module is listed there while another thread is
        # still importing it, and using it then would wait for that import on the loop.
        await asyncio.to_thread(importlib.import_module, "PIL.Image")
        _pillow = True


async def _off_loop(decode: Callable[[str, str, ImageLimits, str], bytes], text: str,
                    field: str, limits: ImageLimits, param: str) -> bytes:
    """`decode(text, ...)`, in a worker thread when `text` is large."""
    await _pillow_ready()
    if len(text) < OFF_LOOP_CHARS:
        return decode(text, field, limits, param)
    return await asyncio.to_thread(decode, text, field, limits, param)


class Images:
    """One request's images: counted against `max_count`, each decoded (or fetched) and
    checked. A translator makes one per request and hands it every image it meets."""

    def __init__(self, limits: ImageLimits) -> None:
        self.limits = limits
        self.count = 0
        self.fetched = 0

    def _one_more(self, field: str, param: str) -> None:
        self.count += 1
        if self.count > self.limits.max_count:
            raise _bad(field, param, f"more than {self.limits.max_count} images in one request "
                       "(max_images)")

    async def base64(self, text: object, field: str, param: str) -> bytes:
        """Base64 (or a data URL), as Ollama and Anthropic send it."""
        self._one_more(field, param)
        if not isinstance(text, str):
            raise _bad(field, param, "an image must be a base64 string")
        return await _off_loop(decode_base64_image, text, field, self.limits, param)

    async def url(self, url: object, field: str, param: str) -> bytes:
        """A data URL or an http(s) URL, as OpenAI sends it."""
        self._one_more(field, param)
        if not isinstance(url, str):
            raise _bad(field, param, "an image URL must be a string")
        if url.startswith("data:"):
            return await _off_loop(decode_data_url, url, field, self.limits, param)
        _http_url(url, field, param)
        # NOTE: what URLs bring counts against the request's own size, as if sent inline.
        data = await fetch_image(url, field, self.limits, param,
                                 cap=self.limits.fetched_bytes - self.fetched)
        self.fetched += len(data)
        return data
