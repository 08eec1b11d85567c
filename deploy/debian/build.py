"""Build `npu-proxy_<version>_amd64.deb` from the PyInstaller one-folder build.

    .venv/bin/python deploy/debian/build.py --out dist            # freezes the spec first
    .venv/bin/python deploy/debian/build.py --folder dist/npu-proxy --out dist

Run it with the environment `make setup` makes (PyInstaller, the model packages, npu-proxy
itself for the unit text) on the Debian release the package is for; dpkg-deb,
dpkg-shlibdeps, readelf and strip come with dpkg and dpkg-dev, chrpath with its package. No
root or fakeroot is needed.

What the package holds:
- /usr/lib/npu-proxy/  the frozen folder (Python, OpenVINO, the embedded models inside);
  /usr/bin/npx-supervisor a link to its executable.
- /etc/npu-proxy/config.toml  a conffile (deploy/debian/config.toml).
- /lib/systemd/system/npu-proxy.service  the system unit, rendered by
  supervisor/service_unit.py as `service install --system` would, for the user npu-proxy.
- postinst/prerm/postrm: the user and /var/lib/npu-proxy, the unit enabled (and started
  where systemd runs); purge removes both again.

# NOTE: the frozen folder, not a private venv: a venv's scripts and pyvenv.cfg hard-code
# its interpreter and its own path, and its binary wheels (numpy, OpenVINO) fit one exact
# Python, so it would tie the package to the build path and to one Debian release's
# python3. The frozen folder is relocatable and carries its Python: it needs only libc and
# the libraries dpkg-shlibdeps finds.
"""

from __future__ import annotations

import argparse
import email.utils
import gzip
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

from npu_proxy.protocol.config import Config
from npu_proxy.supervisor.service_unit import UnitSpec, render_unit

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
PACKAGE = "npu-proxy"
MAINTAINER = "npu-proxy developers <npu-proxy@example.org>"
LIB = Path("usr/lib/npu-proxy")
DOC = Path("usr/share/doc/npu-proxy")
CONFIG = "/etc/npu-proxy/config.toml"
# `service install --system --config /etc/npu-proxy/config.toml --run-as npu-proxy` with
# the package's paths; RuntimeDirectory=npu-proxy is /run/npu-proxy (config.toml's too).
UNIT = UnitSpec(
    command=["/usr/bin/npx-supervisor"],
    config_file=CONFIG,
    model_cache="/var/lib/npu-proxy/models",
    runtime_name="npu-proxy",
    grace_period=Config().grace_period,
    user="npu-proxy",
    wanted_by="multi-user.target",
)
# Device plugins OpenVINO loads only for their device, which need that device's runtime: left
# out of the Depends (a CPU-only machine runs without it) and recommended instead.
DEVICE_RUNTIMES = {"libopenvino_intel_gpu_plugin.so": "ocl-icd-libopencl1"}
DESCRIPTION = """\
local LLM and embedding server for Intel NPU, GPU and CPU
 npu-proxy serves language and embedding models through OpenVINO GenAI on
 Intel NPU, GPU and CPU, and speaks the Ollama, OpenAI (chat, completions,
 Responses) and Anthropic Messages HTTP APIs, so existing clients work
 unchanged. Every device runs in its own supervised process.
 .
 The package runs it as the npu-proxy service, configured by
 /etc/npu-proxy/config.toml. It carries its own Python, OpenVINO and a small
 chat and embedding model."""
COPYRIGHT = """\
Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/
Upstream-Name: npu-proxy

Files: *
Copyright: npu-proxy developers
License: Apache-2.0

Files: usr/lib/npu-proxy/_internal/*
Copyright: the authors of each component
Comment: The frozen folder bundles the Python runtime (PSF-2.0), OpenVINO and
 OpenVINO GenAI (Apache-2.0), and the Python packages npu-proxy depends on,
 each under its own license, as published on PyPI.
License: various

License: Apache-2.0
 On Debian systems, the full text of the Apache License, Version 2.0 can be
 found in /usr/share/common-licenses/Apache-2.0.

License: various
 See each component's own distribution.
"""


