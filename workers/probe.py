"""What `npx-supervisor doctor` asks OpenVINO, run as `python -m npu_proxy.workers.probe ...`
in a child process (a broken driver may hang or abort; the doctor survives it). Prints one
JSON line.

    python -m npu_proxy.workers.probe info
        OpenVINO and GenAI versions; each device with its full name and the read-only
        properties that matter in a bug report (driver, memory, architecture).
    python -m npu_proxy.workers.probe selftest --device CPU --model PATH [--tokens 8]
        Load the model on the device and generate a few tokens, timing each step.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

# Read-only properties reported for every device that has them ...
_NAMED = ("FULL_DEVICE_NAME", "DEVICE_ARCHITECTURE", "DEVICE_TYPE", "OPTIMIZATION_CAPABILITIES")
# ... and any other read-only one whose name says driver, memory or version (NPU_DRIVER_VERSION,
# NPU_DEVICE_TOTAL_MEM_SIZE, GPU_DEVICE_TOTAL_MEM_SIZE, ...): names differ between plugins and
# releases, so they are matched rather than listed.
_WORDS = ("DRIVER", "MEM_SIZE", "VERSION", "EXECUTION_UNITS", "GOPS", "TILES", "MAX_")
# NOTE: an NPU pipeline is compiled for a fixed prompt length; small ones compile fastest.
_NPU_SELFTEST = {"MAX_PROMPT_LEN": 64, "MIN_RESPONSE_LEN": 32}


def _text(value: Any) -> str:
    if isinstance(value, list | tuple):
        return " ".join(str(v) for v in value)
    return str(value)


def info() -> dict[str, Any]:
    import openvino as ov
    import openvino_genai as ov_genai

    core = ov.Core()
    devices = []
    for name in core.available_devices:
        props: dict[str, str] = {}
        try:
            supported = core.get_property(name, "SUPPORTED_PROPERTIES")
        except Exception as exc:
            devices.append({"name": name, "full_name": name, "properties": {},
                            "error": str(exc)})
            continue
        for prop, mode in supported.items():
            if prop in _NAMED or (str(mode) == "RO" and any(w in prop for w in _WORDS)):
                try:
                    props[prop] = _text(core.get_property(name, prop))
                except Exception as exc:
                    props[prop] = f"(unreadable: {exc})"
        devices.append({"name": name, "full_name": props.pop("FULL_DEVICE_NAME", name),
                        "properties": props, "error": ""})
    return {"openvino": ov.get_version(), "genai": ov_genai.get_version(), "devices": devices}


def selftest(device: str, model: str, tokens: int, cache_dir: str) -> dict[str, Any]:
    import openvino_genai as ov_genai

    props: dict[str, Any] = {"CACHE_DIR": cache_dir} if cache_dir else {}
    if device.upper().startswith("NPU"):
        props.update(_NPU_SELFTEST)
    started = time.perf_counter()
    pipe = ov_genai.LLMPipeline(model, device, props)
    load_s = time.perf_counter() - started
    config = ov_genai.GenerationConfig()
    config.max_new_tokens = tokens
    config.ignore_eos = True
    result = pipe.generate(["The capital of France is"], config)
    metrics = result.perf_metrics
    return {
        "device": device,
        "load_s": round(load_s, 3),
        "first_token_s": round(metrics.get_ttft().mean / 1000, 3),
        "tokens": int(metrics.get_num_generated_tokens()),
        "generate_s": round(metrics.get_generate_duration().mean / 1000, 3),
        "text": result.texts[0],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m npu_proxy.workers.probe")
    sub = parser.add_subparsers(dest="what", required=True)
    sub.add_parser("info")
    test = sub.add_parser("selftest")
    test.add_argument("--device", required=True)
    test.add_argument("--model", required=True)
    test.add_argument("--tokens", type=int, default=8)
    test.add_argument("--cache-dir", default="")
    args = parser.parse_args(argv)
    if args.what == "info":
        out = info()
    else:
        out = selftest(args.device, args.model, args.tokens, args.cache_dir)
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
