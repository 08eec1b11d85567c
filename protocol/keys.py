"""The CURVE key pairs of one instance, for ZeroMQ over tcp (protocol/sockets.py uses them).

The keys folder (`Config.keys_path()`, <runtime_dir>/keys by default) holds two pairs, made
once by the supervisor (or `npx-supervisor keys`) and kept across restarts, so that another
host can be told about them:

- `server.key` / `server.key_secret`: every socket this instance binds proves itself with it.
  Give `server.key` (public) to a gateway that uses this host's workers (`public_key_file`).
- `client.key` / `client.key_secret`: every socket this instance connects logs in with it.
  Give `client.key` (public) to a worker host this gateway uses (its `client_key_files`).

Files are in ZeroMQ's certificate format (zmq.auth.load_certificate reads them). The folder
is 0700 and the files 0600, owned by this user, checked without following links before any
secret is read; secret keys are never logged or shown in a repr.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.auth

from npu_proxy.protocol.config import Config

PAIRS = ("server", "client")


class KeysError(Exception):
    """The keys folder or a key file is missing, unsafe or unreadable."""


@dataclass(frozen=True)
class Keys:
    """This instance's two key pairs (Z85 text as bytes, as ZeroMQ's socket options take)."""

    server_public: bytes
    client_public: bytes
    server_secret: bytes = field(repr=False)
    client_secret: bytes = field(repr=False)


def _check_private(path: Path, folder: bool) -> None:
    """Owned by this user, not a link, no access for group or others."""
    try:
        st = path.lstat()
    except FileNotFoundError as exc:
        raise KeysError(f"{path} does not exist: start the instance (or run "
                        "`npx-supervisor keys`) to make its keys") from exc
    wanted = stat.S_ISDIR if folder else stat.S_ISREG
    if not wanted(st.st_mode):
        raise KeysError(f"{path} is not a {'folder' if folder else 'regular file'}")
    # NOTE: Windows keeps no POSIX owner or mode; there the user's profile folder's ACLs
    # protect the runtime folder.
    if os.name == "posix":
        if st.st_uid != os.getuid():
            raise KeysError(f"{path} belongs to another user")
        if st.st_mode & 0o077:
            raise KeysError(f"{path} is open to other users (mode "
                            f"{stat.S_IMODE(st.st_mode):o}); it must be "
                            f"{'0700' if folder else '0600'}")


def _write(path: Path, text: str) -> None:
    # NOTE: O_EXCL: never write through a file or link someone else put there.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0),
                 0o600)
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write(text)


def _certificate(public: bytes, secret: bytes | None) -> str:
    lines = ["#   ZeroMQ CURVE " + ("Secret" if secret else "Public") + " Certificate",
             "#   made by npu-proxy" + ("; never give this file to anyone" if secret else ""),
             "metadata", "curve", f'    public-key = "{public.decode()}"']
    if secret:
        lines.append(f'    secret-key = "{secret.decode()}"')
    return "\n".join(lines) + "\n"


def ensure_keys(config: Config) -> Path:
    """Make the keys folder and any missing key pair; returns the folder."""
    folder = config.keys_path()
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    _check_private(folder, folder=True)
    for name in PAIRS:
        if (folder / f"{name}.key_secret").exists():
            public, _secret = _pair(folder, name)
        else:
            public, secret = zmq.curve_keypair()
            (folder / f"{name}.key").unlink(missing_ok=True)
            _write(folder / f"{name}.key_secret", _certificate(public, secret))
        if not (folder / f"{name}.key").exists():
            _write(folder / f"{name}.key", _certificate(public, None))
    return folder


def _pair(folder: Path, name: str) -> tuple[bytes, bytes]:
    path = folder / f"{name}.key_secret"
    _check_private(path, folder=False)
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise KeysError(f"cannot read {path}: {exc}") from exc
    if secret is None:
        raise KeysError(f"{path} holds no secret key")
    return public, secret


def load_keys(config: Config) -> Keys:
    """This instance's key pairs; KeysError when missing or not private."""
    folder = config.keys_path()
    _check_private(folder, folder=True)
    server_public, server_secret = _pair(folder, "server")
    client_public, client_secret = _pair(folder, "client")
    return Keys(server_public=server_public, server_secret=server_secret,
                client_public=client_public, client_secret=client_secret)


def public_key(path: str | Path) -> bytes:
    """The public key in a certificate file (another host's `server.key` or `client.key`)."""
    try:
        public, _secret = zmq.auth.load_certificate(Path(path).expanduser())
    except (OSError, ValueError) as exc:
        raise KeysError(f"cannot read the public key in {path}: {exc}") from exc
    return public


def worker_clients(config: Config, keys: Keys) -> frozenset[bytes]:
    """Who may connect to this instance's workers: its own client key (its supervisor and
    gateway) and the gateways of other hosts listed in `client_key_files`.

    NOTE: several gateways may share a worker: each hears only its own frames and aborts only
    its own requests, by the client key it logged in with (protocol/replies.py)."""
    return frozenset([keys.client_public, *(public_key(p) for p in config.client_key_files)])
