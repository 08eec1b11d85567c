"""OpenVINO device discovery, in a child process: a broken driver must not hang the
supervisor, so the query runs with a deadline and a failure falls back to the CPU.

The answer is kept in the runtime folder per boot (`devices.json`, keyed by the boot, the
Python and the OpenVINO version): the query costs a process that imports OpenVINO (0.6 s
of CPU) before any child can be spawned, and the devices a machine has change with a
reboot or a new OpenVINO. `npx-supervisor doctor` always asks afresh; deleting the file
makes the next start ask too.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

log = logging.getLogger(__name__)

CACHE_FILE = "devices.json"

_QUERY = """
import json, openvino as ov
core = ov.Core()
out = {}
for dev in core.available_devices:
    try:
        out[dev] = str(core.get_property(dev, "FULL_DEVICE_NAME"))
    except Exception as exc:
        out[dev] = f"{dev} ({exc})"
print(json.dumps(out))
"""


class DiscoveryFailed(Exception):
    pass


def _query(timeout: float) -> dict[str, str]:
    try:
        done = subprocess.run([sys.executable, "-c", _QUERY], capture_output=True, text=True,
                              timeout=timeout, check=True)
        devices: dict[str, str] = json.loads(done.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, OSError, ValueError, IndexError) as exc:
        raise DiscoveryFailed(str(exc)) from exc
    if not devices:
        raise DiscoveryFailed("OpenVINO lists no device")
    return devices


def _discovered(timeout: float) -> tuple[dict[str, str], bool]:
    """(devices, True when OpenVINO answered); CPU alone when it did not."""
    try:
        return _query(timeout), True
    except DiscoveryFailed as exc:
        log.warning("device discovery failed (%s); assuming CPU only", exc)
        return {"CPU": "CPU"}, False


def discover(timeout: float = 60.0) -> dict[str, str]:
    """Device name -> full name, e.g. {"CPU": "Intel(R) Core(TM) Ultra 7 155H", "NPU": ...}."""
    return _discovered(timeout)[0]


def boot_key() -> str:
    """What must not change for a discovery's answer to hold: this boot, this Python, this
    OpenVINO."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        # NOTE: no boot id (Windows, macOS): the boot's wall time, from the monotonic clock
        # (time since boot on Windows); a clock change only costs one more discovery.
        boot = str(round(time.time() - time.monotonic(), -1))
    return f"{boot} {sys.executable} openvino {_openvino_install()}"


def _openvino_install() -> str:
    """Where OpenVINO is installed and when: a new version (or a reinstall) is a new key.

    NOTE: not importlib.metadata's version: importing it is 0.03 s of CPU on the supervisor's
    serial path to the gateway's spawn (bench/start.py); find_spec does not import OpenVINO."""
    with contextlib.suppress(ImportError, ValueError):
        spec = importlib.util.find_spec("openvino")
        if spec is None:
            return "none"
        # NOTE: a frozen program's modules are in its archive (no file at the origin): an
        # upgrade there replaces the executable itself.
        for place in (spec.origin, sys.executable):
            with contextlib.suppress(OSError, TypeError):
                st = os.stat(place or "")
                return f"{place} {st.st_size} {st.st_mtime_ns}"
    return "none"


def discover_cached(folder: Path, timeout: float = 60.0) -> tuple[dict[str, str], bool]:
    """`discover()`, answered from `folder`'s cache when it holds this boot's answer;
    (devices, True when cached). A failed discovery is not kept."""
    path = folder / CACHE_FILE
    key = boot_key()
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError, AttributeError):
        kept = json.loads(path.read_text())
        devices = kept["devices"]
        if kept["key"] == key and devices and all(
                isinstance(k, str) and isinstance(v, str) for k, v in devices.items()):
            return dict(devices), True
    devices, answered = _discovered(timeout)
    if not answered:
        return devices, False
    try:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"key": key, "devices": devices}))
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("could not keep the devices found in %s: %s", path, exc)
    return devices, False
