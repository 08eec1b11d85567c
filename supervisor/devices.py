"""OpenVINO device discovery, in a child process: a broken driver must not hang the
supervisor, so the query runs with a deadline and a failure falls back to the CPU."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

log = logging.getLogger(__name__)

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


def discover(timeout: float = 60.0) -> dict[str, str]:
    """Device name -> full name, e.g. {"CPU": "Intel(R) Core(TM) Ultra 7 155H", "NPU": ...}."""
    try:
        done = subprocess.run([sys.executable, "-c", _QUERY], capture_output=True, text=True,
                              timeout=timeout, check=True)
        devices: dict[str, str] = json.loads(done.stdout.strip().splitlines()[-1])
    except (subprocess.SubprocessError, OSError, ValueError, IndexError) as exc:
        log.warning("device discovery failed (%s); assuming CPU only", exc)
        return {"CPU": "CPU"}
    return devices or {"CPU": "CPU"}
