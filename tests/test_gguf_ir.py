"""A GGUF model is converted to OpenVINO IR once, kept in the model cache, and a later load
(a restart) reads the IR: same tokenizer, same chat template; its Q4_1 weights are llama.cpp's
dequantized weights, and its graph is rewritten with fewer matrix products that compute the
same numbers.

NOTE: the conversions here are of the embedded SmolLM2 cut to its first two layers
(serverctl.small_gguf(), tests/small_gguf.py): the same tensor types, tokenizer and template,
and every check is per tensor or per layer, at a tenth of the thirty layers' conversion.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import openvino as ov
import openvino_genai as ov_genai
import pytest
from serverctl import SMALL_LAYERS, small_gguf

from npu_proxy.models.digests import sha256_file
from npu_proxy.models.store import CONVERTED_FROM, GGUF_IR, Manifest, ManifestFile, ModelStore
from npu_proxy.workers import gguf_ir
from npu_proxy.workers.batch_engine import default_properties
from npu_proxy.workers.gguf_ir import ir_folder, loadable

MESSAGES = [{"role": "user", "content": "Name three colours."}]


def _prompt(path: str) -> tuple[str, list[int]]:
    """The chat as GenAI's tokenizer of `path` (an IR folder, or a GGUF file as GenAI reads
    it) templates it, and that prompt's tokens.

    NOTE: the tokenizer alone, not an LLMPipeline: the pipeline built (and compiled) the
    model too, seconds of which the prompt needs nothing."""
    tokenizer = ov_genai.Tokenizer(path)
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    ids = tokenizer.encode(prompt, add_special_tokens=False).input_ids.data
    return prompt, [int(i) for i in ids.ravel()]


# The graph's matrix products: per layer q, k, v, o, gate, up and down (q, k and v one product
# once rewritten), and the output layer's and the embedding's.
PRODUCTS = 7 * SMALL_LAYERS + 2
REWRITTEN = 5 * SMALL_LAYERS + 2


class Converted(NamedTuple):
    cache: Path
    folder: Path
    log: str


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Converted:
    """The embedded SmolLM2 converted (rewrite and probe included) into an empty cache, and
    what that conversion logged.

    NOTE: made once for the module: the conversion with its probe at each precision is the
    slowest step here (15-25 s on two loaded cores), and two tests look at its result."""
    cache = tmp_path_factory.mktemp("gguf-ir")
    logger = logging.getLogger("npu_proxy.workers")  # NOTE: gguf_ir's and the checks'
    lines, level = _Lines(), logger.level
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    try:
        folder = loadable(str(small_gguf()), cache)
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level)
    return Converted(cache, Path(folder), "\n".join(lines.lines))


def test_converted_once_then_loaded_as_ir(converted: Converted,
                                          caplog: pytest.LogCaptureFixture) -> None:
    gguf = small_gguf()
    caplog.set_level(logging.INFO, logger="npu_proxy.workers.gguf_ir")
    assert "converting" in converted.log
    assert "differs" not in converted.log and "could not check" not in converted.log
    folder, first = converted.folder, str(converted.folder)
    assert folder == ir_folder(converted.cache / GGUF_IR, gguf)
    assert (folder / "openvino_model.xml").is_file()
    assert (folder / "openvino_tokenizer.xml").is_file()
    # no leftovers
    assert [p.name for p in (converted.cache / GGUF_IR).iterdir()] == [folder.name]
    assert loadable(str(gguf), converted.cache) == first
    assert "converting" not in caplog.text and "converted IR" in caplog.text
    # The IR reads the chat as GenAI's reading of the GGUF does: the same prompt, the same
    # tokens. (Not the same greedy text: its Q4_1 weights are llama.cpp's, GenAI's own are
    # not; see test_q4_1_weights_are_llama_cpps_dequantized_weights.)
    assert _prompt(first) == _prompt(str(gguf))


def test_the_ir_of_a_vanished_gguf_is_dropped_at_the_next_conversion(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="npu_proxy")
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
    # ...and says why: the conversion's child process failed, with its own last lines.
    assert "could not keep model.gguf as IR" in caplog.text
    assert "failed in child process" in caplog.text and "could not convert" in caplog.text
    assert not stale.exists() and list((tmp_path / "cache" / GGUF_IR).iterdir()) == []


def test_an_ir_folder_is_loaded_as_it_is(tmp_path: Path) -> None:
    assert loadable(str(tmp_path), tmp_path / "cache") == str(tmp_path)
    assert not (tmp_path / "cache").exists()


def test_deleting_a_pulled_gguf_drops_its_ir(tmp_path: Path) -> None:
    store = ModelStore(tmp_path)
    for name, data in (("tiny:1b", b"GGUF one"), ("tiny:2b", b"GGUF two")):
        staging = store.staging_dir(name)
        staging.mkdir(parents=True)
        (staging / "model.gguf").write_bytes(data)
        store.install(staging, Manifest(name=name, kind="llm", format="gguf", source="test",
                                        files=[ManifestFile(path="model.gguf", size=8)],
                                        entry="model.gguf"))
    gguf, shared = (store.model_dir(name) / "model.gguf" for name in ("tiny:1b", "tiny:2b"))
    other = tmp_path / "elsewhere.gguf"
    other.write_bytes(b"GGUF 3")
    copy = tmp_path / "copy.gguf"  # the same bytes as tiny:2b's file
    copy.write_bytes(b"GGUF two")
    for source in (gguf, other, shared):  # what a conversion leaves (its files do not matter)
        ir = ir_folder(tmp_path / GGUF_IR, source)
        ir.mkdir(parents=True)
        (ir / "converted-from.txt").write_text(f"{source.resolve()}\n{sha256_file(source)}\n")
    assert ir_folder(tmp_path / GGUF_IR, copy) == ir_folder(tmp_path / GGUF_IR, shared)
    assert store.remove("tiny:1b") and store.remove("tiny:2b")
    # tiny:2b's conversion stays: the copy of its bytes still maps to it.
    assert sorted(p.name for p in (tmp_path / GGUF_IR).iterdir()) == sorted(
        ir_folder(tmp_path / GGUF_IR, source).name for source in (other, copy))


def test_a_copy_of_a_converted_gguf_loads_its_ir(converted: Converted, tmp_path: Path,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    copy = tmp_path / "elsewhere" / "copied.gguf"  # a new inode, path and modification time
    copy.parent.mkdir()
    shutil.copyfile(small_gguf(), copy)
    caplog.set_level(logging.INFO, logger="npu_proxy.workers.gguf_ir")
    assert loadable(str(copy), converted.cache) == str(converted.folder)
    assert "converting" not in caplog.text and "loading the converted IR" in caplog.text


def _logits(folder: str, properties: dict[str, object]) -> tuple[int, np.ndarray]:
    """How many matrix products the IR has, and its logits for a fixed 40-token prompt."""
    core = ov.Core()
    model = core.read_model(Path(folder) / "openvino_model.xml")
    products = sum(op.get_type_name() == "MatMul" for op in model.get_ordered_ops())
    request = core.compile_model(model, "CPU", properties).create_infer_request()
    ids = np.arange(100, 140, dtype=np.int64)[None]
    request.infer({"input_ids": ids, "attention_mask": np.ones_like(ids),
                   "position_ids": np.arange(40, dtype=np.int64)[None],
                   "beam_idx": np.zeros(1, dtype=np.int32)})
    return products, request.get_tensor("logits").data.copy()


@pytest.fixture(scope="module")
def not_kept(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded SmolLM2 converted with a rewrite whose probe disagrees (agrees() made
    False): the graph as GenAI saves it, its weights made exact, but not rewritten.

    NOTE: made once for the module: the test of a rewrite not kept looks at it, and the test
    of the rewrite's numbers takes it as the graph before the rewrite (each conversion costs
    seconds of GenAI's reader). Converted in this process: loadable() converts in a child,
    which has no patch."""
    gguf = small_gguf()
    folder = ir_folder(tmp_path_factory.mktemp("not-kept") / GGUF_IR, gguf)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf_ir, "agrees", lambda saved, rewritten, folder: False)
        gguf_ir._convert(gguf, folder)
    return folder


