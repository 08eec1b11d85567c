"""A CTranslate2 Whisper model (model.bin, config.json, tokenizer.json) as Transformers'
`WhisperForConditionalGeneration` names its weights, and the json files of its folder, with
numpy alone: what workers/speech/whisper_graph.py writes as OpenVINO IR (and what
optimum-intel's torch export would read as a Transformers folder, `write_hf_folder`).

CTranslate2's converter (python/ctranslate2/converters/transformers.py `WhisperLoader`, a
`BartLoader`) fuses what Transformers keeps apart, and this undoes it:
- self-attention `linear_0` = q, k and v stacked (rows), `linear_1` = out_proj;
- the decoder's cross-attention `linear_0` = q, `linear_1` = k and v stacked, `linear_2` =
  out_proj;
- Whisper's k projections have no bias: the fused bias carries zeros in their place;
- layer norms are `gamma`/`beta`; `decoder/projection` is an alias of the token embeddings
  (Transformers ties `proj_out` to them too).
Sizes (layers, heads, widths) are read from the tensors themselves.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np

from npu_proxy.models.ctranslate2 import CT2FormatError, CT2Model, read_model_bin

# NOTE: CTranslate2's ActivationType enum (include/ctranslate2/ops/activation.h).
_ACTIVATIONS = {0: "relu", 1: "gelu_new", 2: "silu", 3: "gelu"}
_SPECIAL_NAMES = ("<|endoftext|>", "<|startoftranscript|>", "<|translate|>", "<|transcribe|>",
                  "<|startoflm|>", "<|startofprev|>", "<|nocaptions|>", "<|notimestamps|>")
MULTILINGUAL_VOCAB = 51865
_LANGUAGE = re.compile(r"<\|[a-z]{2,3}(?:_[a-z]+)?\|>")


def _linear(out: dict[str, np.ndarray[Any, Any]], model: CT2Model, src: str, dst: str,
            bias: bool = True) -> None:
    out[f"{dst}.weight"] = model.variables[f"{src}/weight"]
    if bias:
        out[f"{dst}.bias"] = model.variables[f"{src}/bias"]


def _norm(out: dict[str, np.ndarray[Any, Any]], model: CT2Model, src: str, dst: str) -> None:
    out[f"{dst}.weight"] = model.variables[f"{src}/gamma"]
    out[f"{dst}.bias"] = model.variables[f"{src}/beta"]


def _split(out: dict[str, np.ndarray[Any, Any]], model: CT2Model, src: str, dst: str,
           names: tuple[str, ...]) -> None:
    """A fused projection (rows stacked in `names` order) as separate ones; `k_proj` takes
    no bias (checked to be zero)."""
    weights = np.split(model.variables[f"{src}/weight"], len(names))
    biases = np.split(model.variables[f"{src}/bias"], len(names))
    for name, weight, bias in zip(names, weights, biases, strict=True):
        out[f"{dst}.{name}.weight"] = weight
        if name == "k_proj":
            if np.any(bias != 0):
                raise CT2FormatError(f"{src}: the k projection has a non-zero bias")
        else:
            out[f"{dst}.{name}.bias"] = bias


def _layers(model: CT2Model, side: str) -> int:
    pattern = re.compile(rf"{side}/layer_(\d+)/")
    found = {int(m.group(1)) for name in model.variables if (m := pattern.match(name))}
    if not found or found != set(range(len(found))):
        raise CT2FormatError(f"no consecutive {side} layers in the model")
    return len(found)


def _self_attention(out: dict[str, np.ndarray[Any, Any]], model: CT2Model, src: str,
                    dst: str) -> None:
    """A layer's self-attention (encoder and decoder alike)."""
    _split(out, model, f"{src}/self_attention/linear_0", f"{dst}.self_attn",
           ("q_proj", "k_proj", "v_proj"))
    _linear(out, model, f"{src}/self_attention/linear_1", f"{dst}.self_attn.out_proj")
    _norm(out, model, f"{src}/self_attention/layer_norm", f"{dst}.self_attn_layer_norm")


def _ffn(out: dict[str, np.ndarray[Any, Any]], model: CT2Model, src: str, dst: str) -> None:
    """A layer's feed-forward block (encoder and decoder alike)."""
    _linear(out, model, f"{src}/ffn/linear_0", f"{dst}.fc1")
    _linear(out, model, f"{src}/ffn/linear_1", f"{dst}.fc2")
    _norm(out, model, f"{src}/ffn/layer_norm", f"{dst}.final_layer_norm")


