"""A worker's death loses no stream (issue 43, point 5): streams in flight when their worker is
SIGKILLed resume on the restarted worker from their prompt and the tokens already sent
(Generate.resume); the client sees a pause, then the rest of the text it would have had.

The server runs `stream_resumes = 1` (the default; the other test servers turn it off) and
a deterministic llm worker (one sequence per step, no prefix cache), so each greedy text is
the text it gets alone: comparing free texts is allowed here for the reason
test_deterministic.py gives.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest
from serverctl import HELD, Server, held_faults, wait_for, wait_row

from npu_proxy.gateway.core.resume import Diverged, Isolation, Replay, Resumer
from npu_proxy.protocol.messages import (
    ChatMessage,
    Delta,
    Finished,
    Generate,
    SamplingParams,
    TokenLogprob,
    ToolTag,
    ToolTags,
)
from npu_proxy.protocol.timings import Timings

LLM = "smollm2:135m"
TOPICS = ["a lighthouse keeper", "a lost robot", "the first snow of winter", "a river town",
          "an old clockmaker", "a night market", "a desert caravan", "a mountain school"]
TOKENS = 48


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("resume")
    server = Server(tmp, workers=[
        {"name": "llm", "role": "llm", "deterministic": True, "max_queue": 16,
         "faults": held_faults(tmp)}],
        stream_resumes=1, crash_quarantine_seconds=300.0, backoff_initial=0.2)
    yield server.start()
    server.stop()


def _body(topic: str) -> dict[str, Any]:
    return {"model": LLM, "temperature": 0, "max_tokens": TOKENS,
            "messages": [{"role": "user", "content": f"Write a short story about {topic}."}],
            "extra_body": {"ignore_eos": True}}


class Reader:
    """One streamed chat read with the OpenAI SDK in a thread."""

    def __init__(self, client: openai.OpenAI, topic: str,
                 pool: concurrent.futures.ThreadPoolExecutor, rid: str = "") -> None:
        self.chunks: list[str] = []
        self.finish: str | None = None
        self.usage: Any = None
        self.started = threading.Event()
        self.future = pool.submit(self._run, client, topic, rid)

    def _run(self, client: openai.OpenAI, topic: str, rid: str) -> None:
        stream = client.chat.completions.create(
            stream=True, stream_options={"include_usage": True},
            extra_headers={"X-Request-ID": rid} if rid else None, **_body(topic))
        for chunk in stream:
            if chunk.usage is not None:
                self.usage = chunk.usage
            for choice in chunk.choices:
                if choice.delta.content:
                    self.chunks.append(choice.delta.content)
                    if len(self.chunks) >= 3:
                        self.started.set()
                if choice.finish_reason:
                    self.finish = choice.finish_reason


def _resumptions(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("npu_proxy_stream_resumptions_total{"))


def test_greedy_streams_killed_mid_way_end_with_their_own_texts(srv: Server) -> None:
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=300)
    alone = {}
    for topic in TOPICS:
        reply = client.chat.completions.create(**_body(topic))
        assert reply.usage is not None and reply.usage.completion_tokens == TOKENS
        alone[topic] = reply.choices[0].message.content
    old_pid = int(srv.children()["llm"]["pid"])
    # NOTE: the worker runs one sequence at a time. The first stream is taken and held before
    # it generates (fault hook), so the other seven and a whole (non-streamed) answer are
    # all accepted and waiting behind it whatever the machine's speed; then every gate
    # opens, and the worker dies in the middle of the first stream's text. The whole one,
    # last in the queue, says in its headers (made once it is whole) that it went on after
    # its worker died.
    rids = [f"{HELD}{i}" for i in range(len(TOPICS))] + [f"{HELD}whole"]
    with concurrent.futures.ThreadPoolExecutor(len(TOPICS) + 1) as pool:
        readers = [Reader(client, TOPICS[0], pool, rids[0])]
        wait_row(srv, "llm", lambda row: row["in_flight"] == 1)
        readers += [Reader(client, topic, pool, rid)
                    for topic, rid in zip(TOPICS[1:], rids[1:], strict=False)]
        whole = pool.submit(httpx.post, srv.url + "/v1/chat/completions", timeout=600,
                            headers={"X-Request-ID": rids[-1]},
                            json={k: v for k, v in _body(TOPICS[0]).items()
                                  if k != "extra_body"} | {"ignore_eos": True})
        wait_row(srv, "llm", lambda row: row["queue"] == len(TOPICS))
        for rid in rids:
            (srv.gates / rid).touch()
        assert readers[0].started.wait(120), "the first stream sent no text"
        os.kill(old_pid, signal.SIGKILL)
        for reader in readers:
            reader.future.result(timeout=600)
        answer = whole.result(timeout=600)
    assert answer.status_code == 200
    assert answer.json()["choices"][0]["message"]["content"] == alone[TOPICS[0]]
    assert re.fullmatch(r"(replayed|continued) after \d+ tokens",
                        answer.headers.get("x-npu-proxy-resumed", "")), answer.headers
    for topic, reader in zip(TOPICS, readers, strict=True):
        assert "".join(reader.chunks) == alone[topic], topic
        assert reader.finish == "length"
        assert reader.usage is not None and reader.usage.completion_tokens == TOKENS
    assert int(srv.children()["llm"]["pid"]) != old_pid
    assert _resumptions(srv.url) >= 1
    # NOTE: the gateway logs through a queue: waited for, not read at once.
    wait_for(lambda: "resumes (replayed) after" in srv.worker_log("gateway"), timeout=30,
             what="the replay in the gateway's log")
    # A resumed request was no crash's suspect: sent again, it is served, not quarantined.
    again = client.chat.completions.create(**_body(TOPICS[0]))
    assert again.choices[0].message.content == alone[TOPICS[0]]


@pytest.fixture(scope="module")
def batching(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # NOTE: a request whose X-Request-ID starts with "poison-" makes the worker exit at its
    # first token (a test hook); others run as ever, each token 50 ms apart at least: a
    # stream is still running seconds after its first tokens, however fast the machine (a
    # kill or a poison meant for its middle landed within ~0.5 s of its end before).
    server = Server(tmp_path_factory.mktemp("resume-batching"), workers=[
        {"name": "llm", "role": "llm", "faults": {"exit_on_request": "poison-",
                                                  "token_delay_seconds": 0.05}}],
        stream_resumes=1, backoff_initial=0.2, crash_quarantine_seconds=300.0).start()
    yield server
    server.stop()


def test_a_stream_on_a_batching_worker_continues_after_its_tokens(batching: Server) -> None:
    """Not deterministic: the stream is continued from its prompt and the tokens it sent (one
    prompt pass), so its text is not compared, only its shape: no error, every token asked
    for, the prompt counted as the client sent it. On the legacy completions API: every API
    reads the same resumed generation."""
    client = openai.OpenAI(base_url=batching.url + "/v1", api_key="x", max_retries=0,
                           timeout=300)
    ask: dict[str, Any] = {"model": LLM, "prompt": f"A story about {TOPICS[0]}:",
                           "max_tokens": TOKENS, "temperature": 0,
                           "extra_body": {"ignore_eos": True}}
    alone = client.completions.create(**ask)
    assert alone.usage is not None
    pid = int(batching.children()["llm"]["pid"])
    texts: list[str] = []
    finish, usage = None, None
    for chunk in client.completions.create(stream=True, stream_options={"include_usage": True},
                                           **ask):
        for choice in chunk.choices:
            texts.append(choice.text)
            finish = choice.finish_reason or finish
            if len(texts) == 4:
                os.kill(pid, signal.SIGKILL)
        usage = chunk.usage or usage
    assert finish == "length" and len(texts) > 4
    assert usage is not None and usage.completion_tokens == TOKENS
    assert usage.prompt_tokens == alone.usage.prompt_tokens
    wait_for(lambda: "resumes (continued) after" in batching.worker_log("gateway"),
             timeout=30, what="the continuation in the gateway's log")
    assert _resumptions(batching.url) == 1
    assert int(batching.children()["llm"]["pid"]) != pid


def _stream(url: str, request_id: str, started: threading.Event) -> dict[str, Any]:
    """A streamed legacy completion of TOKENS tokens: its text, finish reason, usage and
    error as the client saw them; `started` set at its first text."""
    body = {"model": LLM, "prompt": f"A story about {request_id}:", "max_tokens": TOKENS,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    seen: dict[str, Any] = {"text": "", "finish": None, "usage": None, "error": None}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600,
                      headers={"X-Request-ID": request_id}) as r:
        if r.status_code != 200:
            seen["error"] = r.read().decode()
            return seen
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                seen["error"] = chunk["error"]
            for choice in chunk.get("choices") or []:
                seen["text"] += choice.get("text") or ""
                seen["finish"] = choice.get("finish_reason") or seen["finish"]
                if seen["text"]:
                    started.set()
            seen["usage"] = chunk.get("usage") or seen["usage"]
    return seen


def test_a_poison_request_among_others_is_the_only_one_lost(batching: Server) -> None:
    """A request that crashes every worker that runs it, sent while three others stream: the
    first crash resumes all four, the poison crashes the restarted worker again with the
    three in flight, so the four are sent once more one at a time; the poison crashes its
    worker alone and is the one that fails (and is quarantined), the three end whole."""
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        events = [threading.Event() for _ in range(3)]
        innocent = [pool.submit(_stream, batching.url, f"fine-{i}", events[i])
                    for i in range(3)]
        for event in events:
            assert event.wait(120), "an innocent stream sent no text"
        poison = pool.submit(_stream, batching.url, "poison-1", threading.Event())
        lost = poison.result(timeout=600)
        seen = [f.result(timeout=600) for f in innocent]
    for one in seen:
        assert one["error"] is None, one
        assert one["finish"] == "length" and one["usage"]["completion_tokens"] == TOKENS, one
    assert lost["error"] is not None and lost["finish"] is None, lost
    wait_for(lambda: "sent again alone" in batching.worker_log("gateway"), timeout=30,
             what="the isolation in the gateway's log")
    again = httpx.post(batching.url + "/v1/completions", timeout=120,
                       headers={"X-Request-ID": "poison-2"},
                       json={"model": LLM, "prompt": "A story about poison-1:",
                             "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True})
    assert again.status_code == 400 and "crash_quarantine_seconds" in again.text, again.text
    fine = httpx.post(batching.url + "/v1/completions", timeout=120,
                      json={"model": LLM, "prompt": "A story about fine-0:", "max_tokens": 4})
    assert fine.status_code == 200, fine.text


def _plan(params: SamplingParams, images: bool = False) -> Resumer:
    msg = Generate(id="g", model=LLM, params=params, deadline=time.time() + 60,
                   messages=[ChatMessage(role="user", content="hi",
                                         images=[b"x"] if images else [])])
    links = {name: SimpleNamespace(spec=SimpleNamespace(role=role, deterministic=steady))
             for name, role, steady in (("llm", "llm", False), ("steady", "llm", True),
                                        ("vision", "vlm", False))}
    return Resumer(None, SimpleNamespace(links=links), msg, 1,  # type: ignore[arg-type]
                   Isolation())


def test_what_can_resume() -> None:
    """Free text resumes anywhere; a constrained output only before its first token (its
    grammar would start again mid-value); a call under tool_choice auto only while none is
    open; images, or anything a vlm worker ran, only before the first token (its pipeline
    reads no token ids). What cannot be continued, and what a deterministic worker ran, is
    replayed."""
    free = _plan(SamplingParams())
    assert free.allows("llm", [], "") and free.allows("llm", [1, 2], "Once upon")
    assert not free.replays("llm", [1, 2], "Once upon") and not free.replays("llm", [], "")
    assert free.replays("steady", [1, 2], "Once upon")
    assert not free.allows("vision", [1, 2], "Once") and free.replays("vision", [1, 2], "Once")
    for held in (_plan(SamplingParams(json_schema='{"type": "object"}')),
                 _plan(SamplingParams(regex="[a-z]+")), _plan(SamplingParams(), images=True)):
        assert held.allows("llm", [], "") and not held.allows("llm", [1], "{")
    bare_tag = ToolTag('{"name": "a", "arguments": ', "{}", "}")
    tags = ToolTags(("<tool_call>", '{"name"'), (
        ToolTag("<tool_call>", "{}", "</tool_call>", padded=True), bare_tag))
    marked = _plan(SamplingParams(tool_tags=tags))
    assert marked.allows("llm", [1], "Let me look.")
    assert not marked.allows("llm", [1], 'Let me look.<tool_call>\n{"name": "re')
    done = '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\nOk'
    assert marked.allows("llm", [1], done)
    assert marked.allows("llm", [1], done + done)
    # A bare call after a marked one closed, or begun in a fence, may still be held.
    assert not marked.allows("llm", [1], done + '{"name": "a", "arg')
    assert not marked.allows("llm", [1], 'Here:\n```json\n{"name": "a", "arguments": {}}')
    bare = _plan(SamplingParams(tool_tags=ToolTags(('{"name"',), (
        ToolTag('{"name": "a", "parameters": ', "{}", "}"),))))
    assert bare.allows("llm", [1], "Sure.")
    assert not bare.allows("llm", [1], '{"name": "a", "parameters": {}}')


def test_a_replay_passes_on_only_what_follows_the_clients_tokens() -> None:
    """The replayed frames' first tokens are checked against the client's and left out; a
    frame that straddles the end is cut there (text by the client's text length, logprobs by
    token); another token, or an end before the client's tokens, is a divergence."""
    replay = Replay([5, 6, 7], len("abc"))
    assert replay.take(Delta(id="r", seq=1, text="ab", tokens=2, ids=[5, 6])) is None
    lp = [TokenLogprob("c", b"c", -0.1), TokenLogprob("d", b"d", -0.2)]
    out = replay.take(Delta(id="r", seq=2, text="cd", tokens=4, logprobs=lp, ids=[7, 8]))
    assert out is not None and (out.text, out.ids, out.tokens) == ("d", [8], 4)
    assert out.logprobs == lp[1:]
    after = replay.take(Delta(id="r", seq=3, text="e", tokens=5, ids=[9]))
    assert after is not None and (after.text, after.ids) == ("e", [9])
    replay.check_end(Finished(id="r", seq=4, finish_reason="length", prompt_tokens=1,
                              completion_tokens=5, timings=Timings()))
    with pytest.raises(Diverged):
        Replay([5, 6], 2).take(Delta(id="r", seq=1, text="ax", tokens=2, ids=[5, 9]))
    short = Replay([5, 6], 2)
    assert short.take(Delta(id="r", seq=1, text="a", tokens=1, ids=[5])) is None
    with pytest.raises(Diverged):
        short.check_end(Finished(id="r", seq=2, finish_reason="stop", prompt_tokens=1,
                                 completion_tokens=1, timings=Timings()))