def test_the_rewritten_graph_computes_the_same_numbers_with_fewer_products(
        converted: Converted, not_kept: Path) -> None:
    rewritten, as_genai_saves_it = str(converted.folder), str(not_kept)
    exact = {"INFERENCE_PRECISION_HINT": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0}
    # NOTE: bf16 too (OpenVINO's default on CPUs with AMX; issue 28): merging gate and up
    # moved the gate's Swish off the product's f32 accumulator onto bf16-rounded values.
    for properties in (exact, default_properties("CPU"), {"INFERENCE_PRECISION_HINT": "bf16"}):
        plain_products, plain = _logits(as_genai_saves_it, properties)
        products, logits = _logits(rewritten, properties)
        # q, k and v of each layer: one product each, same numbers.
        assert (plain_products, products) == (PRODUCTS, REWRITTEN)
        assert np.array_equal(logits, plain), properties


def test_a_rewrite_that_changes_the_numbers_is_not_kept(not_kept: Path) -> None:
    model = ov.Core().read_model(not_kept / "openvino_model.xml")
    assert sum(op.get_type_name() == "MatMul" for op in model.get_ordered_ops()) == PRODUCTS
    assert not (not_kept / "rewritten.xml").exists()
    assert (not_kept / CONVERTED_FROM).is_file()  # NOTE: published all the same


