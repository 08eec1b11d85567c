"""One generation request inside a worker: checked and tokenized (`TokenizedRequest`), then
running (`Active`): its tokens turned into text, log-probabilities and, at its end, timings."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from npu_proxy.protocol.messages import Finished, Generate, TokenLogprob
from npu_proxy.protocol.timings import Timings
from npu_proxy.workers.generation.detok import ByteDetokenizer, Detokenizer, TokenBytes

log = logging.getLogger(__name__)


@dataclass
class TokenizedRequest:
    """A request that passed the checks, tokenized, with its generation config."""

    req: Generate
    ids: np.ndarray[Any, Any]
    config: Any  # ov_genai.GenerationConfig
    received: float
    context: int = 0  # the context it runs in (Accepted.context)
    dropped: int = 0  # messages dropped to fit it (Accepted.dropped)
    # Tokens at the end of `ids` generated before a worker died (Generate.resume).
    resumed: int = 0

    @property
    def prompt_tokens(self) -> int:
        return int(self.ids.shape[1]) - self.resumed


# What a request's next Delta carries: its text, the tokens sent with it, their logprobs
# (None when the request did not ask) and their ids.
Pending = tuple[str, int, list[TokenLogprob] | None, list[int]]


@dataclass
class Active:
    """One request being generated: its pipeline handle, text not yet sent, and counters."""

    req: Generate
    # The ContinuousBatchingPipeline's GenerationHandle; None in the serial engine, whose
    # streamer callback stops a cancelled request on its next token.
    handle: Any
    streamer: ByteDetokenizer | Detokenizer
    prompt_tokens: int
    received: float
    added: float
    seq: int = 1
    completion_tokens: int = 0
    first: float = 0.0
    text: list[str] = field(default_factory=list)
    finish_reason: str = "stop"
    # Why it was stopped early ("abort", "timeout"); "" while it runs to its end.
    cancelled: str = ""
    # Tokens not sent yet with their logprobs, when the request asked (else None); the last
    # ones wait while their character is incomplete.
    logprobs: list[TokenLogprob] | None = None
    # How many of the streamer's ids have been sent (a resumed request's start sent).
    sent: int = 0
    # Prompt ids the pipeline still has to give back, with their logprobs, before the
    # generated ones (SamplingParams.prompt_logprobs); and those given back so far.
    echo: int = 0
    prompt: list[TokenLogprob] = field(default_factory=list)
    prompt_ids: list[int] = field(default_factory=list)
    prompt_streamer: ByteDetokenizer | Detokenizer | None = None

    def resume(self, ids: list[int]) -> None:
        """Continue after `ids`, generated and sent before a worker died: the detokenizer
        reads them (their text is not sent again) and they count as generated."""
        self.streamer.prime(ids)
        self.completion_tokens = self.sent = len(ids)

    def cancel(self, reason: str) -> None:
        self.cancelled = reason
        if self.handle is not None:
            self.handle.cancel()

    def cancel_if_late(self, now: float) -> None:
        if not self.cancelled and now > self.req.deadline:
            self.cancel("timeout")

    def take_prompt(self, ids: list[int], logprobs: list[float],
                    token_bytes: TokenBytes) -> tuple[list[int], list[float]]:
        """Keep the echoed prompt's ids at the start of `ids` (with their logprobs); what
        follows them, the generated tokens, is returned."""
        n = min(self.echo, len(ids))
        streamer = self.prompt_streamer
        assert streamer is not None
        for i in range(n):
            first = not self.prompt and i == 0
            piece = streamer.push([ids[i]])
            logprob = float("nan") if first or i >= len(logprobs) else float(logprobs[i])
            self.prompt.append(TokenLogprob(text=piece, data=token_bytes(ids[i]),
                                            logprob=logprob))
        self.prompt_ids += ids[:n]
        self.echo -= n
        if not self.echo and self.prompt:
            rest = streamer.flush()
            if rest:
                last = self.prompt[-1]
                self.prompt[-1] = TokenLogprob(last.text + rest, last.data, last.logprob)
        return ids[n:], logprobs[n:]

    def take(self, ids: list[int], now: float, logprobs: list[float] | None,
             token_bytes: TokenBytes) -> None:
        """New tokens; `logprobs` (one per token) when the request asked for them."""
        if not self.first:
            self.first = now
        self.completion_tokens += len(ids)
        if self.logprobs is None:
            text = self.streamer.push(ids)
            if text:
                self.text.append(text)
        else:
            self._take_logprobs(ids, logprobs or [], token_bytes)

    def _take_logprobs(self, ids: list[int], logprobs: list[float],
                       token_bytes: TokenBytes) -> None:
        """One token at a time, so that each has its own piece of the text."""
        assert self.logprobs is not None
        if len(logprobs) != len(ids):
            # NOTE: never seen (speculative steps included); a value is never made up, and
            # the engine thread must not raise: the request ends here instead.
            shown = self.req.log_id or self.req.id
            log.error("request_id=%s: %d log-probabilities for %d tokens; stopping it", shown,
                      len(logprobs), len(ids), extra={"request_id": shown})
            self.cancel("abort")
            return
        for token, logprob in zip(ids, logprobs, strict=True):
            piece = self.streamer.push([token])
            self.logprobs.append(TokenLogprob(text=piece, data=token_bytes(token),
                                              logprob=float(logprob)))

    def pending(self) -> Pending | None:
        """What is ready to be sent (None: nothing); the tokens of an incomplete character
        wait, with their logprobs."""
        if self.logprobs is None:
            if not self.text:
                return None
            chunk = "".join(self.text)
            self.text.clear()
            return chunk, self.completion_tokens, None, self._ids(self.streamer.released)
        waiting = len(self.streamer.ids) - self.streamer.released
        ready = len(self.logprobs) - waiting
        if ready <= 0:
            return None
        entries, self.logprobs = self.logprobs[:ready], self.logprobs[ready:]
        return ("".join(e.text for e in entries), self.completion_tokens - waiting, entries,
                self._ids(self.sent + ready))

    def _ids(self, until: int) -> list[int]:
        """The ids not sent yet up to `until`, now sent."""
        ids, self.sent = self.streamer.ids[self.sent:until], until
        return ids

    def close(self) -> None:
        """The text the detokenizer still holds, added to what is pending."""
        rest = self.streamer.flush()
        if rest and self.logprobs:
            last = self.logprobs[-1]
            self.logprobs[-1] = TokenLogprob(last.text + rest, last.data, last.logprob)
        elif rest:
            self.text.append(rest)

    def finished(self) -> Finished:
        """The request's last frame, with its timings."""
        end = time.time()
        first = self.first or end
        timings = Timings(
            queue_ns=int((self.added - self.received) * 1e9),
            prompt_ns=int((first - self.added) * 1e9),
            decode_ns=int((end - first) * 1e9),
            total_ns=int((end - self.received) * 1e9),
        )
        return Finished(id=self.req.id, seq=self.seq,
                        finish_reason=self.cancelled or self.finish_reason,
                        prompt_tokens=self.prompt_tokens,
                        completion_tokens=self.completion_tokens, timings=timings)
