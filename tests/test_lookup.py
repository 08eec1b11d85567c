"""Prompt-lookup decoding on an llm worker: the same greedy text as without it, and every
request kind (streaming, sampling, JSON schema) still served."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from serverctl import Server

from protocol.config import ConfigError, load_config

# An input-grounded task: the answer repeats much of the prompt, which is what lookup uses.
TEXT = ("OpenVINO is a toolkit for optimizing and deploying deep learning models. It supports "
        "CPUs, GPUs and NPUs from Intel. The runtime loads a model once and compiles it for the "
        "chosen device.")
GROUNDED = {"model": "smollm2:135m", "max_tokens": 60, "temperature": 0,
            "messages": [{"role": "user", "content": "Repeat this text exactly:\n" + TEXT}]}


@pytest.fixture(scope="module")
def lookup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = Server(tmp_path_factory.mktemp("lookup"), workers=[
        {"name": "llm", "role": "llm", "prompt_lookup": 5}]).start()
    yield srv
    srv.stop()


def _greedy(url: str) -> str:
    # NOTE: asked twice, the second with the prompt in the prefix cache on both servers:
    # cached and fresh prompt states may differ in the last bits and flip a near tie.
    for _ in range(2):
        r = httpx.post(url + "/v1/chat/completions", json=GROUNDED, timeout=120)
        assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["message"]["content"])


def test_greedy_text_is_unchanged_by_prompt_lookup(lookup: Server, base_url: str) -> None:
    assert "prompt lookup on: up to 5 tokens per step" in lookup.worker_log("llm")
    assert _greedy(lookup.url) == _greedy(base_url)


def test_streaming_sampling_and_schema_work_with_prompt_lookup(lookup: Server) -> None:
    chunks = []
    with httpx.stream("POST", lookup.url + "/v1/chat/completions", timeout=120,
                      json={**GROUNDED, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == _greedy(lookup.url)
    r = httpx.post(lookup.url + "/v1/chat/completions", timeout=120, json={
        **GROUNDED, "temperature": 0.9, "seed": 7})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0
    schema = {"type": "object", "properties": {"name": {"type": "string"}},
              "required": ["name"]}
    r = httpx.post(lookup.url + "/v1/chat/completions", timeout=120, json={
        **GROUNDED, "max_tokens": 40,
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "n", "schema": schema}}})
    assert r.status_code == 200
    assert isinstance(json.loads(r.json()["choices"][0]["message"]["content"])["name"], str)


def test_prompt_lookup_is_an_llm_role_option(tmp_path: Path) -> None:
    config = tmp_path / "c.toml"
    config.write_text('[[workers]]\nname = "npu"\nrole = "npu"\nprompt_lookup = 4\n')
    with pytest.raises(ConfigError, match="prompt_lookup needs the llm role"):
        load_config(config, env={})