def test_an_older_conversion_of_the_same_gguf_is_dropped(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"not a model")
    monkeypatch.setattr(gguf_ir, "FORMAT", "older")
    old = ir_folder(tmp_path / GGUF_IR, gguf)
    old.mkdir(parents=True)
    (old / "converted-from.txt").write_text(f"{gguf.resolve()}\n")
    monkeypatch.undo()
    assert ir_folder(tmp_path / GGUF_IR, gguf) != old
    loadable(str(gguf), tmp_path)  # NOTE: fails to convert (not a model), prunes first
    assert not old.exists()


def _q6k_like(zero: np.ndarray, weights: np.ndarray) -> ov.Model:
    """A matrix product over 8-bit weights in groups of 16 with a zero point and a signed f16
    scale per group, wired as OpenVINO GenAI loads a Q6_K GGUF tensor (Qwen2.5's attn_v,
    ffn_down and output layer): Convert, Subtract, Multiply, Reshape, Convert, MatMul."""
    from openvino import opset13 as ops

    rows, groups, size = weights.shape
    scale = np.random.default_rng(1).uniform(-0.01, 0.01, (rows, groups, 1)).astype(np.float16)
    x = ops.parameter([-1, groups * size], ov.Type.f32, name="x")
    decompressed = ops.multiply(
        ops.subtract(ops.convert(ops.constant(weights), ov.Type.f16),
                     ops.convert(ops.constant(zero), ov.Type.f16)),
        ops.constant(scale))
    matrix = ops.convert(ops.reshape(decompressed, ops.constant(
        np.array([rows, groups * size], np.int64)), False), ov.Type.f32)
    return ov.Model([ops.matmul(x, matrix, False, True)], [x])


def _outputs(model: ov.Model, x: np.ndarray, properties: dict[str, object]) -> np.ndarray:
    request = ov.Core().compile_model(model, "CPU", properties).create_infer_request()
    request.infer({"x": x})
    return np.asarray(request.get_output_tensor(0).data).copy()


