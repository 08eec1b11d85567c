"""A stream that fell behind its worker catches up in fewer HTTP chunks, with the same events.

The gateway's streaming path (gateway/api/request_path.py `_stream`) puts the events whose
frames were already there into one body chunk; a lone event goes out at once. Driven in
process through the real broker against a socket standing in for the worker (as
test_broker.py does), so that when frames arrive is in the test's hands; the chunks are then
read by the official OpenAI and Ollama clients.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import httpx
import ollama
import openai
import zmq
from fakeworker import LOCAL, until_heard, worker_sockets

from npu_proxy.gateway.api.dispatch import Dispatch, _stream
from npu_proxy.gateway.api.ollama.reply import OllamaReply
from npu_proxy.gateway.api.openai.chat import ChatReply
from npu_proxy.gateway.core.broker import Broker
from npu_proxy.gateway.core.generation import Generation
from npu_proxy.gateway.core.model_table import ServedModel
from npu_proxy.gateway.core.request_stream import RequestStream
from npu_proxy.gateway.http.wire import OLLAMA, OPENAI, Dialect
from npu_proxy.protocol.config import Config, WorkerSpec
from npu_proxy.protocol.liveness import Heartbeat
from npu_proxy.protocol.messages import Accepted, Delta, Finished, Generate, SamplingParams, encode
from npu_proxy.protocol.states import ProcessState
from npu_proxy.protocol.timings import Timings

TOKENS = 50
WORDS = [f"w{i} " for i in range(TOKENS)]
MODEL = "smollm2:135m"

Step = Callable[[Callable[[object], None], AsyncIterator[bytes], RequestStream],
                Awaitable[list[bytes]]]


def _run(tmp_path: Path, dialect: Dialect, step: Step) -> list[bytes]:
    """One generation through the broker and `_stream`, its frames sent by `step`; the
    HTTP body chunks `_stream` made."""
    runtime = tmp_path / "rt"
    runtime.mkdir(mode=0o700)
    config = Config(transport="ipc", runtime_dir=str(runtime),
                    workers=[WorkerSpec(name="llm", role="llm")])
    ctx = zmq.Context()
    pull, pub = worker_sockets(ctx, config, "llm")
    beat = Heartbeat(worker="llm", pid=os.getpid(), role="llm", device="CPU", model=MODEL,
                     state=ProcessState.READY)

    def send(frame: object) -> None:
        pub.send_multipart((LOCAL, encode(frame)))

    async def run() -> list[bytes]:
        broker = Broker(config)
        await broker.start()
        try:
            link = broker.links["llm"]
            await until_heard(link, pub, beat)
            msg = Generate(id="r1", model=MODEL, params=SamplingParams(), prompt="x",
                           deadline=time.time() + 60)
            stream = broker.open("llm", "r1", msg)
            assert pull.poll(30_000) and pull.recv()
            send(Accepted(id="r1", seq=0, worker="llm", device="CPU", prompt_tokens=3))
            accepted = await stream.next_frame(30)
            assert isinstance(accepted, Accepted)
            gen = Generation(broker, stream, accepted, "test", deadline=msg.deadline)
            reply = (ChatReply(MODEL, True, None, False) if dialect is OPENAI
                     else OllamaReply(MODEL, True, None))
            turn = Dispatch(ServedModel(MODEL, "llm", ["llm"]), msg, True, reply)
            return await step(send, _stream(dialect, turn, gen), stream)
        finally:
            await broker.stop()

    try:
        return asyncio.run(run())
    finally:
        pull.close(0)
        pub.close(0)
        ctx.term()


async def _all_at_once(send: Callable[[object], None], chunks: AsyncIterator[bytes],
                       stream: RequestStream) -> list[bytes]:
    """Every frame sent before the gateway makes its first event (a stream behind)."""
    for i, word in enumerate(WORDS):
        send(Delta(id="r1", seq=i + 1, text=word, tokens=i + 1))
    send(Finished(id="r1", seq=TOKENS + 1, finish_reason="length", prompt_tokens=3,
                  completion_tokens=TOKENS, timings=Timings(1, 2, 3, 6)))
    deadline = time.monotonic() + 30
    while stream.next_seq < TOKENS + 2:  # NOTE: until the broker has every frame
        assert time.monotonic() < deadline, "the frames never reached the broker"
        await asyncio.sleep(0.01)
    return [chunk async for chunk in chunks]


async def _one_by_one(send: Callable[[object], None], chunks: AsyncIterator[bytes],
                      stream: RequestStream) -> list[bytes]:
    """Each frame sent only once the chunk of the one before it came out."""
    got = [await anext(chunks)]  # NOTE: the role chunk (OpenAI), before any token
    for i, word in enumerate(WORDS):
        send(Delta(id="r1", seq=i + 1, text=word, tokens=i + 1))
        got.append(await anext(chunks))
    send(Finished(id="r1", seq=TOKENS + 1, finish_reason="length", prompt_tokens=3,
                  completion_tokens=TOKENS, timings=Timings(1, 2, 3, 6)))
    return got + [chunk async for chunk in chunks]


def _sse_data(chunks: list[bytes]) -> list[bytes]:
    body = b"".join(chunks)
    assert body.endswith(b"\n\n")
    return [event.removeprefix(b"data: ") for event in body[:-2].split(b"\n\n")]


def _openai_sdk(chunks: list[bytes]) -> list[openai.types.chat.ChatCompletionChunk]:
    """The chunks as the official OpenAI client reads them, body chunk by body chunk."""
    transport = httpx.MockTransport(lambda request: httpx.Response(
        200, headers={"content-type": "text/event-stream"}, content=iter(chunks)))
    client = openai.OpenAI(api_key="x", base_url="http://127.0.0.1/v1",
                           http_client=httpx.Client(transport=transport))
    return list(client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], stream=True))


def test_openai_frames_already_there_go_out_in_one_chunk_with_every_event(
        tmp_path: Path) -> None:
    chunks = _run(tmp_path, OPENAI, _all_at_once)
    assert len(chunks) == 1
    events = _sse_data(chunks)
    # NOTE: the role chunk, one content chunk per token, the finish and usage chunks, [DONE]:
    # the same events as a stream that kept up.
    assert len(events) == 1 + TOKENS + 2 + 1 and events[-1] == b"[DONE]"
    parsed = _openai_sdk(chunks)
    assert len(parsed) == 1 + TOKENS + 2
    assert [c.choices[0].delta.content for c in parsed[1:1 + TOKENS]] == WORDS
    assert parsed[-2].choices[0].finish_reason == "length"
    assert parsed[-1].usage is not None and parsed[-1].usage.completion_tokens == TOKENS


def test_openai_a_lone_token_is_not_held_back(tmp_path: Path) -> None:
    chunks = _run(tmp_path, OPENAI, _one_by_one)
    # NOTE: the role chunk, then each token in its own chunk as it came, then the end in one.
    assert [len(_sse_data([c])) for c in chunks] == [1] * (1 + TOKENS) + [3]
    parsed = _openai_sdk(chunks)
    assert "".join(c.choices[0].delta.content or "" for c in parsed if c.choices) == \
        "".join(WORDS)
    assert len(parsed) == 1 + TOKENS + 2


def test_ollama_frames_already_there_go_out_in_one_chunk_with_every_line(
        tmp_path: Path) -> None:
    chunks = _run(tmp_path, OLLAMA, _all_at_once)
    assert len(chunks) == 1
    lines = chunks[0].splitlines()
    assert len(lines) == TOKENS + 1
    assert [json.loads(line)["message"]["content"] for line in lines[:-1]] == WORDS
    transport = httpx.MockTransport(lambda request: httpx.Response(
        200, headers={"content-type": "application/x-ndjson"}, content=iter(chunks)))
    client = ollama.Client(host="http://127.0.0.1:1", transport=transport)
    parsed = list(client.chat(model=MODEL, messages=[{"role": "user", "content": "x"}],
                              stream=True))
    assert [p.message.content for p in parsed[:-1]] == WORDS
    assert parsed[-1].done and parsed[-1].eval_count == TOKENS
