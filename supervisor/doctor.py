"""npx-supervisor doctor: what a bug report needs to know about this machine, and what is wrong.

Everything OpenVINO says comes from `python -m npu_proxy.workers.probe` in a child process
with a deadline (a broken driver must not hang the doctor, and the supervisor never imports
OpenVINO). A check is ok, warn or fail; any fail makes the exit code 1.
"""

from __future__ import annotations

import ctypes.util
import json
import os
import platform
import shutil
import socket
import stat
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any, Literal

import click
import msgspec

from npu_proxy.models.locate import NotLocated, Origin, build_seconds, locate
from npu_proxy.models.registry import ModelSourceMissing
from npu_proxy.protocol import control
from npu_proxy.protocol.config import DEFAULT_LLM_MODEL, Config, WorkerSpec, speech_missing
from npu_proxy.protocol.sockets import IPC_PATH_MAX, ipc_path_refusal, longest_ipc_path
from npu_proxy.supervisor.cli_common import config_options, load

Status = Literal["ok", "warn", "fail"]
# Free space below this in the model cache is worth a warning (a 7B INT4 model is ~4 GB).
LOW_SPACE = 5 * 1000**3


class Check(msgspec.Struct):
    name: str
    status: Status
    detail: str


class Device(msgspec.Struct):
    name: str
    full_name: str
    properties: dict[str, str] = {}
    error: str = ""


class SelfTest(msgspec.Struct):
    device: str
    ok: bool
    load_s: float = 0.0
    first_token_s: float = 0.0
    tokens: int = 0
    generate_s: float = 0.0
    error: str = ""


class Report(msgspec.Struct):
    ok: bool
    npu_proxy: str
    python: str
    platform: str
    openvino: str
    genai: str
    devices: list[Device]
    checks: list[Check]
    selftest_model: str = ""
    selftests: list[SelfTest] = []


class ProbeError(Exception):
    pass