def test_a_q6k_matrix_becomes_signed_8_bit_with_the_same_numbers() -> None:
    from npu_proxy.workers.ir_fusion import optimize

    rng = np.random.default_rng(0)
    q6 = rng.integers(0, 64, (256, 96, 16), dtype=np.uint8)  # 6-bit values, zero point 32
    x = rng.standard_normal((3, 96 * 16)).astype(np.float32)
    for properties in ({"INFERENCE_PRECISION_HINT": "f32"}, default_properties("CPU"),
                       {"INFERENCE_PRECISION_HINT": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": 0},
                       {"INFERENCE_PRECISION_HINT": "bf16"}):
        expected = _outputs(_q6k_like(np.full((256, 96, 1), 32, np.uint8), q6), x, properties)
        model = _q6k_like(np.full((256, 96, 1), 32, np.uint8), q6)
        assert optimize(model).signed == 1
        kinds = {op.get_output_element_type(0) for op in model.get_ordered_ops()
                 if op.get_type_name() == "Constant"}
        assert ov.Type.i8 in kinds and ov.Type.u8 not in kinds
        assert np.array_equal(_outputs(model, x, properties), expected), properties


def test_8_bit_weights_stay_unsigned_where_signed_would_change_them() -> None:
    from npu_proxy.workers.ir_fusion import optimize

    rng = np.random.default_rng(0)
    varying = rng.integers(30, 34, (64, 4, 1), dtype=np.uint8)  # a zero point per group
    q6 = rng.integers(0, 64, (64, 4, 16), dtype=np.uint8)
    assert optimize(_q6k_like(varying, q6)).signed == 0
    wide = rng.integers(0, 256, (64, 4, 16), dtype=np.uint8)  # 255 - 32 does not fit in i8
    assert optimize(_q6k_like(np.full((64, 4, 1), 32, np.uint8), wide)).signed == 0


def _q4k_like(rng: np.random.Generator, rows: int, groups: int) -> ov.Output:
    """A [rows, groups * 32] matrix wired as OpenVINO GenAI loads a Q4_K GGUF tensor: u4
    weights in groups of 32, a u4 zero point and an f16 scale per group."""
    from openvino import opset13 as ops

    def u4(shape: list[int]) -> ov.Node:
        tensor = ov.Tensor(ov.Type.u4, ov.Shape(shape))
        tensor.data[:] = rng.integers(0, 256, tensor.data.size, dtype=np.uint8)
        return ov.op.Constant(tensor)

    scale = rng.uniform(0.001, 0.01, (rows, groups, 1)).astype(np.float16)
    decompressed = ops.multiply(
        ops.subtract(ops.convert(u4([rows, groups, 32]), ov.Type.f16),
                     ops.convert(u4([rows, groups, 1]), ov.Type.f16)),
        ops.constant(scale))
    return ops.convert(ops.reshape(decompressed, ops.constant(
        np.array([rows, groups * 32], np.int64)), False), ov.Type.f32).output(0)


def _biased_qkv(v_q6k: bool) -> ov.Model:
    """Attention's q, k and v as in Qwen2.5: three products of one tensor, each plus a
    constant f32 bias, then a Reshape into heads; v Q6_K-like (8-bit, groups of 16) or Q4_K."""
    from openvino import opset13 as ops

    rng = np.random.default_rng(2)
    x = ops.parameter([-1, -1, 4 * 32], ov.Type.f32, name="x")
    outputs = []
    for rows in (64, 32, 32):
        if rows == 32 and v_q6k and len(outputs) == 2:
            q6 = rng.integers(0, 64, (rows, 8, 16), dtype=np.uint8)
            scale = rng.uniform(-0.01, 0.01, (rows, 8, 1)).astype(np.float16)
            matrix = ops.convert(ops.reshape(ops.multiply(
                ops.subtract(ops.convert(ops.constant(q6), ov.Type.f16),
                             ops.convert(ops.constant(np.full((rows, 8, 1), 32, np.uint8)),
                                         ov.Type.f16)),
                ops.constant(scale)), ops.constant(np.array([rows, 128], np.int64)), False),
                ov.Type.f32).output(0)
        else:
            matrix = _q4k_like(rng, rows, 4)
        bias = ops.convert(ops.constant(rng.standard_normal(rows).astype(np.float32)),
                           ov.Type.f32)
        biased = ops.add(ops.matmul(x, matrix, False, True), bias)
        outputs.append(ops.reshape(biased, ops.constant(np.array([0, 0, -1, 16], np.int64)),
                                   True))
    return ov.Model(outputs, [x])


def _all_outputs(model: ov.Model, x: np.ndarray,
                 properties: dict[str, object]) -> list[np.ndarray]:
    request = ov.Core().compile_model(model, "CPU", properties).create_infer_request()
    request.infer({"x": x})
    return [np.asarray(request.get_output_tensor(i).data).copy() for i in range(3)]


def test_biased_q_k_v_of_one_kind_become_one_product_with_the_same_numbers() -> None:
    from npu_proxy.workers.ir_fusion import optimize

    x = np.random.default_rng(3).standard_normal((2, 5, 128)).astype(np.float32)
    # Qwen2.5-Coder Q4_K_M: q, k and v all Q4_K in half the layers, v Q6_K in the others.
    for v_q6k, products in ((False, 1), (True, 2)):
        model = _biased_qkv(v_q6k)
        assert optimize(model).merged == 1
        ops_ = [op.get_type_name() for op in model.get_ordered_ops()]
        assert (ops_.count("MatMul"), ops_.count("Add")) == (products, products)
        for properties in ({"INFERENCE_PRECISION_HINT": "f32"}, default_properties("CPU"),
                           {"INFERENCE_PRECISION_HINT": "bf16"}):
            expected = _all_outputs(_biased_qkv(v_q6k), x, properties)
            got = _all_outputs(model, x, properties)
            assert all(np.array_equal(a, b) for a, b in zip(got, expected, strict=True)), (
                v_q6k, properties)


def _u4(const: ov.Node, every: int = 1) -> np.ndarray:
    """A u4 constant's values, every `every`-th row (only those unpacked when each row is
    whole bytes)."""
    packed = np.asarray(const.get_data()).view(np.uint8).ravel()
    shape = tuple(const.get_output_shape(0))
    if every > 1 and int(np.prod(shape[1:])) % 2 == 0:
        packed = packed.reshape(shape[0], -1)[::every].ravel()
        shape, every = (len(range(0, shape[0], every)), *shape[1:]), 1
    values = np.stack([packed & 15, packed >> 4], -1).ravel()[:int(np.prod(shape))]
    return values.reshape(shape)[::every]


def _constant(node: ov.Node, every: int = 1) -> np.ndarray:
    """The constant under `node`'s Converts as f32, every `every`-th row."""
    while node.get_type_name() == "Convert":
        node = node.input_value(0).get_node()
    assert node.get_type_name() == "Constant"
    if str(node.get_element_type()) == "<Type: 'uint4_t'>":
        return _u4(node, every).astype(np.float32)
    data = np.asarray(node.get_data())
    return (data[::every] if every > 1 else data).astype(np.float32)


# ggml type: (bytes, weights) of a block: Q4_0, Q4_1, Q4_K.
_BLOCKS = {2: (18, 32), 3: (20, 32), 12: (144, 256)}


def _blocks(data: np.ndarray, t: object) -> np.ndarray:
    """A Q4_0, Q4_1 or Q4_K tensor's bytes: (rows, blocks, bytes of a block)."""
    dims, kind, offset = t.dims, t.ggml_type, t.offset  # type: ignore[attr-defined]
    rows = int(np.prod(dims[1:]))
    size, per = _BLOCKS[kind]
    return data[offset:offset + rows * (dims[0] // per) * size].reshape(rows, -1, size)


def _steps(raw: np.ndarray, kind: int) -> tuple[np.ndarray, np.ndarray]:
    """The (rows, groups) steps and offsets of `_blocks` rows, as llama.cpp's
    dequantize_row_q4_0/q4_1/q4_K read them: weight = step * q + offset."""
    def f16(at: int) -> np.ndarray:
        return raw[:, :, at:at + 2].copy().view("<f2")[:, :, 0].astype(np.float32)

    rows = len(raw)
    if kind == 2:
        return f16(0), -8 * f16(0)
    if kind == 3:
        return f16(0), f16(2)
    b = raw[:, :, 4:16]
    sc = [b[:, :, j] & 63 if j < 4 else (b[:, :, j + 4] & 15) | ((b[:, :, j - 4] >> 6) << 4)
          for j in range(8)]
    mn = [b[:, :, j + 4] & 63 if j < 4 else (b[:, :, j + 4] >> 4) | ((b[:, :, j] >> 6) << 4)
          for j in range(8)]
    step = f16(0)[:, :, None] * np.stack(sc, axis=2).astype(np.float32)
    low = -(f16(2)[:, :, None] * np.stack(mn, axis=2).astype(np.float32))
    return step.reshape(rows, -1), low.reshape(rows, -1)


def _values(raw: np.ndarray, kind: int) -> np.ndarray:
    """The (rows, groups, 32) 4-bit values of `_blocks` rows, in llama.cpp's order."""
    if kind in (2, 3):
        qs = raw[:, :, 2 if kind == 2 else 4:]
        return np.concatenate([qs & 15, qs >> 4], axis=2)
    qs = raw[:, :, 16:].reshape(len(raw), -1, 4, 1, 32)
    return np.concatenate([qs & 15, qs >> 4], axis=3).reshape(len(raw), -1, 32)


def _check_4_bit_weights(gguf: Path, folder: Path, every: int) -> tuple[int, int, float]:
    """Every `every`-th row of each 4-bit matrix of the converted graph, as the graph computes
    it, against llama.cpp's dequantization of the file's bytes (numpy): rows checked, the
    file's 4-bit rows, and the worst error in steps of the row's groups.

    NOTE: the graph's rows are sampled first; of the file's rows, only those with the steps of
    a sampled row are unpacked (all of Qwen2.5-Coder's took 20 s)."""
    from npu_proxy.models.gguf import read_gguf_tensors

    model = ov.Core().read_model(folder / "openvino_model.xml")
    # (the scales' f16 bytes, q, zero, scale) of each row sampled
    sampled: list[tuple[bytes, np.ndarray, np.ndarray, np.ndarray]] = []
    for op in model.get_ordered_ops():
        if op.get_type_name() != "Subtract":
            continue
        source = op.input_value(0).get_node().input_value(0).get_node()
        if str(source.get_element_type()) != "<Type: 'uint4_t'>":
            continue
        (multiply,) = [t.get_node() for t in op.output(0).get_target_inputs()]
        scale = _constant(multiply.input_value(1).get_node(), every)
        keys = [k.tobytes() for k in scale[:, :, 0].astype(np.float16)]
        sampled += zip(keys, _constant(source, every), _constant(op.input_value(1).get_node(),
                                                                 every), scale, strict=True)
    wanted = {key for key, *_ in sampled}
    data = np.memmap(gguf, np.uint8, mode="r")
    by_scales: dict[bytes, list[tuple[np.ndarray, np.ndarray, np.ndarray]]] = {}
    rows = 0
    for t in read_gguf_tensors(gguf):
        if t.ggml_type in _BLOCKS:
            raw = _blocks(data, t)
            keys = [k.tobytes() for k in _steps(raw, t.ggml_type)[0].astype(np.float16)]
            rows += len(keys)
            hits = [r for r, key in enumerate(keys) if key in wanted]
            step, low = _steps(np.asarray(raw[hits]), t.ggml_type)
            values = _values(np.asarray(raw[hits]), t.ggml_type)
            for i, r in enumerate(hits):
                by_scales.setdefault(keys[r], []).append((step[i], low[i], values[i]))
    checked, worst = 0, 0.0
    for key, q, zero, scale in sampled:
        # NOTE: an embedding repeats some rows' scales: the row is the one with its values.
        found = [c for c in by_scales.get(key, []) if np.array_equal(q, c[2])]
        if not found:  # NOTE: a dead group's scale was made its offset
            continue
        step, low, values = found[0]
        off = np.abs((q - zero) * scale - (step[:, None] * values + low[:, None]))
        worst = max(worst, float((off.max(axis=1) / np.maximum(np.abs(step), 1e-6)).max()))
        checked += 1
    return checked, rows, worst


def _eight_bit(data: np.ndarray, t: object,
               first: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """A Q8_0 or Q6_K tensor's (rows, groups, size) signed values and (rows, groups) steps,
    as llama.cpp's dequantize_row_q8_0/q6_K read them: weight = step * q. Its `first` rows
    only, when given."""
    dims, kind, offset = t.dims, t.ggml_type, t.offset  # type: ignore[attr-defined]
    rows = int(np.prod(dims[1:]))
    size, per = {8: (34, 32), 14: (210, 256)}[kind]
    raw = data[offset:offset + rows * (dims[0] // per) * size].reshape(rows, -1, size)[:first]
    rows = len(raw)
    if kind == 8:
        step = raw[:, :, :2].copy().view("<f2")[:, :, 0].astype(np.float32)
        return raw[:, :, 2:].copy().view(np.int8), step
    ql = raw[:, :, :128].reshape(rows, -1, 2, 64)
    qh = raw[:, :, 128:192].reshape(rows, -1, 2, 32)
    values = np.stack([(ql[..., :32] & 15) | ((qh & 3) << 4),
                       (ql[..., 32:] & 15) | (((qh >> 2) & 3) << 4),
                       (ql[..., :32] >> 4) | (((qh >> 4) & 3) << 4),
                       (ql[..., 32:] >> 4) | (((qh >> 6) & 3) << 4)], axis=3).view(np.int8) - 32
    sc = raw[:, :, 192:208].copy().view(np.int8).astype(np.float32)
    d = raw[:, :, 208:210].copy().view("<f2").astype(np.float32)
    return values.reshape(rows, -1, 16), (d * sc).reshape(rows, -1)


def _eight_bit_shape(t: object) -> tuple[int, int, int]:
    dims, kind = t.dims, t.ggml_type  # type: ignore[attr-defined]
    size = 32 if kind == 8 else 16
    return int(np.prod(dims[1:])), dims[0] // size, size


def _user(node: ov.Node) -> ov.Node:
    """The node's first consumer."""
    return next(t.get_node() for t in node.output(0).get_target_inputs())


def _check_8_bit_weights(gguf: Path, folder: Path) -> tuple[int, int, float]:
    """Each 8-bit matrix of the converted graph (Q8_0, Q6_K), as the graph computes it,
    against llama.cpp's dequantization of the file's bytes (numpy): the graph's values are
    the file's and its steps the file's to f16 rounding. Returns the matrices matched, the
    file's 8-bit tensors and the worst relative error of a step."""
    from npu_proxy.models.gguf import read_gguf_tensors

    data = np.memmap(gguf, np.uint8, mode="r")
    tensors = [t for t in read_gguf_tensors(gguf) if t.ggml_type in (8, 14)]
    model = ov.Core().read_model(folder / "openvino_model.xml")
    matched, worst = 0, 0.0
    for op in model.get_ordered_ops():
        if op.get_type_name() != "Constant" or op.get_element_type() != ov.Type.i8:
            continue
        q = np.asarray(op.get_data())
        node = _user(op)
        while node.get_type_name() == "Convert":
            node = _user(node)
        if node.get_type_name() == "Subtract":
            q = (q - _constant(node.input_value(1).get_node())).astype(np.int8)
            node = _user(node)
        assert node.get_type_name() == "Multiply", node
        scale = _constant(node.input_value(1).get_node())[..., 0]
        # NOTE: a tensor's first row first: all of each (Qwen2.5-Coder's Q6_K) took 10 s.
        found = [read for t in tensors if _eight_bit_shape(t) == q.shape
                 and np.array_equal(_eight_bit(data, t, 1)[0], q[:1])
                 and np.array_equal((read := _eight_bit(data, t))[0], q)]
        assert len(found) == 1, (op.get_friendly_name(), q.shape)
        step = found[0][1]
        off = np.abs(scale - step) / np.maximum(np.abs(step), 1e-30)
        worst = max(worst, float(off[step != 0].max()))
        matched += 1
    return matched, len(tensors), worst


def test_8_bit_weights_are_llama_cpps_dequantized_weights(converted: Converted) -> None:
    """SmolLM2's Q8_0 embedding (also its output layer), as the converted graph computes
    it: the file's values, each block's f16 step exactly."""
    gguf = small_gguf()
    matched, tensors, worst = _check_8_bit_weights(gguf, converted.folder)
    assert matched == tensors == 1
    assert worst == 0.0, worst


def _eight_bit_constants(model: ov.Model) -> tuple[ov.Node, ov.Node]:
    """The graph's one i8 weight constant and its scale constant (SmolLM2's embedding)."""
    (values,) = [op for op in model.get_ordered_ops() if op.get_type_name() == "Constant"
                 and op.get_element_type() == ov.Type.i8]
    node = _user(values)
    while node.get_type_name() != "Multiply":
        node = _user(node)
    scale = node.input_value(1).get_node()
    while scale.get_type_name() == "Convert":
        scale = scale.input_value(0).get_node()
    return values, scale


def _replaced(node: ov.Node, data: np.ndarray) -> None:
    node.output(0).replace(ov.op.Constant(np.ascontiguousarray(data)).output(0))


def test_the_conversion_refuses_8_bit_weights_that_are_not_the_files(
        converted: Converted) -> None:
    """The conversion's own check (workers/generation/gguf_check.py) of the 8-bit weights it
    publishes: it ran on the embedded model's conversion; it takes the rows reordered (as
    GenAI reorders attention rows) and refuses a value or a step changed, or rows whose
    steps are another row's."""
    from npu_proxy.workers.generation.gguf_check import WrongWeights, check_8_bit

    assert "8-bit weights checked against the file: 1 graph matrices, 1 of 1 tensors in" \
        in converted.log, converted.log
    gguf = small_gguf()
    order = np.random.default_rng(0).permutation(49152)

    def changed(values_of: Any, scale_of: Any) -> tuple[int, int]:
        model = ov.Core().read_model(converted.folder / "openvino_model.xml")
        values, scale = _eight_bit_constants(model)
        _replaced(values, values_of(np.asarray(values.get_data()).copy()))
        _replaced(scale, scale_of(np.asarray(scale.get_data()).copy()))
        return check_8_bit(model, gguf)

    def same(a: np.ndarray) -> np.ndarray:
        return a

    def one_value(a: np.ndarray) -> np.ndarray:
        a[7, 3, 5] ^= 1
        return a

    def one_step(a: np.ndarray) -> np.ndarray:
        a.reshape(-1)[100] *= 1.01
        return a

    assert changed(same, same) == (1, 1)
    assert changed(lambda a: a[order], lambda a: a[order]) == (1, 1)
    with pytest.raises(WrongWeights, match="steps differ"):
        changed(lambda a: a[order], same)
    with pytest.raises(WrongWeights, match="values are not the file's"):
        changed(one_value, same)
    with pytest.raises(WrongWeights, match="steps differ"):
        changed(same, one_step)


def test_q4_1_weights_are_llama_cpps_dequantized_weights(converted: Converted) -> None:
    """Every Q4_1 weight of the file, as the converted graph computes it, is d * q + m of
    its block (numpy, from the file's bytes), to f16 rounding of the zero point: GenAI's
    own conversion rounds the minimum to a 4-bit zero point, up to half a step off."""
    gguf = small_gguf()
    checked, rows, worst = _check_4_bit_weights(gguf, converted.folder, 1)
    assert checked == rows > 1000 * SMALL_LAYERS
    assert worst <= 1 / 64, worst


# NOTE: the Q4_0 file keeps the first two of SmolLM2's 30 layers: what is checked is each
# layer's tensors, and its conversion (with the probe) costs a third of the whole model's.
Q4_0_LAYERS = 2


def _q4_0(name: str, kind: int, data: np.ndarray) -> tuple[int, np.ndarray]:
    """A Q4_1 tensor requantized by llama.cpp's own GGUF package (its numpy quantizers, as
    llama-quantize rounds): the attention's query and key to Q8_0 (rows GenAI reorders), the
    others to Q4_0; any other tensor as it is."""
    from gguf import GGMLQuantizationType as Kinds
    from gguf.quants import dequantize, quantize

    if kind != Kinds.Q4_1:
        return kind, data
    new = Kinds.Q8_0 if name.endswith(("attn_q.weight", "attn_k.weight")) else Kinds.Q4_0
    return new, quantize(dequantize(data, Kinds.Q4_1), new)


def test_q4_0_weights_are_checked_in_the_conversion(tmp_path: Path,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    """A Q4_0 file (Ollama's older default quantization) with Q8_0 attention: GenAI's zero
    point 8 is exact; the conversion checks every Q4_0 and Q8_0 tensor against the file's
    bytes all the same (the query's and key's rows reordered), and the graph computes
    llama.cpp's weights."""
    from small_gguf import copy_gguf

    gguf = copy_gguf(small_gguf(), tmp_path / "smollm2-q4_0.gguf",
                     Q4_0_LAYERS, _q4_0, file_type=2)  # NOTE: MOSTLY_Q4_0
    caplog.set_level(logging.INFO, logger="npu_proxy.workers")
    folder = Path(loadable(str(gguf), tmp_path / "cache"))
    assert folder.parent.name == GGUF_IR, caplog.text
    # Each layer: attn_v, attn_output and the three of the feed-forward in Q4_0; attn_q and
    # attn_k in Q8_0, and the embedding.
    assert f"4-bit weights checked against the file: {5 * Q4_0_LAYERS} of {5 * Q4_0_LAYERS} " \
        "tensors, 0 zero points made exact" in caplog.text
    eight = 2 * Q4_0_LAYERS + 1
    assert f"8-bit weights checked against the file: {eight} graph matrices, {eight} of " \
        f"{eight} tensors" in caplog.text
    checked, rows, worst = _check_4_bit_weights(gguf, folder, 7)
    assert checked > rows // 7 * 0.9
    assert worst <= 1 / 64, worst


@pytest.mark.slow
def test_q4_k_weights_are_llama_cpps_dequantized_weights() -> None:
    """The same for Qwen2.5-Coder-1.5B Q4_K_M's Q4_K matrices (a sample of rows), as the
    server converts it (in a child process)."""
    from qwen_coder import Unavailable, ensure
    from serverctl import MODEL_CACHE

    try:
        gguf = ensure(MODEL_CACHE)
    except Unavailable as exc:
        pytest.skip(str(exc))
    folder = Path(loadable(str(gguf), MODEL_CACHE))
    checked, rows, worst = _check_4_bit_weights(gguf, folder, 97)
    assert checked > rows // 97 * 0.9
    assert worst <= 1 / 32, worst
    # NOTE: the Q6_K ones: the 6-bit values exactly, each group's step d * scale rounded
    # once to f16 (llama.cpp multiplies in f32): within half an f16 ulp.
    matched, tensors, worst = _check_8_bit_weights(gguf, folder)
    assert matched == tensors == 29
    assert worst <= 2.0 ** -11, worst