def version() -> str:
    return str(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"])


def freeze(work: Path) -> Path:
    """The PyInstaller one-folder build of this tree (minutes)."""
    subprocess.run([sys.executable, "-m", "PyInstaller", "--noconfirm", "--log-level", "WARN",
                    "--distpath", str(work / "dist"), "--workpath", str(work / "build"),
                    str(ROOT / "deploy" / "pyinstaller" / "npu-proxy.spec")], check=True)
    return work / "dist" / "npu-proxy"


def _is_elf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"\x7fELF"


def stage_folder(folder: Path, stage: Path) -> list[Path]:
    """Copy the frozen folder to /usr/lib/npu-proxy with Debian's modes; its ELF files."""
    dest = stage / LIB
    # NOTE: the embedded models' .gitattributes are their repositories' files, unused here;
    # a __pycache__ is byte code Debian packages must not ship (lintian's error; PyAV's wheel
    # carries one inside its dist-info licenses, which PyInstaller copies with the metadata).
    shutil.copytree(folder, dest, symlinks=True,
                    ignore=shutil.ignore_patterns(".git*", "__pycache__"))
    elves = []
    for path in sorted(dest.rglob("*")):
        if path.is_symlink():
            continue
        if path.is_dir():
            path.chmod(0o755)
            continue
        elf = _is_elf(path)
        if elf:
            elves.append(path)
        # NOTE: only the executable is run; shared objects are 0644 as Policy 8.1 wants.
        path.chmod(0o755 if path == dest / "npu-proxy" else 0o644)
    return elves


def _sections(path: Path) -> str:
    return subprocess.run(["readelf", "-S", "-W", str(path)], check=True, capture_output=True,
                          text=True).stdout


def _search_path(path: Path) -> list[str]:
    out = subprocess.run(["readelf", "-d", "-W", str(path)], check=True, capture_output=True,
                         text=True).stdout
    for line in out.splitlines():
        if "Library runpath: [" in line or "Library rpath: [" in line:
            return line.split("[", 1)[1].rstrip("]").split(":")
    return []


def tidy(elves: list[Path], executable: Path) -> None:
    """As dh_strip and lintian want: no debug symbols, no library search path of the build
    machine (a pyenv Python's RUNPATH points at its own prefix)."""
    for path in elves:
        entries = _search_path(path)
        kept = [e for e in entries if e.startswith("$ORIGIN")]
        if kept != entries:
            args = ["-r", ":".join(kept)] if kept else ["-d"]
            subprocess.run(["chrpath", *args, str(path)], check=True, capture_output=True)
        # NOTE: not the executable (its archive follows the ELF data) nor auditwheel's
        # vendored *.libs (rewritten by patchelf: strip may break them); lintian overrides.
        if path == executable or path.parent.name.endswith(".libs"):
            continue
        sections = _sections(path)
        if " .symtab " in sections or " .debug_" in sections:
            subprocess.run(["strip", "--strip-unneeded", "--remove-section=.comment",
                            "--remove-section=.note", str(path)], check=True)


def depends(stage: Path, elves: list[Path]) -> str:
    """The packages the bundled ELF files need (dpkg-shlibdeps); the folder's own libraries
    are private and satisfy themselves."""
    private = sorted({str(p.parent) for p in elves if ".so" in p.name})
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "debian").mkdir()
        (Path(tmp) / "debian" / "control").write_text(
            f"Source: {PACKAGE}\n\nPackage: {PACKAGE}\nArchitecture: amd64\n")
        done = subprocess.run(
            ["dpkg-shlibdeps", "-O", "--ignore-missing-info", "--warnings=0",
             *(f"-l{d}" for d in private),
             *(str(p) for p in elves if p.name not in DEVICE_RUNTIMES)],
            cwd=tmp, capture_output=True, text=True)
    if done.returncode:
        errors = [x for x in done.stderr.splitlines() if "warning:" not in x]
        sys.exit("dpkg-shlibdeps failed:\n" + "\n".join(errors[-20:]))
    line = next(x for x in done.stdout.splitlines() if x.startswith("shlibs:Depends="))
    return line.partition("=")[2]


