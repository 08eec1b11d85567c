"""Replies routed per gateway: a worker host shared by several gateways (each logging in with
its own CURVE client key, `client_key_files`) sends each one only its own frames, and takes
aborts only for requests that gateway sent.

A worker's `.out` socket is an XPUB in manual mode (protocol/sockets.py `configure_pub`): a
subscriber gets only what the worker grants it, whatever it asks for. Every subscription
message carries the `User-Id` that the ZAP handler gave the connection (the subscriber's
client key, checked in the CURVE handshake), so the grant is bound to the authenticated key
and a subscriber cannot pick another gateway's topic:
- `h` (heartbeats, to everyone: the supervisor and every gateway);
- its own reply topic, `reply_topic(key)`, and nothing else (not `""`, not `r`).

Requests arrive on the PULL socket with the sender's `User-Id` too. On tcp a request's id is
made `<link>|<id>` inside the worker (the link numbers the gateway's key), so ids chosen by
two gateways never meet: an Abort from one gateway names only its own requests. The frames
going out are stripped back to the gateway's id and sent on that gateway's topic.

On ipc there is no key (the private runtime folder is the boundary, one gateway): ids are
left alone and every frame goes to the one local topic, `reply_topic(b"")`, as fast as a
plain PUB.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import msgspec
import zmq

from npu_proxy.protocol.sockets import TOPIC_HEARTBEAT, reply_topic

log = logging.getLogger(__name__)

LOCAL_TOPIC = reply_topic(b"")
# NOTE: not in the Z85 alphabet of a key, and the link is digits: the first `|` ends it.
LINK_END = "|"


def user_id(frame: zmq.Frame) -> str:
    """The authenticated client key of the connection a message came on ("" without one)."""
    try:
        key = frame.get("User-Id")
    except zmq.ZMQError:
        return ""
    return key if isinstance(key, str) else ""


class ReplyRoutes:
    """Which gateway each request came from, and what each subscriber may hear.

    `tcp`: the worker's sockets are on tcp (CURVE, keys); otherwise ipc, one local gateway."""

    def __init__(self, tcp: bool) -> None:
        self.tcp = tcp
        self._links: dict[str, int] = {}
        self._topics: list[bytes] = []
        # Topics some subscriber was granted: every heartbeat goes to each (see `topics`).
        self._granted: set[bytes] = set()
        self._refused: set[str] = set()
        self._lock = threading.Lock()

    def _link(self, key: str) -> int:
        with self._lock:
            link = self._links.get(key)
            if link is None:
                link = self._links[key] = len(self._topics)
                self._topics.append(reply_topic(key.encode()))
            return link

    def _topic_of(self, key: str) -> bytes | None:
        """The one reply topic `key` may hear (None: none, a tcp peer without a key)."""
        if not self.tcp:
            return LOCAL_TOPIC
        if not key:
            return None
        return self._topics[self._link(key)]

    # --- requests in, frames out ---------------------------------------------------------

    def inbound(self, msg: Any, key: str) -> None:
        """Tie a request (or an Abort) to the gateway that sent it: its id, inside this
        worker, becomes `<link>|<id>`."""
        if self.tcp:
            msg.id = f"{self._link(key)}{LINK_END}{msg.id}"

    def outbound(self, frame: Any) -> tuple[bytes, Any]:
        """The topic of the gateway a frame is for, and the frame with that gateway's id."""
        if not self.tcp:
            return LOCAL_TOPIC, frame
        link, _, rid = frame.id.partition(LINK_END)
        return self._topics[int(link)], msgspec.structs.replace(frame, id=rid)

    @property
    def topics(self) -> list[bytes]:
        """Where a heartbeat goes: the supervisor's topic and every gateway's granted one (a
        gateway that hears a heartbeat on its own topic knows it hears its frames)."""
        return [TOPIC_HEARTBEAT, *sorted(self._granted)]

    # --- subscriptions -------------------------------------------------------------------

    def grant(self, xpub: zmq.Socket[Any]) -> None:
        """Answer the subscriptions waiting on `xpub` (manual mode): each subscriber gets
        heartbeats and its own reply topic if it asks, nothing else. Call with the socket's
        lock held."""
        while True:
            try:
                frame = xpub.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            data = frame.bytes
            if not data or data[0] not in (0, 1):
                continue
            subscribe, topic = data[0] == 1, data[1:]
            key = user_id(frame)
            allowed = topic == TOPIC_HEARTBEAT or topic == self._topic_of(key)
            if not allowed:
                # NOTE: once per key: "" or another gateway's topic would be everything
                # or someone else's text.
                if subscribe and key not in self._refused:
                    self._refused.add(key)
                    log.warning("refused a subscription to %r by client key %s: a gateway "
                                "hears heartbeats and its own replies only", topic[:48],
                                key or "(none)")
                continue
            # NOTE: in manual mode these apply to the subscriber whose message was just read.
            xpub.setsockopt(zmq.SUBSCRIBE if subscribe else zmq.UNSUBSCRIBE, topic)
            if subscribe and topic != TOPIC_HEARTBEAT:
                self._granted.add(topic)
