"""A generation whose worker died goes on (issue 43, point 5): once a worker serves its model
again (the restarted one), it is sent again, up to `stream_resumes` times, and the client sees
a pause, not an error.

- Replayed (`Replay`): the request again, whole, with its seed; the tokens the client already
  has come first, are checked against its own and not sent. Exact where the worker computes a
  request the same way whatever runs beside it (deterministic mode), and the way on for what
  cannot be continued (a grammar, images).
- Continued (`Generate.resume`): its prompt followed by the tokens the client has, read in
  one prompt pass; what follows is generated. Cheaper, but the prompt pass computes those
  tokens' states in other shapes than decoding did, so a greedy text may part from the one it
  would have had where two choices were close (measured: SmolLM2, 40 tokens on).

A replay that gives other tokens than the client's is continued instead. A crash quarantines
a resumable request only once it gives up (gateway/core/broker.py).

A poison request (one that crashes any worker that runs it) takes the others in flight with it
at each crash, and would use up their resumptions too. So a generation that has used its
resumptions and is lost again in a crash that took others is sent once more, alone: such
generations of a model take turns (`Isolation`), one at a time on the model's workers. The
poison then crashes its worker alone, gives up and is quarantined; the others finish.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

import msgspec

from npu_proxy.gateway.core.broker import Broker
from npu_proxy.gateway.core.request_stream import RequestStream
from npu_proxy.protocol.messages import Accepted, Delta, Finished, Generate, ToolTags


@dataclass
class Resumed:
    """A generation sent again after its worker died: its new stream, the worker's Accepted
    and the deadline, moved by the wait for the worker."""

    stream: RequestStream
    accepted: Accepted
    deadline: float


@dataclass
class Isolation:
    """The turns of a model's generations sent again alone (one at a time), after crashes
    that took them with others."""

    turn: asyncio.Lock = field(default_factory=asyncio.Lock)


class Resumption(Protocol):
    """How a generation whose worker died goes on (gateway/core/router.py), once a worker
    serves its model again: replayed (the request again, whole: the tokens its client has
    come again first, are checked and not sent) or continued (sent with those tokens after
    its prompt, Generate.resume)."""

    # Resumptions left (the config's stream_resumes, less those used).
    left: int
    # Sent again alone (its turn of the model's Isolation held until it ends).
    alone: bool

    async def isolate(self, deadline: float) -> bool:
        """Wait for its turn to run alone (until `deadline`, wall clock); False if none came."""
        ...

    def release(self) -> None:
        """Its turn to run alone given up (the generation ended)."""
        ...

    def allows(self, worker: str, ids: list[int], text: str) -> bool:
        """Can it be continued after these tokens (this text), having run on `worker`?"""
        ...

    def replays(self, worker: str, ids: list[int], text: str) -> bool:
        """Is it replayed rather than continued?"""
        ...

    async def __call__(self, ids: list[int], replay: bool) -> Resumed | None:
        """Sent again; None when nothing is left to generate (its max_tokens reached)."""
        ...


class Diverged(Exception):
    """A replayed generation's tokens are not those its client already has."""


class Replay:
    """A generation sent again whole after its worker died: the tokens its client already
    has (`ids`, whose text is `chars` characters long) come first; each is checked against
    what the client has, and only what follows is passed on."""

    def __init__(self, ids: list[int], chars: int) -> None:
        self.ids = ids
        self.pos = 0
        self.chars = chars

    def take(self, frame: Delta) -> Delta | None:
        """The part of `frame` past the replayed tokens, or None; Diverged when a token
        differs from the one the client has."""
        fresh: list[int] = []
        for i, token in enumerate(frame.ids):
            if self.pos >= len(self.ids):
                fresh = frame.ids[i:]
                break
            if token != self.ids[self.pos]:
                raise Diverged(f"token {self.pos} came back as {token}, not "
                               f"{self.ids[self.pos]}")
            self.pos += 1
        cut = min(len(frame.text), self.chars)
        self.chars -= cut
        if not fresh and cut == len(frame.text):
            return None
        logprobs = frame.logprobs[len(frame.ids) - len(fresh):] if frame.logprobs else None
        return Delta(id=frame.id, seq=frame.seq, text=frame.text[cut:], tokens=frame.tokens,
                     logprobs=logprobs, ids=fresh)

    def check_end(self, finished: Finished) -> None:
        """Diverged when the replay ended before the tokens the client has."""
        if self.pos < len(self.ids):
            raise Diverged(f"it ended after {finished.completion_tokens} tokens")


