"""The embedded default reranker, built from the embedded all-MiniLM-L6-v2 files.

No cross-encoder can be obtained offline here, so the reranker is the bi-encoder MiniLM put
behind the interface OpenVINO GenAI's ``TextRerankPipeline`` expects from a cross-encoder:
a model taking ``input_ids``, ``attention_mask`` and ``token_type_ids`` of a tokenized
(query, document) pair and giving ``logits`` of shape [batch, 1], plus a tokenizer IR that
encodes pairs. The graph, composed with OpenVINO's Python graph API around the MiniLM encoder
(the same int8 ONNX file and tokenizer as workers/embed_model.py, pinned by sha256):

- the query segment (token_type_ids 0: ``[CLS] query [SEP]``) is cut to the batch's longest
  query and encoded as it is;
- the document segment (token_type_ids 1: ``document [SEP]``) is moved to position 0 behind
  the row's ``[CLS]`` (a gather per row), so it is encoded exactly as the embedding model
  encodes the document alone;
- each is mean-pooled over its own mask, L2-normalised, and the cosine ``c`` of the two is
  turned into the logit of ``(1 + c) / 2``. The pipeline applies a sigmoid to a one-column
  output, so ``relevance_score = (1 + cosine) / 2``: the embedding model's cosine of the query
  and the document, mapped onto [0, 1].

Two copies of the encoder (one per segment) rather than one batch of both: the query copy
runs on the query's few tokens only, not on the whole padded pair.

The tokenizer IR is ``openvino_tokenizers.convert_tokenizer(..., number_of_inputs=2)``.
Measured with openvino-tokenizers 2026.4: that graph corrupts memory (the process aborts with
"double free or corruption") when its first input is one string broadcast against 16 or more
second strings, which is exactly how TextRerankPipeline calls it (one query, n documents).
So the IR here repeats a lone string of either input to the other input's count (a Gather,
which the CPU plugin runs on strings) before anything else, and the broadcast path is never
taken. A pulled reranker's tokenizer has the same flaw (GenAI adds its second input the same
way), so ``pair_safe_folder`` gives it the same treatment: its tokenizer converted again from
its own Hugging Face files with two inputs and the repeat, in a folder of the model cache that
links the rest of its files.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import openvino_genai

from npu_proxy.models.registry import ModelSourceMissing
from npu_proxy.workers.embed_model import build_from_minilm

logger = logging.getLogger(__name__)

__all__ = ["MAX_PAIR_LENGTH", "ensure_minilm_rerank_ir", "pair_safe_folder", "rerank_config"]

# NOTE: config.json max_position_embeddings: a pair (or, after the move, a document) longer
# than this would overrun the position embeddings, so pairs are cut here.
MAX_PAIR_LENGTH = 512
_READY_FILES = ("openvino_model.xml", "openvino_tokenizer.xml")
_COPIED_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "vocab.txt")
# NOTE: the README says what this model is; modelinfo and /api/show read config.json.
_NOTE = ("Built by npu-proxy from all-MiniLM-L6-v2 (int8): a bi-encoder behind a cross-encoder's "
         "interface. relevance_score = (1 + cosine of the query's and the document's "
         "mean-pooled embeddings) / 2.\n")


def ensure_minilm_rerank_ir(dest: Path) -> Path:
    """Build the reranker folder at ``dest`` unless it is already there; return ``dest``."""
    dest = Path(dest)
    if all((dest / name).is_file() for name in _READY_FILES):
        return dest
    return build_from_minilm(dest, "the embedded reranker", _build)


def rerank_config(max_length: int) -> openvino_genai.TextRerankPipeline.Config:
    """Every document scored (the worker sorts and cuts to top_n), pairs cut at max_length."""
    config = openvino_genai.TextRerankPipeline.Config()
    # NOTE: top_n is a size_t in the pipeline; the worker never sends more documents.
    config.top_n = 1 << 30
    config.max_length = max_length
    config.pad_to_max_length = False
    config.padding_side = "right"
    return config


def _build(onnx_path: Path, tokenizer_dir: Path, out: Path) -> None:
    import openvino as ov
    import openvino_tokenizers
    from transformers import AutoTokenizer

    model = _scoring_model(ov.convert_model(onnx_path), ov.convert_model(onnx_path))
    # NOTE: the weights are already int8; fp16 compression would only round the fp32 scales.
    ov.save_model(model, out / "openvino_model.xml", compress_to_fp16=False)
    hf_tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer, detokenizer = openvino_tokenizers.convert_tokenizer(
        hf_tokenizer, with_detokenizer=True, max_length=MAX_PAIR_LENGTH, number_of_inputs=2)
    ov.save_model(_repeat_lone_string(tokenizer), out / "openvino_tokenizer.xml")
    ov.save_model(detokenizer, out / "openvino_detokenizer.xml")
    for name in _COPIED_FILES:
        shutil.copyfile(tokenizer_dir / name, out / name)
    (out / "README.md").write_text(_NOTE)


def _i64(value: Any) -> Any:
    import openvino.opset13 as ops

    return ops.constant(np.array(value, dtype=np.int64))


def _f32(value: float) -> Any:
    import openvino.opset13 as ops

    return ops.constant(np.float32(value))


def _inline(encoder: Any, feeds: dict[str, Any]) -> Any:
    """The encoder's last_hidden_state with its three inputs fed by ``feeds``."""
    for param in encoder.get_parameters():
        name = param.output(0).get_any_name()
        if name not in feeds:
            raise ModelSourceMissing(f"the MiniLM encoder has an unexpected input {name!r}")
        for target in list(param.output(0).get_target_inputs()):
            target.replace_source_output(feeds[name].output(0))
    return encoder.get_results()[0].input_value(0)


