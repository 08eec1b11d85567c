"""Installing a pull: the staging folder prepared (partial files of the same commit kept),
the files downloaded and verified, the model's kind detected, the folder renamed into the
cache with its manifest; `pull()` = plan + run.

Never imports OpenVINO: the gateway runs this in a thread.
"""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time
from pathlib import Path

from npu_proxy.models.pull.download import Reporter, fetch_file, verify_files
from npu_proxy.models.pull.plan import (
    VISION_IR,
    OnProgress,
    Progress,
    PullCancelled,
    PullPlan,
    PullRefused,
    hub_endpoint,
    plan_pull,
)
from npu_proxy.models.store import Manifest, ModelStore, inside, safe_relative
from npu_proxy.models.upkeep import QuotaExceeded, check_room
from npu_proxy.protocol.config import Config

log = logging.getLogger(__name__)

STAGING_INFO = ".pull.json"
EMBED_ARCHS = ("bert", "nomic-bert", "nomic-bert-moe", "jina-bert-v2", "t5encoder",
               "xlm-roberta", "roberta", "gte")


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
    if cancel is not None and cancel.is_set():  # NOTE: its client left while it waited
        raise PullCancelled("pull cancelled")
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
                Reporter(file, on_progress, cancel)(file.size, force=True)
            on_progress(Progress(status="success"))
            return done
        try:
            # NOTE: what is staged already (a resumed pull) is part of what the plan needs.
            check_room(store.root, config.max_cache_bytes, sum(f.size for f in plan.files),
                       f"pulling {plan.name}", skip=staging)
        except QuotaExceeded as exc:
            raise PullRefused(str(exc)) from None
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
                             endpoint=hub_endpoint())
            fetch_file(url, headers, dest, file, Reporter(file, on_progress, cancel))
        on_progress(Progress(status="verifying sha256 digest"))
        verified = verify_files(staging, plan.files)
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