def state_dict(model: CT2Model) -> dict[str, np.ndarray[Any, Any]]:
    """Transformers' parameter names -> float32 arrays."""
    if model.spec != "WhisperSpec":
        raise CT2FormatError(f"a {model.spec}, not a WhisperSpec model")
    out: dict[str, np.ndarray[Any, Any]] = {}
    enc, dec = "model.encoder", "model.decoder"
    for conv in ("conv1", "conv2"):
        _linear(out, model, f"encoder/{conv}", f"{enc}.{conv}")
    out[f"{enc}.embed_positions.weight"] = model.variables["encoder/position_encodings/encodings"]
    _norm(out, model, "encoder/layer_norm", f"{enc}.layer_norm")
    for i in range(_layers(model, "encoder")):
        src, dst = f"encoder/layer_{i}", f"{enc}.layers.{i}"
        _self_attention(out, model, src, dst)
        _ffn(out, model, src, dst)
    out[f"{dec}.embed_tokens.weight"] = model.variables["decoder/embeddings/weight"]
    out[f"{dec}.embed_positions.weight"] = model.variables["decoder/position_encodings/encodings"]
    _norm(out, model, "decoder/layer_norm", f"{dec}.layer_norm")
    for i in range(_layers(model, "decoder")):
        src, dst = f"decoder/layer_{i}", f"{dec}.layers.{i}"
        _self_attention(out, model, src, dst)
        _linear(out, model, f"{src}/attention/linear_0", f"{dst}.encoder_attn.q_proj")
        _split(out, model, f"{src}/attention/linear_1", f"{dst}.encoder_attn",
               ("k_proj", "v_proj"))
        _linear(out, model, f"{src}/attention/linear_2", f"{dst}.encoder_attn.out_proj")
        _norm(out, model, f"{src}/attention/layer_norm", f"{dst}.encoder_attn_layer_norm")
        _ffn(out, model, src, dst)
    return {name: np.ascontiguousarray(array, dtype=np.float32) for name, array in out.items()}


def _config(model: CT2Model, ct2_config: dict[str, Any]) -> dict[str, Any]:
    vocab, width = model.variables["decoder/embeddings/weight"].shape
    ffn = model.variables["encoder/layer_0/ffn/linear_0/weight"].shape[0]
    mels = model.variables["encoder/conv1/weight"].shape[1]
    activation = _ACTIVATIONS.get(model.scalar("decoder/activation"), "gelu")
    return {
        "architectures": ["WhisperForConditionalGeneration"], "model_type": "whisper",
        "vocab_size": int(vocab), "num_mel_bins": int(mels), "d_model": int(width),
        "encoder_layers": _layers(model, "encoder"), "decoder_layers": _layers(model, "decoder"),
        "num_hidden_layers": _layers(model, "encoder"),
        "encoder_attention_heads": model.scalar("encoder/num_heads"),
        "decoder_attention_heads": model.scalar("decoder/num_heads"),
        "encoder_ffn_dim": int(ffn), "decoder_ffn_dim": int(ffn),
        "max_source_positions": int(model.variables["encoder/position_encodings/encodings"]
                                    .shape[0]),
        "max_target_positions": int(model.variables["decoder/position_encodings/encodings"]
                                    .shape[0]),
        "activation_function": activation, "scale_embedding": False,
        "dropout": 0.0, "attention_dropout": 0.0, "activation_dropout": 0.0,
        "encoder_layerdrop": 0.0, "decoder_layerdrop": 0.0, "init_std": 0.02,
        "is_encoder_decoder": True, "use_cache": True, "tie_word_embeddings": True,
        "bos_token_id": 50257, "eos_token_id": 50256, "pad_token_id": 50256,
        "decoder_start_token_id": 50257, "max_length": 448,
        "suppress_tokens": list(ct2_config.get("suppress_ids", [])),
        "begin_suppress_tokens": list(ct2_config.get("suppress_ids_begin", [220, 50256])),
        "torch_dtype": "float32",
    }


