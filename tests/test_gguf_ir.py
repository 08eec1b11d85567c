"""A GGUF model is converted to OpenVINO IR once, kept in the model cache, and a later load
(a restart) reads the IR: same tokenizer, same chat template, same greedy text."""

from __future__ import annotations

import logging
from pathlib import Path

import openvino_genai as ov_genai
import pytest

from models.locate import locate
from models.store import GGUF_IR, Manifest, ManifestFile, ModelStore
from protocol.config import Config
from workers.gguf_ir import ir_folder, loadable

MESSAGES = [{"role": "user", "content": "Name three colours."}]


def _greedy(path: str) -> tuple[str, str]:
    pipe = ov_genai.LLMPipeline(path, "CPU")
    tokenizer = pipe.get_tokenizer()
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    config = ov_genai.GenerationConfig()
    config.max_new_tokens = 12
    return prompt, str(pipe.generate(prompt, config))


def test_converted_once_then_loaded_as_ir(tmp_path: Path,
                                          caplog: pytest.LogCaptureFixture) -> None:
    gguf = locate(Config(), "smollm2:135m").path
    caplog.set_level(logging.INFO, logger="workers.gguf_ir")
    first = loadable(str(gguf), tmp_path)
    assert "converting" in caplog.text
    folder = Path(first)
    assert folder == ir_folder(tmp_path / GGUF_IR, gguf)
    assert (folder / "openvino_model.xml").is_file()
    assert (folder / "openvino_tokenizer.xml").is_file()
    assert [p.name for p in (tmp_path / GGUF_IR).iterdir()] == [folder.name]  # no leftovers
    caplog.clear()
    assert loadable(str(gguf), tmp_path) == first
    assert "converting" not in caplog.text and "converted IR" in caplog.text
    # The IR answers exactly as the GGUF does: same chat prompt, same greedy text.
    assert _greedy(first) == _greedy(str(gguf))


def test_the_ir_of_a_vanished_gguf_is_dropped_at_the_next_conversion(tmp_path: Path) -> None:
    gone = tmp_path / "gone.gguf"
    gone.write_bytes(b"GGUF")
    stale = ir_folder(tmp_path / "cache" / GGUF_IR, gone)
    stale.mkdir(parents=True)
    (stale / "converted-from.txt").write_text(f"{gone.resolve()}\n")
    gone.unlink()
    (tmp_path / "model.gguf").write_bytes(b"not a model")
    # A conversion that fails still costs only the speed-up: the GGUF itself is loaded.
    assert loadable(str(tmp_path / "model.gguf"), tmp_path / "cache") == str(
        tmp_path / "model.gguf")
    assert not stale.exists() and list((tmp_path / "cache" / GGUF_IR).iterdir()) == []


def test_an_ir_folder_is_loaded_as_it_is(tmp_path: Path) -> None:
    assert loadable(str(tmp_path), tmp_path / "cache") == str(tmp_path)
    assert not (tmp_path / "cache").exists()


def test_deleting_a_pulled_gguf_drops_its_ir(tmp_path: Path) -> None:
    store = ModelStore(tmp_path)
    staging = store.staging_dir("tiny:1b")
    staging.mkdir(parents=True)
    (staging / "model.gguf").write_bytes(b"GGUF")
    store.install(staging, Manifest(name="tiny:1b", kind="llm", format="gguf", source="test",
                                    files=[ManifestFile(path="model.gguf", size=4)],
                                    entry="model.gguf"))
    gguf = store.model_dir("tiny:1b") / "model.gguf"
    other = tmp_path / "elsewhere.gguf"
    other.write_bytes(b"GGUF")
    for source in (gguf, other):  # what a conversion leaves (its files do not matter here)
        ir = ir_folder(tmp_path / GGUF_IR, source)
        ir.mkdir(parents=True)
        (ir / "converted-from.txt").write_text(f"{source.resolve()}\n")
    assert store.remove("tiny:1b")
    assert [p.name for p in (tmp_path / GGUF_IR).iterdir()] == [
        ir_folder(tmp_path / GGUF_IR, other).name]
