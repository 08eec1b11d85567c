"""The Responses API's stored responses: bounded, expiring, in the gateway's memory only.

A response created with `store: true` (OpenAI's default) is kept so that a later request can
continue it (`previous_response_id`: its conversation is prepended) and so that
`GET /v1/responses/{id}` and `DELETE /v1/responses/{id}` find it. Nothing is written to disk
and a restarted gateway has forgotten them all, as a client of a local server may expect.

Three settings of protocol/config/ bound it: `responses_store_max` responses,
`responses_store_ttl` seconds each, `responses_store_max_bytes` in all; past any of them the
oldest go first. An entry is kept encoded (the object as JSON, the conversation as MessagePack)
and decoded when read, so the byte cap bounds the memory held: decoded, an echoed schema of
`{}` holds ~24 times its JSON size. Every entry lives for the same time, so the oldest entry is also
the first to expire and insertion order is the only order kept.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from npu_proxy.protocol.config import Config
from npu_proxy.protocol.messages import ChatMessage

# NOTE: what an entry costs beside its two encodings: the Stored object, two bytes objects,
# its key and its slot in the OrderedDict.
ENTRY_OVERHEAD = 400
_history = msgspec.msgpack.Decoder(list[ChatMessage])


@dataclass(frozen=True)
class Stored:
    """One response: its object as the client saw it, and its conversation (the input items of
    every response it continues, its own input and its output; never `instructions`, which
    OpenAI does not carry over to a continuation). Both kept encoded."""

    body_json: bytes
    history_msgpack: bytes
    expires: float

    @property
    def size(self) -> int:
        return len(self.body_json) + len(self.history_msgpack) + ENTRY_OVERHEAD

    @property
    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = msgspec.json.decode(self.body_json)
        return body

    @property
    def history(self) -> list[ChatMessage]:
        return _history.decode(self.history_msgpack)


class ResponseStore:
    def __init__(self, max_count: int, ttl: float, max_bytes: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_count = max_count
        self.ttl = ttl
        self.max_bytes = max_bytes
        self.clock = clock
        self._items: OrderedDict[str, Stored] = OrderedDict()
        self._bytes = 0

    @classmethod
    def from_config(cls, config: Config) -> ResponseStore:
        return cls(config.responses_store_max, config.responses_store_ttl,
                   config.responses_store_max_bytes)

    @property
    def enabled(self) -> bool:
        return self.max_count > 0 and self.ttl > 0 and self.max_bytes > 0

    def __len__(self) -> int:
        self._expire()
        return len(self._items)

    def put(self, response_id: str, body: dict[str, Any], history: list[ChatMessage]) -> bool:
        """Keep a response; False when it cannot be kept (the store is off, or this one alone
        is larger than the whole store may be)."""
        if not self.enabled:
            return False
        item = Stored(msgspec.json.encode(body), msgspec.msgpack.encode(history),
                      self.clock() + self.ttl)
        if item.size > self.max_bytes:
            return False
        self._pop(response_id)
        self._items[response_id] = item
        self._bytes += item.size
        while len(self._items) > self.max_count or self._bytes > self.max_bytes:
            self._pop(next(iter(self._items)))
        return True

    def get(self, response_id: str) -> Stored | None:
        self._expire()
        return self._items.get(response_id)

    def delete(self, response_id: str) -> bool:
        self._expire()
        return self._pop(response_id) is not None

    def _pop(self, response_id: str) -> Stored | None:
        item = self._items.pop(response_id, None)
        if item is not None:
            self._bytes -= item.size
        return item

    def _expire(self) -> None:
        now = self.clock()
        while self._items:
            key, oldest = next(iter(self._items.items()))
            if oldest.expires > now:
                return
            self._pop(key)
