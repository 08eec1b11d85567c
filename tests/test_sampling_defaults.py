"""A request that names no sampling parameters samples as the model's peers would sample the
same files: a GGUF with llama.cpp's defaults (what llama-server does), a model folder with
its generation_config.json (what vLLM and OpenVINO Model Server do), Ollama's API with
Ollama's. Claude Code sends no temperature: before, such a request sampled at temperature 1
from the whole vocabulary. Pure code: no server."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from starlette.requests import Request

from npu_proxy.gateway.api.request_path import RequestPath
from npu_proxy.gateway.core.model_table import ServedModel
from npu_proxy.models.sampling import LLAMA_CPP_DEFAULTS, file_sampling
from npu_proxy.protocol.messages import SamplingParams

QWEN_CONFIG = {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643],
               "pad_token_id": 151643, "repetition_penalty": 1.05, "temperature": 0.7,
               "top_p": 0.8, "top_k": 20, "transformers_version": "4.44.0"}


def _folder(tmp_path: Path, config: Any) -> Path:
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    return tmp_path


def test_a_gguf_samples_with_llama_cpps_defaults(tmp_path: Path) -> None:
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    assert file_sampling(gguf) == {"temperature": 0.8, "top_k": 40, "top_p": 0.95,
                                   "min_p": 0.05}


def test_a_folder_samples_with_its_generation_config(tmp_path: Path) -> None:
    assert file_sampling(_folder(tmp_path, QWEN_CONFIG)) == {
        "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
    (tmp_path / "generation_config.json").unlink()
    assert file_sampling(tmp_path) == {}


@pytest.mark.parametrize("config", [
    {"temperature": "0.7", "top_k": True, "top_p": None},
    {"temperature": float("nan"), "top_p": 1.5, "top_k": -1, "min_p": 2,
     "repetition_penalty": 0},
    {"temperature": 1e308, "repetition_penalty": float("inf")},
    [0.7, 0.8],
    "temperature",
])
def test_values_out_of_range_or_of_another_type_are_left_out(tmp_path: Path,
                                                              config: Any) -> None:
    assert file_sampling(_folder(tmp_path, config)) == {}


def test_an_unreadable_or_huge_config_is_left_out(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_bytes(b"\xff{not json")
    assert file_sampling(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.5, "pad": "x" * (1 << 20)}))
    assert file_sampling(tmp_path) == {}


def _sampling(path: str, params: SamplingParams, files: dict[str, float],
              own: dict[str, float] | None = None) -> SamplingParams:
    """RequestPath.sampling for a request on `path`, a model whose files set `files`."""
    async def file_defaults(model: ServedModel) -> dict[str, float]:
        return files

    catalog = SimpleNamespace(own_sampling=lambda model: own or {},
                              file_sampling=file_defaults)
    requests = SimpleNamespace(catalog=catalog)
    request = Request({"type": "http", "path": path, "headers": []})
    model = ServedModel(name="qwen2.5-coder:1.5b", kind="llm", workers=[])
    return asyncio.run(RequestPath.sampling(requests, request, model, params))  # type: ignore[arg-type]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages", "/v1/responses",
                                  "/v1/completions"])
def test_other_apis_take_the_files_defaults_for_what_a_request_leaves_out(path: str) -> None:
    bare = _sampling(path, SamplingParams(max_tokens=8), LLAMA_CPP_DEFAULTS)
    assert (bare.temperature, bare.top_k, bare.top_p, bare.min_p) == (0.8, 40, 0.95, 0.05)
    mine = _sampling(path, SamplingParams(temperature=0.0, top_p=1.0), LLAMA_CPP_DEFAULTS)
    assert (mine.temperature, mine.top_p, mine.top_k) == (0.0, 1.0, 40)
    # The model's own (an embedded model's, as Ollama's library sets them) come first.
    own = _sampling(path, SamplingParams(), LLAMA_CPP_DEFAULTS, {"temperature": 0.2})
    assert (own.temperature, own.top_k) == (0.2, 40)


def test_ollamas_api_keeps_ollamas_defaults() -> None:
    bare = _sampling("/api/chat", SamplingParams(), LLAMA_CPP_DEFAULTS)
    assert (bare.temperature, bare.top_k, bare.top_p, bare.min_p) == (0.8, 40, 0.9, None)
