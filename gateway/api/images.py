"""Images in requests: decoded and checked here, before anything reaches a worker.

`decode_data_url` turns a `data:image/...;base64,...` URL (OpenAI's `image_url`) into the
file's bytes; `check_image` reads the file's header with Pillow and refuses what is not an
image of a known format, too large in bytes or in pixels, or corrupt. Every refusal is a
`GatewayError` 400, which each API answers in its own error shape. The `vlm` worker decodes the
pixels (workers/vlm_engine.py). Pillow only parses the header and verifies the file here; the
full decode (the costly part) happens in the worker, never on the gateway's event loop.
"""

from __future__ import annotations

import base64
import binascii
import io
import warnings

from PIL import Image

from gateway.core.errors import GatewayError, invalid

# The most bytes one image file may have, and the most pixels (width x height).
MAX_IMAGE_BYTES = 20 * 1024 * 1024
MAX_IMAGE_PIXELS = 40_000_000
FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP")


def decode_data_url(url: object, param: str = "messages") -> bytes:
    """The image file a `data:image/<type>;base64,<data>` URL holds (checked)."""
    if not isinstance(url, str):
        raise invalid("an image URL must be a string", param=param)
    if not url.startswith("data:"):
        scheme = url.split(":", 1)[0][:16] if ":" in url else ""
        raise invalid(f"only data URLs (data:image/png;base64,...) are taken as images here, "
                      f"not {scheme or 'this'} URLs", param=param)
    head, sep, payload = url[5:].partition(",")
    if not sep or not head.endswith(";base64") or not head.lower().startswith("image/"):
        raise invalid("an image data URL must look like data:image/<type>;base64,<data>",
                      param=param)
    if len(payload) > (MAX_IMAGE_BYTES * 4) // 3 + 4:
        raise too_large(param)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise invalid("an image data URL's data is not valid base64", param=param) from None
    check_image(data, param)
    return data


def too_large(param: str) -> GatewayError:
    return invalid(f"an image is larger than {MAX_IMAGE_BYTES // (1024 * 1024)} MiB",
                   param=param)


def check_image(data: bytes, param: str = "messages") -> None:
    """Refuse (400) what is not a PNG/JPEG/GIF/WebP/BMP file within the size limits."""
    if len(data) > MAX_IMAGE_BYTES:
        raise too_large(param)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as img:
                kind, width, height = img.format, img.width, img.height
                if width * height > MAX_IMAGE_PIXELS:
                    raise invalid(f"an image is {width}x{height} pixels; at most "
                                  f"{MAX_IMAGE_PIXELS} pixels are taken", param=param)
                img.verify()
    except GatewayError:
        raise
    except Exception:  # NOTE: Pillow raises many kinds for a file it cannot read
        raise invalid("an image is corrupt or not in a supported format "
                      f"({', '.join(FORMATS)})", param=param) from None
    if kind not in FORMATS:
        raise invalid(f"an image is {kind}; supported: {', '.join(FORMATS)}", param=param)
