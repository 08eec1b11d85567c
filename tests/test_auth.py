"""With an API key configured, every route that does work or shows state wants it, in each
API's error shape."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import ollama
import openai
import pytest
from serverctl import Server, small_llm

LLM = "smollm2:135m"
KEY = "test-key-123"


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # NOTE: each token takes at least 0.5 s and every answer is 40 digits (test hooks), so a
    # long answer outlasts the deadline whatever the model would say and however fast the
    # machine, and the deadline leaves room for the first token on a loaded machine. The
    # prompt gets no time of its own (min_prefill_rate 0): the deadline is 12 s, all told.
    # The small model (serverctl.small_llm): what these tests see is status codes and how
    # answers end, never what they say.
    server = Server(tmp_path_factory.mktemp("auth"), workers=[
        {"name": "llm", "role": "llm", "min_prefill_rate": 0,
         "faults": {"token_delay_seconds": 0.5, "force_regex": "[0-9]{40}"}}],
        api_key=KEY, inference_timeout=12.0, models=small_llm()).start()
    yield server
    server.stop()


def test_openai_requires_the_key(srv: Server) -> None:
    bad = openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        bad.models.list()
    assert info.value.code == "invalid_api_key"
    good = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)
    assert any(m.id == LLM for m in good.models.list())


def test_anthropic_requires_the_key(srv: Server) -> None:
    bad = anthropic.Anthropic(base_url=srv.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        bad.messages.create(model=LLM, max_tokens=3,
                            messages=[{"role": "user", "content": "hi"}])
    good = anthropic.Anthropic(base_url=srv.url, api_key=KEY, max_retries=0)
    assert good.messages.create(model=LLM, max_tokens=3,
                                messages=[{"role": "user", "content": "hi"}]).content


def test_ollama_requires_the_key_but_probes_stay_open(srv: Server) -> None:
    r = httpx.get(srv.url + "/api/tags")
    assert r.status_code == 401 and "error" in r.json()
    assert httpx.get(srv.url + "/").status_code == 200
    assert httpx.get(srv.url + "/api/version").status_code == 200
    assert httpx.get(srv.url + "/health").status_code == 200
    client = ollama.Client(host=srv.url, headers={"Authorization": f"Bearer {KEY}"})
    assert any(m.model == LLM for m in client.list().models)


def test_inference_timeout_ends_ollama_chat_with_reason_timeout(srv: Server) -> None:
    r = httpx.post(srv.url + "/api/chat", timeout=60, headers={"x-api-key": KEY}, json={
        "model": LLM, "stream": False,
        "messages": [{"role": "user", "content": "Count from 1 to 1000, separated by commas."}],
        "options": {"num_predict": 4000, "temperature": 0}})
    body = r.json()
    assert body["done_reason"] == "timeout"
    assert body["message"]["content"].strip()  # NOTE: what was made before the deadline
    assert 0 < body["eval_count"] < 4000


def test_unknown_path_is_not_an_auth_leak(srv: Server) -> None:
    assert httpx.post(srv.url + "/v1/chat/completions", json={}).status_code == 401
    # Pids, errors and counters are state: they want the key; the probes do not.
    assert httpx.get(srv.url + "/health/devices").status_code == 401
    assert httpx.get(srv.url + "/metrics").status_code == 401
    assert httpx.get(srv.url + "/health/ready").status_code == 200
    assert httpx.get(srv.url + "/metrics",
                     headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_workers_are_never_given_the_key(srv: Server) -> None:
    """Only the gateway checks the key: a worker's configuration file does not hold it."""
    def config_of(pid: int) -> Path:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        return Path(argv[argv.index(b"--config") + 1].decode())

    children = srv.children()
    worker = config_of(int(children["llm"]["pid"]))
    gateway = config_of(int(children["gateway"]["pid"]))
    assert worker != gateway
    assert KEY not in worker.read_text() and KEY in gateway.read_text()
    assert worker.stat().st_mode & 0o777 == 0o600 and gateway.stat().st_mode & 0o777 == 0o600


def test_an_unauthenticated_8_mib_upload_is_401_and_the_server_stays_usable(srv: Server) -> None:
    """Decided from the headers: the body is read and dropped (tests/test_body_gate.py counts
    what is kept), the client sees the 401, the next request on the connection is served."""
    with httpx.Client(base_url=srv.url, timeout=60) as client:
        r = client.post("/v1/chat/completions", content=b"x" * (8 * 1024 * 1024),
                        headers={"content-type": "application/json"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = client.get("/api/tags", headers={"authorization": f"Bearer {KEY}"})
        assert r.status_code == 200
