"""Planning a pull: the name resolved (models/registry.py), the repository's files listed with
their sizes and digests (one metadata request), the allowed ones chosen; the errors and
progress records every step of a pull shares.

Never imports OpenVINO: the gateway runs this in a thread.
"""

from __future__ import annotations

import contextlib
import fnmatch
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from npu_proxy.models.gguf import unreadable_name
from npu_proxy.models.registry import (
    ModelNameError,
    ModelSource,
    PullTarget,
    UnknownModel,
    library_entry,
    lookup,
)
from npu_proxy.models.store import safe_relative
from npu_proxy.protocol.config import Config

log = logging.getLogger(__name__)

# The file an optimum-intel export of a vision-language model has (and a text model has not).
VISION_IR = "openvino_vision_embeddings_model.xml"

# What a model needs: IR (xml/bin), configs and tokenizer files, GGUF, chat templates.
ALLOW_PATTERNS = ("*.xml", "*.bin", "*.json", "*.txt", "*.gguf", "*.model", "*.jinja",
                  "*.tiktoken", "*.vocab", "tokenizer*")
# Weights of the original framework that IR repositories sometimes carry beside the IR.
DENY_PATTERNS = ("pytorch_model*.bin", "training_args.bin", "optimizer*.bin", "*.safetensors",
                 "onnx/*", "*.onnx")
IR_XML = "openvino_model.xml"


class PullError(Exception):
    """A pull that failed; `status` is the HTTP status the gateway answers with."""

    status = 502


class PullRefused(PullError):
    status = 400


class PullNotFound(PullError):
    status = 404


class PullCancelled(PullError):
    status = 499


class Progress(msgspec.Struct, omit_defaults=True):
    """One line of Ollama's /api/pull NDJSON."""

    status: str
    digest: str | None = None
    total: int | None = None
    completed: int | None = None


OnProgress = Callable[[Progress], None]


@dataclass
class RemoteFile:
    path: str
    size: int
    sha256: str = ""
    git_oid: str = ""

    @property
    def digest(self) -> str:
        # NOTE: Ollama's layer digests are sha256; the hub gives sha256 for LFS files only,
        # files stored in git carry their git blob id (sha1) instead.
        return f"sha256:{self.sha256}" if self.sha256 else f"sha1:{self.git_oid or '0' * 40}"


@dataclass
class PullPlan:
    target: PullTarget
    repo: str = ""
    revision: str = ""
    commit: str = ""
    files: list[RemoteFile] = field(default_factory=list)
    entry: str = ""
    format: str = ""
    # Nothing to download: an embedded default or a local path, ready as it is.
    ready: str = ""

    @property
    def name(self) -> str:
        return self.target.name

    @property
    def total(self) -> int:
        return sum(f.size for f in self.files)


# --- planning ------------------------------------------------------------------------------


def hub_endpoint() -> str:
    from huggingface_hub import constants

    return str(constants.ENDPOINT)


def plan_pull(config: Config, name: str) -> PullPlan:
    """Resolve `name` and list the files to fetch; raises PullError subclasses."""
    try:
        target = lookup(name, config.models, config.model_aliases)
    except ModelNameError as exc:
        raise PullRefused(str(exc)) from exc
    except UnknownModel as exc:
        raise PullNotFound(str(exc)) from exc
    source = target.source
    if target.embedded:
        return PullPlan(target=target, ready=f"{target.name} is built in")
    if source.path:
        path = Path(source.path).expanduser()
        if not path.exists():
            raise PullNotFound(f"model '{name}': the configured path {path} does not exist")
        return PullPlan(target=target, ready=f"{target.name} is the local path {path}")
    if not source.repo:
        raise PullRefused(f"model '{name}': its [models] entry has neither repo nor path")
    # NOTE: a library name falls back to its next source when one is not found on the hub.
    lib = library_entry(target.name)
    sources = lib.sources if lib is not None and source in lib.sources else (source,)
    missing: PullNotFound | None = None
    for candidate in sources:
        try:
            siblings, commit = _list_repo(candidate.repo, candidate.revision)
            files, entry, fmt = select_files(candidate, siblings)
        except PullNotFound as exc:
            log.info("%s: %s", target.name, exc)
            missing = missing or exc
            continue
        return PullPlan(target=msgspec.structs.replace(target, source=candidate),
                        repo=candidate.repo, revision=candidate.revision, commit=commit,
                        files=files, entry=entry, format=fmt)
    assert missing is not None
    raise missing