def _generation_config(ids: dict[str, int], ct2_config: dict[str, Any],
                       languages: dict[str, int], vocab_size: int) -> dict[str, Any]:
    # NOTE: English-only Whisper models have 51864 tokens, multilingual ones 51865 or more
    # (Transformers' own test); the English-only tokenizers carry the language tokens too.
    multilingual = vocab_size >= MULTILINGUAL_VOCAB
    config: dict[str, Any] = {
        "alignment_heads": ct2_config.get("alignment_heads", []),
        "begin_suppress_tokens": list(ct2_config.get("suppress_ids_begin", [220, 50256])),
        "suppress_tokens": list(ct2_config.get("suppress_ids", [])),
        "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|endoftext|>"],
        "pad_token_id": ids["<|endoftext|>"],
        "decoder_start_token_id": ids["<|startoftranscript|>"],
        "no_timestamps_token_id": ids["<|notimestamps|>"],
        "prev_sot_token_id": ids["<|startofprev|>"],
        "is_multilingual": multilingual, "max_initial_timestamp_index": 50,
        "max_length": 448, "return_timestamps": False,
    }
    if multilingual:
        config["lang_to_id"] = languages
        config["task_to_id"] = {"transcribe": ids["<|transcribe|>"],
                                "translate": ids["<|translate|>"]}
        config["forced_decoder_ids"] = [[1, None], [2, ids["<|transcribe|>"]]]
    else:
        config["forced_decoder_ids"] = [[1, ids["<|notimestamps|>"]]]
    return config


_PREPROCESSOR = {
    "chunk_length": 30, "feature_extractor_type": "WhisperFeatureExtractor", "hop_length": 160,
    "n_fft": 400, "n_samples": 480000, "nb_max_frames": 3000, "padding_side": "right",
    "padding_value": 0.0, "processor_class": "WhisperProcessor",
    "return_attention_mask": False, "sampling_rate": 16000,
}


def _tokenizer_files(tokenizer: dict[str, Any],
                     vocab_size: int) -> tuple[dict[str, Any], dict[str, int], dict[str, int]]:
    """tokenizer.json with Whisper's timestamp tokens (<|0.00|> ... <|30.00|>) added after the
    special ones, as Transformers' own files have them; the special token ids; the languages."""
    added = list(tokenizer.get("added_tokens", []))
    ids = {token["content"]: int(token["id"]) for token in added}
    missing = [name for name in _SPECIAL_NAMES if name not in ids]
    if missing:
        raise CT2FormatError(f"tokenizer.json lacks {missing}")
    first = max(ids.values()) + 1
    for i in range(vocab_size - first):
        added.append({"id": first + i, "content": f"<|{i * 0.02:.2f}|>", "single_word": False,
                      "lstrip": False, "rstrip": False, "normalized": False, "special": False})
    languages = {name: i for name, i in ids.items()
                 if _LANGUAGE.fullmatch(name) and name not in _SPECIAL_NAMES}
    return {**tokenizer, "added_tokens": added}, ids, languages


def write_configs(model: CT2Model, ct2_dir: Path, out: Path) -> None:
    """Write into `out` what a Whisper folder has besides its weights: config.json,
    generation_config.json, preprocessor_config.json and the tokenizer's files."""
    ct2_config = json.loads((ct2_dir / "config.json").read_text())
    tokenizer = json.loads((ct2_dir / "tokenizer.json").read_text())
    config = _config(model, ct2_config)
    full, ids, languages = _tokenizer_files(tokenizer, config["vocab_size"])
    out.mkdir(parents=True, exist_ok=True)
    dumps = {
        "config.json": config,
        "generation_config.json": _generation_config(ids, ct2_config, languages,
                                                     config["vocab_size"]),
        "preprocessor_config.json": {**_PREPROCESSOR, "feature_size": config["num_mel_bins"]},
        "tokenizer.json": full,
        "vocab.json": tokenizer["model"]["vocab"],
        "tokenizer_config.json": {
            "tokenizer_class": "WhisperTokenizer", "model_max_length": 1024,
            "bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
            "unk_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
            "add_prefix_space": False, "errors": "replace",
            "additional_special_tokens": [t["content"] for t in tokenizer["added_tokens"]
                                          if t["content"] != "<|endoftext|>"],
        },
        "special_tokens_map.json": {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>",
                                    "unk_token": "<|endoftext|>", "pad_token": "<|endoftext|>"},
    }
    for name, value in dumps.items():
        (out / name).write_text(json.dumps(value, ensure_ascii=False, indent=1))
    merges = tokenizer["model"].get("merges", [])
    lines = [m if isinstance(m, str) else " ".join(m) for m in merges]
    (out / "merges.txt").write_text("#version: 0.2\n" + "\n".join(lines) + "\n")


def write_hf_folder(ct2_dir: Path, out: Path) -> None:
    """Write `out` as a Transformers Whisper folder: model.safetensors and `write_configs`'
    files (what optimum-intel's torch export reads; the tests' reference IR is made so)."""
    from safetensors.numpy import save_file

    model = read_model_bin(ct2_dir / "model.bin")
    write_configs(model, ct2_dir, out)
    save_file(state_dict(model), str(out / "model.safetensors"), metadata={"format": "pt"})