def _mean_normalized(hidden: Any, mask: Any) -> Any:
    """Mean over the masked tokens of [B, L, H], L2-normalised: [B, H]."""
    import openvino.opset13 as ops

    weights = ops.unsqueeze(ops.convert(mask, "f32"), _i64(2))
    summed = ops.reduce_sum(ops.multiply(hidden, weights), _i64([1]), keep_dims=False)
    count = ops.maximum(ops.reduce_sum(weights, _i64([1]), keep_dims=False), _f32(1e-9))
    mean = ops.divide(summed, count)
    norm = ops.sqrt(ops.reduce_sum(ops.multiply(mean, mean), _i64([1]), keep_dims=True))
    return ops.divide(mean, ops.maximum(norm, _f32(1e-12)))


def _scoring_model(query_encoder: Any, document_encoder: Any) -> Any:
    """input_ids, attention_mask, token_type_ids of pairs -> logits [B, 1] (see the module)."""
    import openvino as ov
    import openvino.opset13 as ops

    ids = ops.parameter([-1, -1], ov.Type.i64, name="input_ids")
    mask = ops.parameter([-1, -1], ov.Type.i64, name="attention_mask")
    types = ops.parameter([-1, -1], ov.Type.i64, name="token_type_ids")
    for param in (ids, mask, types):
        param.output(0).set_names({param.get_friendly_name()})

    document = ops.multiply(types, mask)           # 1 on the document segment
    query = ops.subtract(mask, document)           # 1 on [CLS] query [SEP]
    query_len = ops.reduce_sum(query, _i64([1]), keep_dims=True)        # [B, 1]
    document_len = ops.reduce_sum(document, _i64([1]), keep_dims=True)  # [B, 1]

    # Query: the pair's prefix, cut to the longest query of the batch.
    longest_query = ops.reduce_max(query_len, _i64([0, 1]), keep_dims=False)
    longest_query = ops.unsqueeze(longest_query, _i64(0))
    query_ids = ops.slice(ids, _i64([0]), longest_query, _i64([1]), _i64([1]))
    query_mask = ops.slice(query, _i64([0]), longest_query, _i64([1]), _i64([1]))
    query_vec = _mean_normalized(
        _inline(query_encoder, {"input_ids": query_ids, "attention_mask": query_mask,
                                "token_type_ids": ops.multiply(query_ids, _i64(0))}),
        query_mask)

    # Document: [CLS] + the document segment, moved to position 0.
    length = ops.add(ops.reduce_max(document_len, _i64([0, 1]), keep_dims=False), _i64(1))
    pos = ops.unsqueeze(ops.range(_i64(0), length, _i64(1), output_type="i64"), _i64(0))
    last = ops.subtract(ops.gather(ops.shape_of(ids, "i64"), _i64([1]), _i64(0)), _i64(1))
    source = ops.select(ops.equal(pos, _i64(0)), _i64(0),
                        ops.subtract(ops.add(pos, query_len), _i64(1)))
    source = ops.minimum(source, last)
    document_ids = ops.gather(ids, source, 1, batch_dims=1)
    document_mask = ops.convert(ops.less(pos, ops.add(document_len, _i64(1))), "i64")
    document_vec = _mean_normalized(
        _inline(document_encoder, {"input_ids": document_ids, "attention_mask": document_mask,
                                   "token_type_ids": ops.multiply(document_ids, _i64(0))}),
        document_mask)

    cosine = ops.reduce_sum(ops.multiply(query_vec, document_vec), _i64([1]), keep_dims=True)
    # logit((1 + c) / 2): the pipeline's sigmoid turns it back into (1 + c) / 2.
    p = ops.clamp(ops.multiply(ops.add(cosine, _f32(1.0)), _f32(0.5)), 1e-6, 1.0 - 1e-6)
    logits = ops.log(ops.divide(p, ops.subtract(_f32(1.0), p)))
    logits.output(0).set_names({"logits"})
    result = ops.result(logits)
    return ov.Model([result], [ids, mask, types], "minilm_bi_encoder_rerank")


