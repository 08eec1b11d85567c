"""A prompt against a worker's limits: the context a request runs in, its prompt measured
(refused unread when its length alone is too much), a history cut to fit (Generate.truncate),
and the /tokenize and /detokenize answers."""

from __future__ import annotations

import logging
from typing import Any

import msgspec
import numpy as np

from npu_proxy.protocol.messages import (
    Detokenize,
    Detokenized,
    ErrorCode,
    Failed,
    Generate,
    SamplingParams,
    TokenCount,
    Tokenize,
)
from npu_proxy.workers.generation.prompting import Prompting
from npu_proxy.workers.generation.sampling import reply_reserve, trim_history, wanted_tokens

log = logging.getLogger(__name__)


def too_long(rid: str, text: str, floor: int, limit: int, elsewhere: bool) -> Failed:
    """A prompt refused on its length in characters, without tokenizing it."""
    # NOTE: prompt_tokens stays unset: the prompt was not counted, `floor` is a bound.
    return Failed(id=rid, seq=0, code=ErrorCode.PROMPT_TOO_LONG,
                  message=f"prompt is {len(text)} characters, so at least {floor} tokens; "
                          f"this worker takes at most {limit}",
                  retry_elsewhere=elsewhere, limit=limit, floor=floor)


def context_for(req: Generate, context_length: int) -> int:
    """The context this request runs in: the model's, or a smaller num_ctx."""
    asked = req.params.num_ctx
    if asked is None or asked <= 0 or asked == context_length:
        return context_length
    if asked > context_length:
        shown = req.log_id or req.id
        log.info("request_id=%s: num_ctx %d is more than the model's context, %d tokens: "
                 "using %d", shown, asked, context_length, context_length,
                 extra={"request_id": shown})
        return context_length
    return asked


def measure(prompting: Prompting, req: Generate, limit: int) -> tuple[Any, Failed | None]:
    """The prompt's token ids, or the refusal of a prompt over `limit`. Ids given by the
    client (Generate.prompt_ids) are checked against the vocabulary (a ValueError)."""
    if req.prompt_ids is not None:
        prompting.check_ids(req.prompt_ids)
        ids = np.asarray(req.prompt_ids, dtype=np.int64).reshape(1, -1)
    else:
        text = prompting.render(req)
        floor = prompting.fewest_tokens(text)
        if floor > limit:
            return None, too_long(req.id, text, floor, limit, False)
        ids = prompting.encode(text)
    n = int(ids.shape[1])
    if n > limit:
        return ids, Failed(id=req.id, seq=0, code=ErrorCode.PROMPT_TOO_LONG,
                           message=f"prompt is {n} tokens, this worker takes at most {limit}",
                           prompt_tokens=n, limit=limit)
    return ids, None


def fit(prompting: Prompting, req: Generate, limit: int, context: int,
        elsewhere: bool) -> tuple[Generate, Any, int] | Failed:
    """The request, its prompt's ids and how many messages were dropped to fit the context
    with room for the reply (Generate.truncate); or why it cannot run here."""
    ids, failed = measure(prompting, req, limit)
    room = context - (limit + 1 if failed is not None else int(ids.shape[1]))
    reserve = reply_reserve(req.params.max_tokens, context)
    # NOTE: where another worker may take a longer prompt (the NPU's), it is sent there
    # whole rather than cut here.
    if req.truncate and req.messages and not elsewhere and room < reserve:
        def count(trial: Generate) -> int | None:
            probe, over = measure(prompting, trial, limit)
            return None if over is not None else int(probe.shape[1])

        cut, k = trim_history(req, count, context - reserve)
        cut_ids, over = measure(prompting, cut, limit) if k else (ids, failed)
        if k and over is None:  # NOTE: else as it came, or refused with its whole count
            shown = req.log_id or req.id
            log.info("request_id=%s: dropped the %d oldest of %d messages to fit the "
                     "context of %d tokens", shown, k, len(req.messages), context,
                     extra={"request_id": shown})
            return cut, cut_ids, k
    if failed is not None:
        failed.retry_elsewhere, failed.context = elsewhere, context
        return failed
    return req, ids, 0


def token_count(prompting: Prompting, msg: Tokenize) -> TokenCount | Failed:
    """A /tokenize answer: the prompt's count (and its tokens, when asked)."""
    try:
        text = prompting.render(msg)
        floor = prompting.fewest_tokens(text)
        if floor > prompting.context_length:
            return too_long(msg.id, text, floor, prompting.context_length, False)
        ids = prompting.encode(text, msg.add_special_tokens)
    except Exception as exc:  # a template or tokenizer error is the request's fault
        return Failed(id=msg.id, seq=0, code=ErrorCode.BAD_REQUEST, message=str(exc))
    count = TokenCount(id=msg.id, seq=0, count=int(ids.shape[1]))
    if msg.want_tokens:
        count.tokens = [int(t) for t in ids[0]]
        entry = prompting.token_bytes.entry
        count.pieces = [entry(t).decode("utf-8", "replace") for t in count.tokens]
    return count


def detokenized(prompting: Prompting, msg: Detokenize) -> Detokenized | Failed:
    """A /detokenize answer: the tokens' text, or a 400 for an id out of range."""
    try:
        text = prompting.decode(msg.tokens)
    except Exception as exc:  # an id out of range is the request's fault
        return Failed(id=msg.id, seq=0, code=ErrorCode.BAD_REQUEST, message=str(exc))
    return Detokenized(id=msg.id, seq=0, text=text,
                       specials=prompting.specials() if msg.specials else {})


def resumed(ids: np.ndarray[Any, Any], resume: list[int], params: SamplingParams,
            limit: int) -> tuple[np.ndarray[Any, Any] | None, SamplingParams]:
    """The prompt's ids followed by the tokens generated before a worker died, and the
    parameters with what is left of max_tokens; None when they no longer fit `limit`."""
    if int(ids.shape[1]) + len(resume) > limit:
        return None, params
    joined = np.concatenate([ids, np.asarray([resume], dtype=ids.dtype)], axis=1)
    left = max(1, wanted_tokens(params.max_tokens) - len(resume))
    return joined, msgspec.structs.replace(params, max_tokens=left)
