"""Reasoning handed to a client and read back: Responses `encrypted_content`.

A client that keeps no state on the server (`store: false`, as Codex) asks for
`include: ["reasoning.encrypted_content"]` and replays each reasoning item with the next
request. The item's `encrypted_content` is base64url of a version byte, the reasoning as msgspec
JSON, and an HMAC-SHA256 of both under a secret made when the gateway starts: what comes back
is what this instance handed out, so it may go into the prompt as the assistant's reasoning.
It is authenticated, not hidden: the text is the model's reasoning the client may see anyway.
A blob that does not verify (tampered, or from before a restart) opens to None and the
request goes on without it, named in the ignored header.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import secrets

import msgspec

VERSION = b"\x01"
_MAC = 32


class _Sealed(msgspec.Struct):
    text: str


class Sealer:
    def __init__(self, key: bytes | None = None) -> None:
        self._key = key or secrets.token_bytes(32)

    def _mac(self, data: bytes) -> bytes:
        return hmac.new(self._key, data, hashlib.sha256).digest()

    def seal(self, text: str) -> str:
        data = VERSION + msgspec.json.encode(_Sealed(text))
        return base64.urlsafe_b64encode(data + self._mac(data)).decode("ascii")

    def open(self, blob: object) -> str | None:
        """The reasoning text, or None when the blob is not one this instance sealed."""
        if not isinstance(blob, str):
            return None
        try:
            raw = base64.urlsafe_b64decode(blob.encode("ascii"))
        except (binascii.Error, ValueError, UnicodeEncodeError):
            return None
        data, mac = raw[:-_MAC], raw[-_MAC:]
        if len(raw) <= _MAC or not data.startswith(VERSION) or \
                not hmac.compare_digest(mac, self._mac(data)):
            return None
        try:
            return msgspec.json.decode(data[1:], type=_Sealed).text
        except msgspec.DecodeError:
            return None
