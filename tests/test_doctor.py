"""`npx-supervisor doctor` on this machine (CPU only): what it shows, and the exit code 1 when
something is wrong."""

from __future__ import annotations

import json
import re
import socket
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Any

import tomli_w
from serverctl import MODEL_CACHE, SUPERVISOR, Server, free_port

from npu_proxy.supervisor.devices import discover


def _config(tmp: Path, **settings: Any) -> Path:
    path = tmp / "npu-proxy.toml"
    data = {"port": free_port(), "runtime_dir": str(tmp / "rt"),
            "model_cache": str(MODEL_CACHE), **settings}
    path.write_text(tomli_w.dumps(data))
    return path


def _doctor(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([SUPERVISOR, "doctor", "--config", str(config), *args],
                          capture_output=True, text=True, timeout=900)


def test_doctor_on_this_machine_runs_the_selftest_and_exits_0(tmp_path: Path) -> None:
    done = _doctor(_config(tmp_path), "--tokens", "4")
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert f"OpenVINO {metadata.version('openvino')}" in out
    assert f"CPU: {discover()['CPU']}" in out
    assert re.search(r"^  CPU: load \d+\.\d\d s, first token \d+\.\d\d s, 4 tokens \d+\.\d\d s",
                     out, re.M), out
    assert re.search(r"OK +runtime folder +.*absent; created 0700", out)
    assert re.search(r"OK +model of llm +smollm2:135m", out)
    assert out.rstrip().endswith("result: ok")


def test_doctor_json(tmp_path: Path) -> None:
    done = _doctor(_config(tmp_path), "--json", "--no-selftest")
    assert done.returncode == 0
    report = json.loads(done.stdout)
    assert report["ok"] is True and report["selftests"] == []
    assert report["openvino"].startswith(metadata.version("openvino"))
    cpu = next(d for d in report["devices"] if d["name"] == "CPU")
    assert cpu["full_name"] == discover()["CPU"]
    assert {c["name"] for c in report["checks"]} >= {
        "openvino", "model cache", "runtime folder", "port", "model of llm", "model of embed"}


def test_doctor_shows_a_workers_prompt_lookup(tmp_path: Path) -> None:
    config = _config(tmp_path, workers=[{"name": "llm", "role": "llm", "prompt_lookup": 4}])
    done = _doctor(config, "--no-selftest")
    assert re.search(r"OK +device of llm +CPU \(prompt lookup: 4 tokens from 3-grams\)",
                     done.stdout), done.stdout


def test_doctor_shows_a_workers_draft_model(tmp_path: Path) -> None:
    config = _config(tmp_path, workers=[{"name": "llm", "role": "llm",
                                         "draft_model": "smollm2:135m", "draft_tokens": 3}])
    done = _doctor(config, "--no-selftest")
    assert re.search(r"OK +device of llm +CPU \(speculative decoding: draft smollm2:135m on "
                     r"CPU, 3 tokens per step\)", done.stdout), done.stdout


def test_doctor_fails_on_a_runtime_folder_with_bad_permissions(tmp_path: Path) -> None:
    (tmp_path / "rt").mkdir(mode=0o755)
    (tmp_path / "rt").chmod(0o755)
    done = _doctor(_config(tmp_path), "--no-selftest")
    assert done.returncode == 1
    assert re.search(r"FAIL +runtime folder +.*rt has mode 0755, must be 0700", done.stdout)
    assert "result: 1 problem (FAIL above)" in done.stdout

    (tmp_path / "real").mkdir(mode=0o700)
    (tmp_path / "link").symlink_to(tmp_path / "real")
    done = _doctor(_config(tmp_path, runtime_dir=str(tmp_path / "link")), "--no-selftest")
    assert done.returncode == 1
    assert re.search(r"FAIL +runtime folder +.*link is a symbolic link", done.stdout)


def test_doctor_fails_on_a_model_or_device_that_cannot_be_found(tmp_path: Path) -> None:
    config = _config(tmp_path, workers=[
        {"name": "llm", "role": "llm", "model": "no-such-model:1b"},
        {"name": "npu", "role": "npu", "device": "NPU"},
    ])
    done = _doctor(config, "--no-selftest")
    assert done.returncode == 1
    assert re.search(r"FAIL +model of llm +no-such-model:1b: .*not available", done.stdout)
    assert re.search(r"FAIL +device of npu +NPU \(max_prompt_len 1024, min_response_len 128\) "
                     r"not found by OpenVINO", done.stdout)
    assert "result: 2 problems" in done.stdout


def test_doctor_port_in_use_by_another_program_or_by_npu_proxy(
        tmp_path: Path, server: Server) -> None:
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        port = other.getsockname()[1]
        done = _doctor(_config(tmp_path, port=port), "--no-selftest")
        assert done.returncode == 1
        assert re.search(rf"FAIL +port +127.0.0.1:{port} is in use by another program",
                         done.stdout)
    done = _doctor(server.config_path, "--no-selftest")
    assert done.returncode == 0, done.stdout
    assert re.search(rf"OK +port +127.0.0.1:{server.port} is in use by this npu-proxy "
                     r"\(supervisor pid \d+\)", done.stdout)


SPEECH_WORKERS = [{"name": "asr", "role": "asr"}, {"name": "tts", "role": "tts"}]


def test_doctor_shows_the_speech_roles_and_what_they_need(tmp_path: Path) -> None:
    """The asr and tts workers are checked like the others (device, model), and so is what
    they need besides: espeak-ng for the voice; the embedded Whisper needs nothing (no torch),
    and once built its build time is shown."""
    from test_audio import whisper_ir_folder

    # NOTE: an empty model cache: the embedded Whisper is still to be built.
    fresh = {"workers": SPEECH_WORKERS, "model_cache": str(tmp_path / "cache")}
    done = _doctor(_config(tmp_path, **fresh), "--no-selftest")
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    for worker in ("asr", "tts"):
        assert re.search(rf"OK +device of {worker} +CPU", out), out
    assert re.search(r"OK +model of asr +whisper:tiny.en \(embedded; converted into .*cache/"
                     r"whisper-tiny-en", out), out
    assert re.search(r"OK +model of tts +piper:en-us-joe-medium at .*en_US-joe-medium.onnx "
                     r"\(packaged\)", out), out
    assert re.search(r"OK +espeak-ng +\S*espeak-ng\S* \(phonemes of the tts voice\)", out), out
    assert "whisper builder" not in out

    # The shared model cache, where the tests built it: the build time is shown.
    whisper_ir_folder()
    done = _doctor(_config(tmp_path, workers=SPEECH_WORKERS), "--no-selftest")
    assert re.search(r"OK +model of asr +whisper:tiny.en at .*whisper-tiny-en \(embedded, "
                     r"built in \d+\.\d s\)", done.stdout), done.stdout



def test_doctor_fails_on_a_runtime_folder_too_long_for_its_sockets(tmp_path: Path) -> None:
    done = _doctor(_config(tmp_path), "--no-selftest")
    assert re.search(r"OK +socket paths +the longest \d+ of 107 bytes", done.stdout), done.stdout

    deep = tmp_path / ("d" * (110 - len(str(tmp_path))))
    done = _doctor(_config(tmp_path, runtime_dir=str(deep)), "--no-selftest")
    assert done.returncode == 1
    assert re.search(r"FAIL +socket paths +the runtime folder .* is too long for its sockets",
                     done.stdout), done.stdout
    # NOTE: and each check once: espeak-ng's was listed twice.
    assert len(re.findall(r"^ +\S+ +espeak-ng ", done.stdout, re.M)) == 1, done.stdout
