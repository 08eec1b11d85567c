"""Convert a Transformers repository to OpenVINO IR with optimum-intel and install it.

optimum-intel (and the torch it needs) is an optional extra: `pip install
'npu-proxy[convert]'`. For NPU the weights must be INT4 symmetric, channel-wise:
`--weight-format int4 --sym --group-size -1 --ratio 1.0`.
"""

from __future__ import annotations

import inspect
import logging
import shutil
import time
from collections.abc import Callable
from typing import Any

from npu_proxy.models.pull.download import file_hashes
from npu_proxy.models.registry import ModelNameError, canonical
from npu_proxy.models.store import Manifest, ManifestFile, ModelStore
from npu_proxy.protocol.config import Config

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'npu-proxy[convert]'"


class ConvertError(Exception):
    pass


def _optimum() -> tuple[Any, Any, Any]:
    try:
        from optimum.exporters.openvino import main_export
        from optimum.intel import OVConfig, OVWeightQuantizationConfig
    except ImportError as exc:
        raise ConvertError(
            f"converting needs optimum-intel, an optional extra that is not installed "
            f"({exc.name or exc}); install it with: {INSTALL_HINT}") from None
    return main_export, OVConfig, OVWeightQuantizationConfig


def default_name(repo: str, weight_format: str, sym: bool) -> str:
    return canonical(f"{repo}:{weight_format}{'-sym' if sym else ''}")


def convert_repo(config: Config, repo: str, *, weight_format: str = "int4", sym: bool = False,
                 group_size: int | None = None, ratio: float | None = None,
                 task: str = "text-generation-with-past", name: str | None = None,
                 echo: Callable[[str], Any] = print) -> Manifest:
    try:
        key = canonical(name) if name else default_name(repo, weight_format, sym)
    except ModelNameError as exc:
        raise ConvertError(str(exc)) from exc
    main_export, ov_config_cls, quant_cls = _optimum()
    if weight_format == "fp16":
        ov_config = ov_config_cls(dtype="fp16")
    else:
        quant: dict[str, Any] = {"bits": 4 if weight_format == "int4" else 8, "sym": sym}
        if group_size is not None:
            quant["group_size"] = group_size
        if ratio is not None:
            quant["ratio"] = ratio
        ov_config = ov_config_cls(quantization_config=quant_cls(**quant))
    store = ModelStore(config.model_cache_path())
    staging = store.staging_dir(key)
    if staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    echo(f"converting {repo} to OpenVINO IR ({weight_format}"
         f"{', sym' if sym else ''}) in {staging}")
    kwargs: dict[str, Any] = {"model_name_or_path": repo, "output": staging, "task": task,
                              "ov_config": ov_config}
    if "convert_tokenizer" in inspect.signature(main_export).parameters:
        kwargs["convert_tokenizer"] = True
    try:
        main_export(**kwargs)
    except Exception as exc:
        shutil.rmtree(staging, ignore_errors=True)
        raise ConvertError(f"conversion of {repo} failed: {exc}") from exc
    files = []
    for path in sorted(p for p in staging.rglob("*") if p.is_file()):
        size = path.stat().st_size
        sha256, _ = file_hashes(path, size)
        files.append(ManifestFile(path=path.relative_to(staging).as_posix(), size=size,
                                  sha256=sha256))
    if not (staging / "openvino_model.xml").is_file():
        shutil.rmtree(staging, ignore_errors=True)
        raise ConvertError(f"conversion of {repo} wrote no openvino_model.xml")
    npu_ready = weight_format == "int4" and sym and group_size == -1
    kinds = {"feature-extraction": "embed", "text-classification": "rerank"}
    manifest = Manifest(name=key, kind=kinds.get(task, "llm"),
                        format="openvino", source=f"convert:hf.co/{repo}", files=files,
                        repo=repo, npu_ready=npu_ready, pulled_at=time.time())
    store.install(staging, manifest)
    return manifest