def stage_files(stage: Path) -> None:
    """The command on the PATH, the conffile, the unit, the docs."""
    bin_dir = stage / "usr" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "npx-supervisor").symlink_to("../lib/npu-proxy/npu-proxy")
    _write(stage / CONFIG.lstrip("/"), (HERE / "config.toml").read_text(), 0o644)
    _write(stage / "lib/systemd/system/npu-proxy.service", render_unit(UNIT), 0o644)
    _write(stage / DOC / "copyright", COPYRIGHT, 0o644)
    _write(stage / "usr/share/lintian/overrides" / PACKAGE,
           (HERE / "lintian-overrides").read_text(), 0o644)
    stamp = email.utils.formatdate(int(os.environ.get("SOURCE_DATE_EPOCH", "0")) or None)
    _write_gz(stage / DOC / "changelog.gz",
              f"{PACKAGE} ({version()}) unstable; urgency=medium\n\n"
              f"  * npu-proxy {version()}, the PyInstaller one-folder build.\n\n"
              f" -- {MAINTAINER}  {stamp}\n")
    _write_gz(stage / "usr/share/man/man1/npx-supervisor.1.gz",
              (HERE / "npx-supervisor.1").read_text())


def _write(path: Path, text: str, mode: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)


def _write_gz(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # NOTE: mtime=0 and no name inside, as `gzip -9n` (lintian: reproducible docs).
    with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=9,
                                                mtime=0, filename="") as gz:
        gz.write(text.encode())
    path.chmod(0o644)


def control(stage: Path, depends_on: str) -> None:
    """DEBIAN/: control, conffiles, md5sums and the maintainer scripts."""
    files = sorted(p for p in stage.rglob("*") if p.is_file() and not p.is_symlink())
    size_kib = sum((p.stat().st_size + 1023) // 1024 for p in files)
    meta = stage / "DEBIAN"
    meta.mkdir()
    _write(meta / "control",
           f"Package: {PACKAGE}\nVersion: {version()}\nArchitecture: amd64\n"
           f"Maintainer: {MAINTAINER}\nInstalled-Size: {size_kib}\n"
           f"Depends: adduser, {depends_on}\n"
           f"Recommends: {', '.join(sorted(set(DEVICE_RUNTIMES.values())))}\n"
           "Section: net\nPriority: optional\n"
           f"Description: {DESCRIPTION}\n", 0o644)
    _write(meta / "conffiles", CONFIG + "\n", 0o644)
    sums = "".join(f"{hashlib.md5(p.read_bytes()).hexdigest()}  {p.relative_to(stage)}\n"
                   for p in files)
    _write(meta / "md5sums", sums, 0o644)
    for script in ("postinst", "prerm", "postrm"):
        shutil.copy(HERE / script, meta / script)
        (meta / script).chmod(0o755)


def build(folder: Path, out: Path, compression: str = "xz",
          level: int | None = None) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    deb = out / f"{PACKAGE}_{version()}_amd64.deb"
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        stage = Path(tmp) / "root"
        stage.mkdir(mode=0o755)
        elves = stage_folder(folder, stage)
        tidy(elves, stage / LIB / "npu-proxy")
        stage_files(stage)
        control(stage, depends(stage, elves))
        subprocess.run(["dpkg-deb", "--root-owner-group", f"-Z{compression}",
                        *([f"-z{level}"] if level is not None else []), "--build",
                        str(stage), str(deb)], check=True, stdout=subprocess.DEVNULL)
    return deb


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", type=Path,
                        help="a PyInstaller one-folder build (default: freeze this tree)")
    parser.add_argument("--out", type=Path, default=ROOT / "dist")
    parser.add_argument("--compression", default="xz", choices=("xz", "gzip", "zstd"),
                        help="dpkg-deb's compressor (gzip: faster to build, larger)")
    parser.add_argument("--level", type=int, choices=range(10), metavar="0-9",
                        help="its compression level (dpkg-deb -z; default: dpkg-deb's)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        folder = args.folder or freeze(Path(work))
        print(build(folder.resolve(), args.out.resolve(), args.compression, args.level))


if __name__ == "__main__":
    main()