def _probe(args: list[str], timeout: float) -> Any:
    """One `python -m npu_proxy.workers.probe` run; its JSON line."""
    try:
        done = subprocess.run([sys.executable, "-m", "npu_proxy.workers.probe", *args],
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise ProbeError(f"no answer within {timeout:.0f} s") from exc
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        errors = [line for line in done.stderr.strip().splitlines() if line.strip()]
        raise ProbeError(errors[-1] if errors else f"exit code {done.returncode}")
    return json.loads(lines[-1])


def _size(n: float) -> str:
    return f"{n / 1000**3:.1f} GB"


# --- checks ------------------------------------------------------------------------------


def check_runtime_dir(path: Path) -> Check:
    """The private folder of the sockets: the user's own, 0700, not a link (or absent)."""
    name = "runtime folder"
    try:
        st = path.lstat()
    except FileNotFoundError:
        return Check(name, "ok", f"{path} (absent; created 0700 at start)")
    if stat.S_ISLNK(st.st_mode):
        return Check(name, "fail", f"{path} is a symbolic link")
    if not stat.S_ISDIR(st.st_mode):
        return Check(name, "fail", f"{path} is not a folder")
    if sys.platform == "win32":
        return Check(name, "ok", f"{path}")  # NOTE: no POSIX owner and mode to check there
    if st.st_uid != os.getuid():
        return Check(name, "fail", f"{path} belongs to uid {st.st_uid}, not {os.getuid()}")
    mode = stat.S_IMODE(st.st_mode)
    if mode != 0o700:
        return Check(name, "fail", f"{path} has mode {mode:04o}, must be 0700")
    return Check(name, "ok", f"{path} (uid {st.st_uid}, 0700)")


def check_socket_paths(config: Config) -> list[Check]:
    """On ipc: whether the longest socket path fits a Unix socket's."""
    longest = longest_ipc_path(config)
    if longest is None:
        return []
    refusal = ipc_path_refusal(config)
    if refusal is not None:
        return [Check("socket paths", "fail", refusal)]
    return [Check("socket paths", "ok",
                  f"the longest {len(os.fsencode(longest))} of {IPC_PATH_MAX} bytes ({longest})")]


def check_model_cache(path: Path) -> Check:
    name = "model cache"
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    free = shutil.disk_usage(existing).free
    if not os.access(existing, os.W_OK):
        return Check(name, "fail", f"{path}: {existing} is not writable")
    where = f"{path} ({_size(free)} free)" if existing == path else \
        f"{path} (absent; created at start; {_size(free)} free)"
    return Check(name, "warn" if free < LOW_SPACE else "ok", where)


def check_port(config: Config) -> Check:
    name = "port"
    address = f"{config.host}:{config.port}"
    # NOTE: named `probe`, as every plain (non-ZeroMQ) socket that binds: see
    # tests/test_zmq_security.py, which finds ZeroMQ binds outside protocol/sockets.py.
    with socket.socket(socket.AF_INET6 if ":" in config.host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((config.host, config.port))
            return Check(name, "ok", f"{address} is free")
        except OSError as exc:
            busy = exc
    try:
        pong = control.call(config, control.Ping(), control.Pong, timeout=1.0)
    except control.ControlError:
        return Check(name, "fail", f"{address} is in use by another program ({busy.strerror})")
    return Check(name, "ok", f"{address} is in use by this npu-proxy (supervisor pid {pong.pid})")


def check_models(config: Config) -> list[Check]:
    checks = []
    for spec in config.workers:
        if not spec.enabled:
            continue
        name = f"model of {spec.name}"
        try:
            found = locate(config, spec.model_name)
        except (NotLocated, ModelSourceMissing) as exc:
            checks.append(Check(name, "fail", f"{spec.model_name}: {exc}"))
            continue
        built = build_seconds(found.path) if found.origin is Origin.EMBEDDED_IR else None
        if found.origin is Origin.EMBEDDED_IR and not found.path.exists():
            detail = f"{spec.model_name} (embedded; converted into {found.path} at first start)"
        elif built is not None:
            detail = f"{spec.model_name} at {found.path} (embedded, built in {built:.1f} s)"
        else:
            detail = f"{spec.model_name} at {found.path} ({found.origin.value})"
        checks.append(Check(name, "ok", detail))
    return checks


# What the tts role needs beyond its model files (the Debian package).
ESPEAK_HINT = "espeak-ng (the Debian and Fedora package; macOS: brew install espeak-ng)"


def check_speech(config: Config) -> list[Check]:
    """What a tts worker needs besides its model: espeak-ng's library (a Piper voice is fed
    its phonemes). A worker lacking it is lazy and starts fine, then fails its first request.
    (The embedded Whisper of the asr role needs nothing more: it is built without torch.)"""
    checks = []
    if not any(spec.role == "tts" for spec in config.workers) and speech_missing():
        checks.append(Check("espeak-ng", "warn", f"not found: {speech_missing()}"))
    if any(spec.enabled and spec.role == "tts" for spec in config.workers):
        # NOTE: the name workers/speech/phonemes.py loads when find_library finds none.
        library = ctypes.util.find_library("espeak-ng")
        if library is None:
            try:
                ctypes.CDLL("libespeak-ng.so.1")
                library = "libespeak-ng.so.1"
            except OSError:
                pass
        checks.append(Check("espeak-ng", "ok", f"{library} (phonemes of the tts voice)")
                      if library else Check("espeak-ng", "fail",
                                          f"not found: the tts role needs {ESPEAK_HINT}"))
    return checks


def check_worker_devices(config: Config, devices: list[Device]) -> list[Check]:
    found = {d.name for d in devices} | {d.name.split(".")[0] for d in devices}
    checks = []
    for spec in config.workers:
        if not spec.enabled or spec.device.split(":")[0] in ("AUTO", "HETERO", "MULTI"):
            continue
        ok = spec.device in found
        limits = f" (max_prompt_len {spec.max_prompt_len}, min_response_len " \
            f"{spec.min_response_len})" if spec.role == "npu" else ""
        if spec.prompt_lookup:
            limits += f" (prompt lookup: {spec.prompt_lookup} tokens from " \
                f"{spec.prompt_lookup_ngram}-grams)"
        if spec.draft_model:
            limits += f" (speculative decoding: draft {spec.draft_model} on " \
                f"{spec.draft_device or spec.device}, {_draft_rule(spec)})"
        checks.append(Check(f"device of {spec.name}", "ok" if ok else "fail",
                            spec.device + limits + ("" if ok else " not found by OpenVINO")))
    return checks


def _draft_rule(spec: WorkerSpec) -> str:
    if spec.draft_confidence > 0:
        return f"tokens while at least {spec.draft_confidence} sure"
    return f"{spec.draft_tokens} tokens per step"


def selftest(config: Config, device: str, tokens: int) -> SelfTest:
    try:
        model = locate(config, DEFAULT_LLM_MODEL).path
        cache = config.model_cache_path() / "ov_cache" / device.lower()
        # NOTE: an NPU compile takes minutes cold; the doctor waits as long as a worker would.
        timeout = 1800.0 if device.upper().startswith("NPU") else 600.0
        out = _probe(["selftest", "--device", device, "--model", str(model), "--tokens",
                      str(tokens), "--cache-dir", str(cache) if cache.parent.exists() else ""],
                     timeout)
    except (ModelSourceMissing, ProbeError, ValueError) as exc:
        return SelfTest(device, ok=False, error=str(exc))
    return SelfTest(device, ok=True, load_s=out["load_s"], first_token_s=out["first_token_s"],
                    tokens=out["tokens"], generate_s=out["generate_s"])


class OpenVINOInfo(msgspec.Struct):
    openvino: str
    genai: str
    devices: list[Device]
    error: str = ""


def openvino_info() -> OpenVINOInfo:
    """Versions and devices, from a child process; `error` says why they are unknown."""
    try:
        return msgspec.convert(_probe(["info"], timeout=120.0), OpenVINOInfo)
    except (ProbeError, ValueError, msgspec.ValidationError) as exc:
        return OpenVINOInfo("?", "?", [], error=str(exc))


def examine(config: Config, info: OpenVINOInfo, run_selftest: bool = True,
            tokens: int = 8) -> Report:
    checks: list[Check] = []
    if info.error:
        checks.append(Check("openvino", "fail", f"cannot query OpenVINO: {info.error}"))
    else:
        checks.append(Check("openvino", "ok", f"{info.openvino}, {len(info.devices)} device(s)"))
    checks += [Check(f"device {d.name}", "fail", d.error) for d in info.devices if d.error]
    checks += check_worker_devices(config, info.devices) if info.devices else []
    checks += check_models(config)
    checks += check_speech(config)
    checks.append(check_model_cache(config.model_cache_path()))
    checks.append(check_runtime_dir(config.runtime_path()))
    checks += check_socket_paths(config)
    checks.append(check_port(config))
    tests = [selftest(config, d.name, tokens) for d in info.devices if not d.error] \
        if run_selftest else []
    checks += [Check(f"self-test {t.device}", "fail", t.error) for t in tests if not t.ok]
    try:
        version = metadata.version("npu-proxy")
    except metadata.PackageNotFoundError:
        version = "?"
    return Report(
        ok=all(c.status != "fail" for c in checks), npu_proxy=version,
        python=platform.python_version(), platform=platform.platform(),
        openvino=info.openvino, genai=info.genai, devices=info.devices, checks=checks,
        selftest_model=DEFAULT_LLM_MODEL if run_selftest else "", selftests=tests)


# --- output ------------------------------------------------------------------------------


def render(report: Report) -> str:
    lines = [
        f"npu-proxy {report.npu_proxy}, Python {report.python}, {report.platform}",
        f"OpenVINO {report.openvino}, OpenVINO GenAI {report.genai}",
        "",
        "devices:",
    ]
    for device in report.devices:
        lines.append(f"  {device.name}: {device.full_name}")
        lines += [f"    {key}: {value}" for key, value in sorted(device.properties.items())]
    if not report.devices:
        lines.append("  (none found)")
    lines += ["", "checks:"]
    width = max(len(c.name) for c in report.checks)
    lines += [f"  {c.status.upper():4}  {c.name.ljust(width)}  {c.detail}" for c in report.checks]
    if report.selftests:
        lines += ["", f"self-test ({report.selftest_model}, loaded and generating on each "
                  "device):"]
    for test in report.selftests:
        if not test.ok:
            lines.append(f"  {test.device}: FAILED: {test.error}")
            continue
        decode = test.generate_s - test.first_token_s
        rate = f", {(test.tokens - 1) / decode:.1f} tokens/s after the first" \
            if test.tokens > 1 and decode > 0 else ""
        lines.append(f"  {test.device}: load {test.load_s:.2f} s, first token "
                     f"{test.first_token_s:.2f} s, {test.tokens} tokens {test.generate_s:.2f} s"
                     f"{rate}")
    problems = sum(c.status == "fail" for c in report.checks)
    lines += ["", "result: ok" if report.ok else
              f"result: {problems} problem{'s' if problems != 1 else ''} (FAIL above)"]
    return "\n".join(lines)


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--no-selftest", is_flag=True,
              help="Skip loading a model and generating on each device (the slow part).")
@click.option("--tokens", default=8, show_default=True, help="Tokens each self-test generates.")
@config_options
def doctor(as_json: bool, no_selftest: bool, tokens: int, **kw: Any) -> None:
    """Check this machine and configuration: OpenVINO and its devices, models, model cache,
    port, runtime folder, and a short self-test per device. Paste the output into a bug
    report; the exit code is 1 when something is wrong."""
    info = openvino_info()
    # NOTE: the workers `start` would run here: the defaults follow the devices found.
    found = {d.name: d.full_name for d in info.devices} if info.devices else None
    report = examine(load(**kw, devices=found), info, run_selftest=not no_selftest,
                     tokens=tokens)
    click.echo(msgspec.json.encode(report).decode() if as_json else render(report))
    sys.exit(0 if report.ok else 1)