def _open_call(text: str, tags: ToolTags) -> bool:
    """Whether `text` holds a call its constraint may still be holding: a trigger outside
    the marked calls it has closed. A bare call's end (`}`) is also inside its arguments, so
    one begun is taken as open."""
    for tag in tags.tags:
        if tag.padded:
            pos, kept = 0, []
            while (start := text.find(tag.begin, pos)) >= 0:
                end = text.find(tag.end, start + len(tag.begin))
                if end < 0:
                    break
                kept.append(text[pos:start])
                pos = end + len(tag.end)
            text = "".join(kept) + text[pos:]
    return any(trigger in text for trigger in tags.triggers)


class Resumer:
    """A generation's way on after its worker died (Generation._resume): the request again,
    replayed or continued, once a worker serves the model (a restarted one).

    What it cannot continue it replays: a constrained output past its first token (the
    grammar would start again mid-value; a tool call under tool_choice auto only while no call
    is open), or what a vlm worker ran (its pipeline reads no token ids)."""

    def __init__(self, send: Callable[[Generate], Awaitable[Resumed]], broker: Broker,
                 msg: Generate, left: int, isolation: Isolation) -> None:
        # Sends the message once a worker serves its model (Router.send_again).
        self.send = send
        self.broker = broker
        self.msg = msg
        self.left = left
        self.sent = 0
        self.isolation = isolation
        self.alone = False

    async def isolate(self, deadline: float) -> bool:
        began = time.time()
        try:
            await asyncio.wait_for(self.isolation.turn.acquire(), max(0.0, deadline - began))
        except TimeoutError:
            return False
        self.alone = True
        # NOTE: the wait for its turn moves its deadline, as the wait for a worker does.
        self.msg.deadline += time.time() - began
        return True

    def release(self) -> None:
        if self.alone:
            self.alone = False
            self.isolation.turn.release()

    def allows(self, worker: str, ids: list[int], text: str) -> bool:
        if not ids:
            return True  # NOTE: nothing was generated: the same request again
        link = self.broker.links.get(worker)
        if link is not None and link.spec.role == "vlm":
            return False  # NOTE: its pipeline reads the prompt as text, not token ids
        msg = self.msg
        params = msg.params
        if params.json_schema is not None or params.regex is not None or \
                any(m.images for m in msg.messages or []):
            return False
        tags = params.tool_tags
        if tags is None:
            return True
        return not _open_call(text, tags)

    def replays(self, worker: str, ids: list[int], text: str) -> bool:
        """Replayed when that gives the client's tokens again by construction (a deterministic
        worker: one sequence per step, no prefix cache; sampled ones keep their seed) or when
        it cannot be continued (a constrained output, images); continued otherwise, which
        costs one prompt read instead of generating the tokens again."""
        link = self.broker.links.get(worker)
        return bool(ids) and ((link is not None and link.spec.deterministic)
                              or not self.allows(worker, ids, text))

    async def __call__(self, ids: list[int], replay: bool) -> Resumed | None:
        msg = self.msg
        # NOTE: max_tokens 0 (a prompt scored, nothing generated) is sent again whole.
        if msg.params.max_tokens and len(ids) >= msg.params.max_tokens:
            return None
        # NOTE: a fresh id for each send: an aborted replay's last frames must not reach
        # the stream that continues it.
        self.sent += 1
        again = msgspec.structs.replace(msg, id=f"{msg.id}~{self.sent}",
                                        resume=[] if replay else list(ids))
        return await self.send(again)
