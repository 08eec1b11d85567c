"""Settings no other test showed, each through what a user sees of a real server.

One extra server carries them all (none changes what the others test): JSON logs that
rotate small, a Responses store of one, a schema depth of 3 and a `claude_model` that names
a missing model.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
import tomli_w
from serverctl import SUPERVISOR, Server, small_llm

MISSING = "no-such-model:1b"


@pytest.fixture(scope="module")
def tuned(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # NOTE: the small model (serverctl.small_llm): the answers here are 2 tokens nobody reads.
    server = Server(tmp_path_factory.mktemp("settings"), workers=[
        {"name": "llm", "role": "llm"}],
        log_format="json", log_max_bytes=4096, log_backups=1,
        responses_store_max=1, max_schema_depth=3, claude_model=MISSING,
        models=small_llm()).start()
    try:
        yield server
    finally:
        server.stop()


def _logs(server: Server) -> Path:
    return server.tmp / "rt" / "logs"


def test_log_format_json_and_rotation_by_log_max_bytes_and_log_backups(tuned: Server) -> None:
    rotated = _logs(tuned) / "gateway.log.1"
    with httpx.Client(base_url=tuned.url, timeout=30) as client:
        # NOTE: each refused request logs a line; a few hundred fill 4 KiB several times.
        for _ in range(2000):
            if rotated.exists():
                break
            client.post("/api/show", json={"model": "nothing:here"})
    assert rotated.exists(), "the gateway log did not rotate"
    files = sorted(p.name for p in _logs(tuned).glob("gateway.log*"))
    assert files == ["gateway.log", "gateway.log.1"]  # log_backups = 1
    assert (_logs(tuned) / "gateway.log.1").stat().st_size <= 4096 + 2048
    lines = [line for line in (_logs(tuned) / "gateway.log.1").read_text().splitlines() if line]
    assert lines and all(isinstance(json.loads(line), dict) for line in lines)


def test_responses_store_max_keeps_only_the_newest(tuned: Server) -> None:
    client = openai.OpenAI(base_url=tuned.url + "/v1", api_key="x")
    first = client.responses.create(model="smollm2:135m", input="Hi", max_output_tokens=2)
    second = client.responses.create(model="smollm2:135m", input="Hi", max_output_tokens=2)
    assert client.responses.retrieve(second.id).id == second.id
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


def test_max_schema_depth_refuses_a_deeper_schema(tuned: Server) -> None:
    client = openai.OpenAI(base_url=tuned.url + "/v1", api_key="x")
    schema: dict[str, object] = {"type": "string"}
    for _ in range(4):
        schema = {"type": "object", "properties": {"a": schema}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="smollm2:135m", max_tokens=2, messages=[{"role": "user", "content": "Hi"}],
            response_format={"type": "json_schema",
                             "json_schema": {"name": "deep", "schema": schema}})
    assert "max_schema_depth" in str(info.value)


def test_claude_model_is_what_claude_names_stand_for(tuned: Server) -> None:
    client = anthropic.Anthropic(base_url=tuned.url, api_key="x")
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-sonnet-4-5", max_tokens=2,
                               messages=[{"role": "user", "content": "Hi"}])
    reply = client.messages.create(model="smollm2:135m", max_tokens=2,
                                   messages=[{"role": "user", "content": "Hi"}])
    assert reply.model == "smollm2:135m"


def test_keys_dir_holds_the_curve_keys(tmp_path: Path) -> None:
    path = tmp_path / "npu-proxy.toml"
    folder = tmp_path / "kept-keys"
    path.write_text(tomli_w.dumps({"runtime_dir": str(tmp_path / "rt"), "transport": "tcp",
                                   "keys_dir": str(folder)}))
    out = subprocess.run([SUPERVISOR, "keys", "--config", str(path)], capture_output=True,
                         text=True, check=True, timeout=120).stdout
    assert str(folder) in out
    assert (folder / "server.key").exists() and (folder / "client.key_secret").exists()
    assert not (tmp_path / "rt" / "keys").exists()
