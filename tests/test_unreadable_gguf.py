"""A GGUF file whose tensors OpenVINO GenAI cannot read is refused with a clear 400, before
anything is unloaded for it.

OpenVINO GenAI's GGUF reader takes F32, F16, Q4_0, Q4_1, Q4_K, Q6_K and Q8_0 tensors. Files
made by llama-quantize from the embedded SmolLM2 as Q5_K_M (Q5_1 and Q5_K tensors), Q5_0,
Q4_K_S, Q3_K_M, Q2_K, IQ4_NL and BF16 all failed in its load ("gguf_tensor_to_f16 failed",
"Unsupported quantization type"). A request for such a model was a 500 with that native
message, after the llm worker had been switched away from the model it served and back (two
restarts). The header says it in milliseconds, so the server says it first.

The files here are synthetic: a header with one tensor of the type, which is all the check
reads (no model hub, no llama.cpp needed).
"""

from __future__ import annotations

import struct
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import ollama
import openai
import pytest
from serverctl import Server, small_llm, worker_row

from npu_proxy.models.gguf import UnreadableGGUF, unreadable_file
from npu_proxy.workers.gguf_ir import loadable

LLM = "smollm2:135m"
Q5 = "q5-model"
Q5_K, Q4_K, Q6_K, F32 = 13, 12, 14, 0


def _string(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def gguf(tensors: list[tuple[str, int]]) -> bytes:
    """A GGUF v3 header: architecture llama, one 256 x 4 tensor per (name, ggml type)."""
    out = [b"GGUF", struct.pack("<IQQ", 3, len(tensors), 1),
           _string("general.architecture"), struct.pack("<I", 8), _string("llama")]
    for name, kind in tensors:
        out += [_string(name), struct.pack("<I2QIQ", 2, 256, 4, kind, 0)]
    return b"".join(out) + b"\0" * 64


Q5_FILE = gguf([("token_embd.weight", Q6_K), ("blk.0.ffn_up.weight", Q5_K),
                ("blk.0.attn_norm.weight", F32)])


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("unreadable")
    (tmp / "q5.gguf").write_bytes(Q5_FILE)
    # NOTE: the served model is the two-layer one (serverctl.small_llm): only whether it
    # stays loaded and serves is looked at.
    server = Server(tmp, workers=[{"name": "llm", "role": "llm"}],
                    models={**small_llm(), Q5: {"path": str(tmp / "q5.gguf")}}).start()
    yield server
    server.stop()


def test_a_request_for_it_is_a_400_and_the_served_model_stays(srv: Server) -> None:
    before = worker_row(srv, "llm")
    chat = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        chat.chat.completions.create(model=Q5, max_tokens=3,
                                     messages=[{"role": "user", "content": "Hi"}])
    assert "Q5_K" in info.value.message and "Q4_K_M" in info.value.message, info.value.message
    assert "Q6_K" not in info.value.message.split("(it takes")[0]
    with pytest.raises(ollama.ResponseError) as shown:
        ollama.Client(host=srv.url).generate(model=Q5, prompt="Hi")
    assert shown.value.status_code == 400 and "Q5_K" in shown.value.error
    # Nothing was unloaded for it: the same process still serves the configured model.
    after = worker_row(srv, "llm")
    assert (after["pid"], after["restarts"], after["model"]) == (
        before["pid"], before["restarts"], LLM)
    r = httpx.post(srv.url + "/api/generate", timeout=120, json={
        "model": LLM, "prompt": "Hi", "stream": False, "options": {"num_predict": 2}})
    assert r.status_code == 200 and r.json()["done"] is True


def test_creating_a_model_from_it_is_refused(srv: Server) -> None:
    client = ollama.Client(host=srv.url)
    path = srv.tmp / "upload.gguf"
    path.write_bytes(Q5_FILE)
    digest = client.create_blob(path)
    made = f"npx-test-q5-{uuid.uuid4().hex[:8]}:latest"  # NOTE: the model cache is shared
    with pytest.raises(ollama.ResponseError) as info:
        list(client.create(model=made, files={"model.gguf": digest}, stream=True))
    assert info.value.status_code == 400 and "Q5_K" in info.value.error, info.value.error
    assert made not in {m.model for m in client.list().models}


def test_the_check_names_every_type_it_cannot_read(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    path.write_bytes(gguf([("a", Q4_K), ("b", Q6_K), ("c", F32), ("d", 2), ("e", 3), ("f", 8),
                           ("g", 1)]))
    assert unreadable_file(path) == ""  # every type GenAI reads
    for kind, name in ((13, "Q5_K"), (6, "Q5_0"), (7, "Q5_1"), (11, "Q3_K"), (20, "IQ4_NL"),
                       (30, "BF16"), (99, "type 99")):
        path.write_bytes(gguf([("a", Q4_K), ("b", kind)]))
        assert f"holds {name} tensors" in unreadable_file(path)
    path.write_bytes(b"GGUF" + bytes(8))  # cut short: GenAI's to judge
    assert unreadable_file(path) == ""


def test_a_worker_says_why_instead_of_genais_native_error(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    path.write_bytes(Q5_FILE)
    with pytest.raises(UnreadableGGUF, match="Q5_K"):
        loadable(str(path), tmp_path / "cache")
    assert not (tmp_path / "cache").exists()  # no conversion was started