def _list_repo(repo: str, revision: str) -> tuple[list[RemoteFile], str]:
    from huggingface_hub import HfApi

    with hub_errors(repo):
        info = HfApi(library_name="npu-proxy").model_info(
            repo, revision=revision or None, files_metadata=True, timeout=30)
    files = []
    for sib in info.siblings or []:
        lfs = sib.lfs
        files.append(RemoteFile(path=sib.rfilename, size=int(sib.size or 0),
                                sha256=str(lfs.sha256) if lfs else "",
                                git_oid="" if lfs else str(sib.blob_id or "")))
    return files, str(info.sha or revision)


@contextlib.contextmanager
def hub_errors(what: str) -> Iterator[None]:
    """Turn huggingface_hub and transport errors into PullErrors with plain messages."""
    import httpx2
    from huggingface_hub import errors

    endpoint = hub_endpoint()
    try:
        yield
    except PullError:
        raise
    except errors.GatedRepoError as exc:
        raise PullRefused(f"{what} is gated on {endpoint}: accept its license there and set "
                          "HF_TOKEN") from exc
    except (errors.RepositoryNotFoundError, errors.RevisionNotFoundError,
            errors.EntryNotFoundError) as exc:
        raise PullNotFound(f"{what} was not found on {endpoint}") from exc
    except errors.OfflineModeIsEnabled as exc:
        raise PullError(f"cannot pull {what}: HF_HUB_OFFLINE is set") from exc
    except errors.HfHubHTTPError as exc:
        raise PullError(f"{endpoint} refused {what}: {exc}") from exc
    except httpx2.HTTPError as exc:
        raise PullError(f"cannot reach {endpoint} for {what}: {exc}") from exc


def _allowed(path: str) -> bool:
    base = path.rsplit("/", 1)[-1]
    if any(fnmatch.fnmatch(path, p) or fnmatch.fnmatch(base, p) for p in DENY_PATTERNS):
        return False
    return any(fnmatch.fnmatch(base, p) for p in ALLOW_PATTERNS)


def select_files(source: ModelSource, files: list[RemoteFile]
                 ) -> tuple[list[RemoteFile], str, str]:
    """(files to fetch, entry to load, format): one GGUF, or the IR folder's allowed files."""
    unsafe = [f.path for f in files if not safe_relative(f.path)]
    by_path = {f.path: f for f in files if safe_relative(f.path)}
    ggufs = sorted(p for p in by_path if p.lower().endswith(".gguf") and "/" not in p)
    repo = source.repo
    if source.file:
        wanted = source.file
        exact = [p for p in by_path if p == wanted] or \
            [p for p in by_path if p.lower() == wanted.lower()]
        if not exact:
            tag = wanted.lower()
            exact = [p for p in ggufs if p.lower().removesuffix(".gguf").endswith(tag)] or \
                [p for p in ggufs if tag in p.lower()]
        if not exact:
            if wanted in unsafe:
                raise PullRefused(f"{repo}: refusing the unsafe file path {wanted!r}")
            raise PullNotFound(f"{repo} has no file or GGUF quantisation {wanted!r}"
                               + (f"; its GGUF files: {', '.join(ggufs)}" if ggufs else ""))
        if len(exact) > 1:
            raise PullRefused(f"{repo}: {wanted!r} matches {', '.join(exact)}; name one file")
        chosen = by_path[exact[0]]
        if not chosen.path.lower().endswith(".gguf"):
            raise PullRefused(f"{repo}: {chosen.path} is not a model (a .gguf file)")
        return [_single(chosen)], chosen.path, "gguf"
    if IR_XML in by_path or VISION_IR in by_path:
        if unsafe:
            raise PullRefused(f"{repo}: refusing unsafe file paths {unsafe}")
        picked = [f for p, f in sorted(by_path.items()) if _allowed(p)]
        return picked, "", "openvino"
    if ggufs:
        if len(ggufs) == 1:
            return [_single(by_path[ggufs[0]])], ggufs[0], "gguf"
        preferred = [p for p in ggufs if "q4_k_m" in p.lower()]
        if len(preferred) == 1:
            return [_single(by_path[preferred[0]])], preferred[0], "gguf"
        served = [p for p in ggufs if not unreadable_name(p)] or ggufs
        raise PullRefused(f"{repo} has several GGUF files; name one: "
                          + ", ".join(f"hf.co/{repo}:{p}" for p in served))
    raise PullRefused(f"{repo} has neither an OpenVINO IR ({IR_XML}) nor a GGUF file; "
                      f"convert it with: npx-supervisor convert {repo}")


def _single(file: RemoteFile) -> RemoteFile:
    if "-of-0" in file.path.lower():
        raise PullRefused(f"{file.path} is one part of a split GGUF; split files are not "
                          "supported")
    if why := unreadable_name(file.path):
        raise PullRefused(why)  # NOTE: before gigabytes are downloaded for a failing load
    return file
