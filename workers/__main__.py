"""Run one device worker: `python -m npu_proxy.workers --config <file> --worker <name>`."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from npu_proxy.models.locate import Origin, configured_template, locate
from npu_proxy.protocol.config import read_config_file
from npu_proxy.protocol.logs import setup_logging
from npu_proxy.workers.process import WorkerProcess

if TYPE_CHECKING:
    from npu_proxy.workers.engine import Engine

log = logging.getLogger("workers")


def _build_engine(proc: WorkerProcess) -> Engine:
    spec = proc.spec
    found = locate(proc.config, spec.model_name)
    path = found.path
    log.info("loading %s (%s, %s) on %s", spec.model_name, path, found.origin.value, spec.device)
    if spec.role == "embed":
        from npu_proxy.workers.embed_engine import EmbedEngine

        return EmbedEngine(proc.config, spec, str(path), proc.emit,
                           build_minilm=found.origin is Origin.EMBEDDED_IR)
    if spec.role == "rerank":
        from npu_proxy.workers.rerank_engine import RerankEngine

        return RerankEngine(spec, str(path), proc.emit, proc.config.model_cache_path(),
                            build_minilm=found.origin is Origin.EMBEDDED_IR)
    if spec.role == "asr":
        from npu_proxy.workers.speech.asr_engine import AsrEngine

        return AsrEngine(proc.config, spec, str(path), proc.emit,
                         build_embedded=found.origin is Origin.EMBEDDED_IR)
    if spec.role == "tts":
        from npu_proxy.workers.speech.tts_engine import TtsEngine

        return TtsEngine(spec, str(path), proc.emit, proc.config.max_speech_phonemes)
    from npu_proxy.models.facts import describe_model
    from npu_proxy.workers.batch_engine import BatchEngine
    from npu_proxy.workers.gguf_ir import loadable
    from npu_proxy.workers.serial_engine import SerialEngine

    context = describe_model(path, cache_dir=proc.config.model_cache_path()).context_length
    from npu_proxy.workers.vlm_engine import VlmEngine

    kind: type[SerialEngine | BatchEngine] = BatchEngine
    if spec.role == "npu":
        kind = SerialEngine
    elif spec.role == "vlm":
        kind = VlmEngine
    cache, hang = proc.config.model_cache_path(), spec.faults.hang_in_conversion
    engine = kind(spec, loadable(str(path), cache, proc.stopping, hang), context or 2048,
                  proc.emit)
    if spec.draft_model and isinstance(engine, BatchEngine):
        draft = locate(proc.config, spec.draft_model).path
        engine.draft_path = loadable(str(draft), cache, proc.stopping, hang)
    engine.chat_template = configured_template(proc.config, spec.model_name)
    return engine


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m npu_proxy.workers")
    parser.add_argument("--config", required=True, type=Path)
    parser.add_argument("--worker", required=True)
    parser.add_argument("--recovering", action="store_true",
                        help="this process replaces one that crashed (the supervisor's flag)")
    args = parser.parse_args(argv)
    config = read_config_file(args.config)
    spec = config.worker(args.worker)
    setup_logging(f"worker:{spec.name}", config.log_level, config.log_format,
                  fields={"worker": spec.name, "device": spec.device})
    return WorkerProcess(config, spec, args.recovering).run(_build_engine)


if __name__ == "__main__":
    sys.exit(main())
