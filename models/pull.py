"""Pull a model from the Hugging Face hub into the model cache, with progress and resume.

Two steps so callers can answer "not found" before they start streaming progress:
`plan_pull()` resolves the name (models/registry.py) and lists the repository's files with
their sizes and digests (one metadata request); `run_pull()` downloads them.

- Files land in `.staging/<folder>/` as `<file>.incomplete` and are renamed when complete;
  the staging folder is renamed into the cache only when every file is verified, together
  with a manifest, so a partial pull is never a model (models/store.py).
- Resume: an interrupted pull leaves its `.incomplete` files; the next pull asks the hub for
  the rest with an HTTP Range request. NOTE: huggingface_hub 2.x deletes its own partial
  files on failure, so the transfer itself is done here, with huggingface_hub's session,
  headers, URLs, metadata and errors. No automatic retry: an interrupted pull fails with a
  message saying to pull again, as `ollama pull` does.
- Verification: every file's size; its sha256 when the hub gives one (LFS files), else its
  git blob id (small files stored in git).
- Only allow-listed files are fetched; no file path may leave the model folder or be a name
  Windows misreads (a device name, a `:` stream, a trailing dot: models/portable.py), and
  both are checked before anything is created.

Never imports OpenVINO: the gateway runs this in a thread.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import json
import logging
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from npu_proxy.models.registry import (
    ModelNameError,
    ModelSource,
    PullTarget,
    UnknownModel,
    library_entry,
    lookup,
)
from npu_proxy.models.store import Manifest, ManifestFile, ModelStore, inside, safe_relative
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
STAGING_INFO = ".pull.json"
CHUNK = 1 << 20
PROGRESS_EVERY = 0.1  # seconds between progress events of one file
EMBED_ARCHS = ("bert", "nomic-bert", "nomic-bert-moe", "jina-bert-v2", "t5encoder",
               "xlm-roberta", "roberta", "gte")


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


def _endpoint() -> str:
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

    with _hub_errors(repo):
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
def _hub_errors(what: str) -> Iterator[None]:
    """Turn huggingface_hub and transport errors into PullErrors with plain messages."""
    import httpx2
    from huggingface_hub import errors

    endpoint = _endpoint()
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
        raise PullRefused(f"{repo} has several GGUF files; name one: "
                          + ", ".join(f"hf.co/{repo}:{p}" for p in ggufs))
    raise PullRefused(f"{repo} has neither an OpenVINO IR ({IR_XML}) nor a GGUF file; "
                      f"convert it with: npx-supervisor convert {repo}")


def _single(file: RemoteFile) -> RemoteFile:
    if "-of-0" in file.path.lower():
        raise PullRefused(f"{file.path} is one part of a split GGUF; split files are not "
                          "supported")
    return file


# --- downloading ---------------------------------------------------------------------------


class _Reporter:
    """Progress of one file: `completed` only grows, events at most every 0.1 s."""

    def __init__(self, file: RemoteFile, on_progress: OnProgress,
                 cancel: threading.Event | None) -> None:
        self.file = file
        self.on_progress = on_progress
        self.cancel = cancel
        self.sent = -1
        self.sent_at = 0.0

    def __call__(self, completed: int, force: bool = False) -> None:
        if self.cancel is not None and self.cancel.is_set():
            raise PullCancelled("pull cancelled")
        completed = max(completed, self.sent)
        now = time.monotonic()
        if completed == self.sent and not force:
            return
        if force or completed >= self.file.size or now - self.sent_at >= PROGRESS_EVERY:
            self.sent, self.sent_at = completed, now
            self.on_progress(Progress(status=f"pulling {_short(self.file)}",
                                      digest=self.file.digest, total=self.file.size,
                                      completed=completed))


def _short(file: RemoteFile) -> str:
    return file.digest.split(":", 1)[1][:12]


def _fetch(url: str, headers: dict[str, str], dest: Path, file: RemoteFile,
           report: _Reporter) -> None:
    from huggingface_hub import get_session, hf_raise_for_status

    if dest.is_file() and not dest.is_symlink() and dest.stat().st_size == file.size:
        report(file.size, force=True)
        return
    part = dest.with_name(dest.name + ".incomplete")
    for path in (dest, part):
        if path.is_symlink():
            path.unlink()
    have = part.stat().st_size if part.is_file() else 0
    if have > file.size:
        part.unlink()
        have = 0
    request_headers = dict(headers)
    if 0 < have < file.size:
        request_headers["Range"] = f"bytes={have}-"
    if have < file.size or file.size == 0:
        with _hub_errors(file.path), get_session().stream(
                "GET", url, headers=request_headers, timeout=60.0,
                follow_redirects=True) as response:
            if response.status_code >= 400:
                response.read()
                hf_raise_for_status(response)
            resumed = have and response.status_code == 206
            if not resumed:
                have = 0  # NOTE: the server sent the whole file (a Range it ignored)
            report(have, force=True)
            try:
                with open(part, "ab" if resumed else "wb") as out:
                    for chunk in response.iter_bytes(CHUNK):
                        out.write(chunk)
                        have += len(chunk)
                        report(have)
            except Exception as exc:
                if isinstance(exc, PullCancelled):
                    raise
                raise PullError(f"download of {file.path} interrupted after {have} of "
                                f"{file.size} bytes ({exc}); pull again to resume") from exc
    if have != file.size:
        raise PullError(f"download of {file.path} ended after {have} of {file.size} bytes; "
                        "pull again to resume")
    part.replace(dest)
    report(file.size, force=True)


def file_hashes(path: Path, size: int) -> tuple[str, str]:
    """(sha256, git blob sha1) of a file in one pass."""
    sha256 = hashlib.sha256()
    git = hashlib.sha1(f"blob {size}\0".encode(), usedforsecurity=False)
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            sha256.update(chunk)
            git.update(chunk)
    return sha256.hexdigest(), git.hexdigest()


def _verify(staging: Path, files: list[RemoteFile]) -> list[ManifestFile]:
    out = []
    for file in files:
        path = staging / file.path
        size = path.stat().st_size
        if size != file.size:
            path.unlink()
            raise PullError(f"{file.path}: {size} bytes, expected {file.size}; pull again")
        sha256, git_oid = file_hashes(path, size)
        if (file.sha256 and sha256 != file.sha256) or \
                (not file.sha256 and file.git_oid and git_oid != file.git_oid):
            path.unlink()
            want = file.sha256 or file.git_oid
            raise PullError(f"{file.path}: digest mismatch (expected {want}, got "
                            f"{sha256 if file.sha256 else git_oid}); the file was removed, "
                            "pull again")
        out.append(ManifestFile(path=file.path, size=size, sha256=sha256,
                                git_oid=file.git_oid))
    return out


def _prepare_staging(staging: Path, plan: PullPlan) -> None:
    """Keep partial files only from the same commit; drop anything the plan does not want."""
    info = staging / STAGING_INFO
    stamp = {"repo": plan.repo, "commit": plan.commit}
    try:
        previous = json.loads(info.read_text())
    except (OSError, ValueError):
        previous = None
    if staging.is_symlink():
        staging.unlink()
    elif previous != stamp and staging.exists():
        shutil.rmtree(staging)
    staging.mkdir(parents=True, exist_ok=True)
    info.write_text(json.dumps(stamp))
    wanted = {f.path for f in plan.files} | {f.path + ".incomplete" for f in plan.files}
    for path in sorted(staging.rglob("*"), reverse=True):
        rel = path.relative_to(staging).as_posix()
        if rel == STAGING_INFO or rel in wanted:
            continue
        if path.is_dir() and not path.is_symlink():
            if not any(w.startswith(rel + "/") for w in wanted):
                shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def _detect_kind(plan: PullPlan, folder: Path) -> str:
    if plan.target.source.kind:
        return plan.target.source.kind
    try:
        if plan.format == "gguf":
            from npu_proxy.models.gguf import read_gguf_header

            arch = read_gguf_header(folder / plan.entry).metadata.get("general.architecture")
            return "embed" if arch in EMBED_ARCHS else "llm"
        if (folder / "modules.json").is_file():
            return "embed"  # a sentence-transformers model
        if (folder / VISION_IR).is_file():
            return "vlm"  # a vision-language model exported by optimum-intel
        cfg = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        log.warning("cannot tell the kind of %s (%s); assuming llm", plan.name, exc)
        return "llm"
    archs = [str(a) for a in cfg.get("architectures") or []]
    if any(a.endswith("ForSequenceClassification") for a in archs):
        return "rerank"  # a cross-encoder (what TextRerankPipeline runs)
    if "WhisperForConditionalGeneration" in archs:
        return "asr"  # speech recognition (what WhisperPipeline runs)
    generative = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")
    if archs and not any(a.endswith(generative) for a in archs):
        return "embed"
    return "llm"


def _installed(store: ModelStore, plan: PullPlan) -> Manifest | None:
    found = store.get(plan.name)
    if found is None or found.commit != plan.commit or found.repo != plan.repo:
        return None
    have = {(f.path, f.size) for f in found.files}
    if have != {(f.path, f.size) for f in plan.files}:
        return None
    folder = store.model_dir(plan.name)
    if any(not (folder / f.path).is_file() or (folder / f.path).stat().st_size != f.size
           for f in found.files):
        return None
    return found


def run_pull(config: Config, plan: PullPlan, on_progress: OnProgress,
             cancel: threading.Event | None = None) -> Manifest | None:
    """Download, verify and install a planned pull; None when there was nothing to fetch."""
    import filelock

    if plan.ready:
        on_progress(Progress(status="success"))
        return None
    store = ModelStore(config.model_cache_path())
    staging = store.staging_dir(plan.name)
    # NOTE: containment is checked before anything is created: a link planted in the cache
    # must not make the pull create folders where it points.
    if not inside(store.root, staging):
        raise PullRefused(f"the staging folder {staging} leaves the model cache")
    staging.parent.mkdir(parents=True, exist_ok=True)
    lock = filelock.FileLock(str(store.lock_path(plan.name)))
    while True:
        try:
            lock.acquire(timeout=0.5)
            break
        except filelock.Timeout:
            if cancel is not None and cancel.is_set():
                raise PullCancelled("pull cancelled") from None
    try:
        done = _installed(store, plan)
        if done is not None:
            for file in plan.files:
                _Reporter(file, on_progress, cancel)(file.size, force=True)
            on_progress(Progress(status="success"))
            return done
        _prepare_staging(staging, plan)
        from huggingface_hub import hf_hub_url
        from huggingface_hub.utils._headers import build_hf_headers

        headers = build_hf_headers(library_name="npu-proxy")
        headers["Accept-Encoding"] = "identity"
        for file in plan.files:
            dest = staging / file.path
            if not safe_relative(file.path) or not inside(staging, dest):
                raise PullRefused(f"{file.path} would be written outside the model cache")
            dest.parent.mkdir(parents=True, exist_ok=True)
            url = hf_hub_url(plan.repo, file.path, revision=plan.commit or plan.revision,
                             endpoint=_endpoint())
            _fetch(url, headers, dest, file, _Reporter(file, on_progress, cancel))
        on_progress(Progress(status="verifying sha256 digest"))
        verified = _verify(staging, plan.files)
        on_progress(Progress(status="writing manifest"))
        (staging / STAGING_INFO).unlink(missing_ok=True)
        manifest = Manifest(
            name=plan.name, kind=_detect_kind(plan, staging), format=plan.format,
            source=f"hf.co/{plan.repo}" + (f":{plan.entry}" if plan.entry else ""),
            files=verified, repo=plan.repo, revision=plan.revision, commit=plan.commit,
            entry=plan.entry, npu_ready=plan.target.source.npu_ready, pulled_at=time.time())
        store.install(staging, manifest)
        log.info("pulled %s from %s (%d files, %d bytes)", plan.name, manifest.source,
                 len(verified), manifest.size)
        on_progress(Progress(status="success"))
        return manifest
    finally:
        lock.release()


def pull(config: Config, name: str, on_progress: OnProgress,
         cancel: threading.Event | None = None) -> Manifest | None:
    """plan_pull + run_pull, with the `pulling manifest` status first."""
    on_progress(Progress(status="pulling manifest"))
    return run_pull(config, plan_pull(config, name), on_progress, cancel)