def _repeat_lone_string(tokenizer: Any) -> Any:
    """The pair tokenizer with a lone string of either input repeated to the other's count."""
    import openvino.opset13 as ops

    first, second = tokenizer.get_parameters()
    first_n = ops.shape_of(first, "i64")
    second_n = ops.shape_of(second, "i64")
    one = _i64([1])

    def repeated(param: Any, own: Any, other: Any) -> Any:
        lone = ops.logical_and(ops.equal(own, one), ops.greater(other, one))
        count = ops.squeeze(ops.select(lone, other, own), _i64(0))
        index = ops.floor_mod(ops.range(_i64(0), count, _i64(1), output_type="i64"),
                              ops.maximum(own, one))
        return ops.gather(param, index, _i64(0))

    new_first = repeated(first, first_n, second_n)
    new_second = repeated(second, second_n, first_n)
    mine = {node.get_friendly_name() for node in (first_n, second_n, new_first, new_second)}
    for param, new in ((first, new_first), (second, new_second)):
        for target in list(param.output(0).get_target_inputs()):
            if target.get_node().get_friendly_name() not in mine:
                target.replace_source_output(new.output(0))
    tokenizer.validate_nodes_and_infer_types()
    return tokenizer


# A pulled reranker made pair-safe: its files linked, its tokenizer converted again.
PAIR_SAFE_ROOT = ".rerank-pairs"
_COMPLETE = "pair-safe-from.txt"
_TOKENIZER_IR = ("openvino_tokenizer.xml", "openvino_tokenizer.bin")


def pair_safe_folder(source: Path, cache: Path) -> Path:
    """A folder that loads as ``source`` does, with a tokenizer that never broadcasts.

    Built once under ``cache/.rerank-pairs``, keyed by the source folder and its tokenizer
    files' sizes and times; complete once its marker exists (written last). Raises when the
    tokenizer cannot be converted from the folder's Hugging Face tokenizer files.
    """
    source = source.resolve()
    stamp = [str(source)]
    for name in ("tokenizer.json", "tokenizer_config.json", *_TOKENIZER_IR):
        path = source / name
        if path.is_file():
            st = path.stat()
            stamp.append(f"{name}:{st.st_size}:{st.st_mtime_ns}")
    key = hashlib.sha256("\0".join(stamp).encode()).hexdigest()[:16]
    done = cache / PAIR_SAFE_ROOT / f"{source.name}-{key}"
    if (done / _COMPLETE).is_file():
        return done
    staging = done.with_name(f"{done.name}.{os.getpid()}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        _pair_safe_tokenizer(source, staging)
        for entry in source.iterdir():
            if entry.name in _TOKENIZER_IR or entry.name.startswith("."):
                continue
            try:
                (staging / entry.name).symlink_to(entry)
            except OSError:  # NOTE: no symlinks (Windows without the privilege): copy.
                if entry.is_dir():
                    shutil.copytree(entry, staging / entry.name)
                else:
                    shutil.copy2(entry, staging / entry.name)
        (staging / _COMPLETE).write_text(f"{source}\n")
        shutil.rmtree(done, ignore_errors=True)
        staging.rename(done)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return done


def _pair_safe_tokenizer(source: Path, out: Path) -> None:
    import openvino as ov
    import openvino_tokenizers
    from transformers import AutoTokenizer

    hf_tokenizer = AutoTokenizer.from_pretrained(source)
    converted = openvino_tokenizers.convert_tokenizer(hf_tokenizer, number_of_inputs=2)
    tokenizer = converted[0] if isinstance(converted, tuple) else converted
    ov.save_model(_repeat_lone_string(tokenizer), out / "openvino_tokenizer.xml")
