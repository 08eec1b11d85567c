"""A GGUF model converted once to an OpenVINO IR folder in the model cache.

OpenVINO GenAI builds an OpenVINO model from a GGUF file on every load (about 3.3 s for the
embedded SmolLM2 on this machine's CPU), and a worker's restart is the product's answer to
every fault. So the first load of a GGUF saves the model and its tokenizers as IR, and every
later load (restart, model switch back, another worker on the same model) reads that folder
instead. The folder is keyed by the file's content, its sha256, not by where it lies: the
embedded GGUF of a new virtual environment, a moved or copied file, share the conversion
already made. The digest comes from the model cache's digest record (models/digests.py,
which the worker's describe_model fills first anyway), so a warm lookup reads no byte of the
GGUF. The saved graph's Q4_1 and Q4_K weights are first made exactly llama.cpp's (GenAI
rounds their zero points: workers/generation/gguf_exact.py), then the graph is rewritten
without changing its numbers (workers/ir_fusion.py: fewer, larger matrix products per decode
step); FORMAT names those rewritings in the folder's name, so a folder made by an older
version is made again (and the old one removed). A worker converts in a child process
(workers/generation/conversion.py), so it holds no more memory than one that loaded the IR.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

from npu_proxy.models.digests import DigestCache
from npu_proxy.models.gguf import UnreadableGGUF, unreadable_file
from npu_proxy.models.store import CONVERTED_FROM as COMPLETE
from npu_proxy.models.store import GGUF_IR, converted_from
from npu_proxy.workers.generation.conversion import (
    ConversionStopped,
    child_main,
    convert_in_child,
)
from npu_proxy.workers.generation.tokenizer_cap import lift_in_place

# NOTE: named, not __name__: the conversion's child runs this module as __main__, and its
# lines reach the worker's log under this name (workers/generation/conversion.py).
ENTRY = "npu_proxy.workers.gguf_ir"
log = logging.getLogger(ENTRY)

# NOTE: change it whenever the conversion's output changes (see ir_fusion.py); 6: exact Q4_1
# and Q4_K zero points (gguf_exact.py).
FORMAT = "fused-6"


def ir_folder(root: Path, gguf: Path) -> Path:
    """Where the IR of this GGUF file's content (as it is now on disk) lives under `root`
    (`<model cache>/.gguf-ir`): named by its sha256, remembered in the model cache's digest
    record, and FORMAT."""
    return root / _name(_digest(root, gguf))


def _digest(root: Path, gguf: Path) -> str:
    return DigestCache(root.parent).file_sha256(gguf)


def _name(digest: str) -> str:
    # NOTE: 64 bits of the whole file's sha256; no part of the path, so any copy shares it.
    return f"{digest[:16]}-{FORMAT}"


def loadable(model_path: str, cache: Path, stop: threading.Event | None = None,
             hang: bool = False) -> str:
    """The path a pipeline should load for `model_path`: its converted IR folder in the model
    cache when it is a GGUF file (converting it now in a child process if that was never
    done), else `model_path` unchanged. The folder is complete once its COMPLETE file exists
    (written last, naming the GGUF file), so an interrupted conversion is never loaded.
    `stop` set ends a conversion (ConversionStopped); `hang` is a test fault hook."""
    gguf = Path(model_path)
    if gguf.suffix.lower() != ".gguf" or not gguf.is_file():
        return model_path
    if why := unreadable_file(gguf):
        raise UnreadableGGUF(why)  # NOTE: a clear error instead of GenAI's from its reader
    done = ir_folder(cache / GGUF_IR, gguf)
    if (done / COMPLETE).is_file():
        log.info("loading the converted IR of %s from %s", gguf.name, done)
        _lift_tokenizer_cap(done)  # NOTE: a folder converted before the conversion did it
        return str(done)
    _prune(done.parent)
    try:
        convert_in_child(ENTRY, gguf, done, stop, hang)
    except ConversionStopped:
        raise
    except Exception:
        # NOTE: a conversion that fails (disk full, read-only cache) costs only the speed-up.
        log.exception("could not keep %s as IR; loading the GGUF file itself", gguf.name)
        return model_path
    return str(done)


def _prune(root: Path) -> None:
    """Drop converted folders that no GGUF file maps to any more: every file the model
    cache's digest record lists as still there unchanged keeps the folder of its content (a
    copy or an older virtual environment's file keeps it too), and so does the file a folder
    names when its content still maps there. What is dropped: the folder of a GGUF that is
    gone (a removed virtual environment, a model deleted by hand) or changed, of an older
    FORMAT or of the key before content (`<stem>-<hash of path, size, mtime>`), and a
    conversion's staging folder whose worker is dead: nothing would ever load them again."""
    if not root.is_dir():
        return
    wanted = {_name(digest) for digest in DigestCache(root.parent).live().values()}
    for folder in root.iterdir():
        if folder.suffix == ".partial" and not _converting(folder):
            log.info("removing %s: what a conversion that was killed left", folder)
            shutil.rmtree(folder, ignore_errors=True)
            continue
        made = converted_from(folder)
        if made is None or folder.name in wanted:
            continue  # another worker's conversion in progress, not ours, or in use
        source = made[0]
        try:
            # NOTE: a source the record lost (a write another process won) is hashed again:
            # a second per GiB, only before a conversion, which takes far longer.
            if ir_folder(root, source) == folder:
                continue
            why = (f"an older conversion of {source} (an older FORMAT or key, or the file "
                   "changed since)")
        except OSError:
            why = f"no GGUF converted to it is left ({source} is gone)"
        if _mapped(folder):
            # NOTE: e.g. an older npu-proxy sharing this cache (another key) runs on it.
            log.info("keeping %s, %s: a running process has its files mapped", folder, why)
            continue
        log.info("removing %s: %s", folder, why)
        shutil.rmtree(folder, ignore_errors=True)


def _mapped(folder: Path) -> bool:
    """Whether a running process of this host maps a file of `folder` (Linux's
    /proc/<pid>/maps; False where there is none). Read only before a conversion."""
    proc = Path("/proc")
    if not proc.is_dir():
        return False
    needle = f"{folder.resolve()}/"
    for entry in os.scandir(proc):
        if not entry.name.isdigit():
            continue
        try:
            with open(os.path.join(entry.path, "maps"), encoding="utf-8",
                      errors="replace") as f:
                if needle in f.read():
                    return True
        except OSError:
            continue  # gone, or another user's process
    return False


def _converting(staging: Path) -> bool:
    """Whether the worker named in a staging folder's name (`<folder>.<pid>.partial`) runs."""
    if os.name != "posix":
        return True  # NOTE: os.kill(pid, 0) on Windows terminates the process; keep it
    try:
        os.kill(int(staging.stem.rsplit(".", 1)[-1]), 0)
    except ValueError:
        return False
    except PermissionError:
        return True  # another user's process (a service's worker)
    except ProcessLookupError:
        return False
    return True


# The conversion's check that the rewritten graph answers as the saved one does (issue 28): a
# chat prompt, then greedy steps with both models fed the saved model's tokens, at each
# precision the CPU plugin runs here (f32 with its dynamic quantization, the workers' default;
# bf16 where the CPU has it, OpenVINO's own default there).
PROBE = [{"role": "user", "content": "Name three colours."}]
PROBE_STEPS = 8
# NOTE: the rewrites give the same numbers bit for bit; a bf16 ulp of a logit near 30 is 0.125.
PROBE_RTOL = 1e-3


def _probe_ids(folder: Path) -> Any:
    import numpy as np
    import openvino_genai as ov_genai

    tokenizer = ov_genai.Tokenizer(str(folder))
    prompt = tokenizer.apply_chat_template(PROBE, add_generation_prompt=True)
    return np.asarray(tokenizer.encode(prompt, add_special_tokens=False).input_ids.data,
                      dtype=np.int64)


def _greedy_logits(request: Any, ids: Any, forced: list[int] | None) -> tuple[Any, list[int]]:
    """Each step's last logits (a prompt, then one token a step) and the tokens fed: the
    argmax, or `forced`."""
    import numpy as np

    request.reset_state()
    names = {p.get_any_name() for p in request.model_inputs}
    steps, tokens, pos, current = [], [], 0, ids
    for i in range(PROBE_STEPS):
        n = current.shape[1]
        feed = {"input_ids": current, "attention_mask": np.ones((1, pos + n), np.int64),
                "position_ids": np.arange(pos, pos + n, dtype=np.int64)[None],
                "beam_idx": np.zeros(1, np.int32)}
        request.infer({k: v for k, v in feed.items() if k in names})
        pos += n
        logits = request.get_tensor("logits").data[0, -1].astype(np.float32)
        steps.append(logits.copy())
        tokens.append(int(logits.argmax()) if forced is None else forced[i])
        current = np.array([[tokens[-1]]], np.int64)
    return np.stack(steps), tokens


def agrees(saved: Path, rewritten: Path, folder: Path) -> bool:
    """Whether `rewritten` computes what `saved` does on the probe (see PROBE)."""
    import numpy as np
    import openvino as ov

    core = ov.Core()
    precisions = ["f32"]
    if "BF16" in core.get_property("CPU", "OPTIMIZATION_CAPABILITIES"):
        precisions.append("bf16")
    ids = _probe_ids(folder)
    for precision in precisions:
        properties = {"INFERENCE_PRECISION_HINT": precision}
        before = core.compile_model(saved, "CPU", properties).create_infer_request()
        after = core.compile_model(rewritten, "CPU", properties).create_infer_request()
        expected, tokens = _greedy_logits(before, ids, None)
        got, _ = _greedy_logits(after, ids, tokens)
        worst = float(np.abs(got - expected).max())
        same = bool((got.argmax(axis=1) == expected.argmax(axis=1)).all())
        if not same or worst > PROBE_RTOL * float(np.abs(expected).max()):
            log.warning("the rewritten graph differs at %s (logits up to %.3g apart, greedy "
                        "tokens %s): keeping the graph as converted", precision, worst,
                        "the same" if same else "not the same")
            return False
    return True


def _exact_weights(folder: Path, gguf: Path) -> None:
    """The saved graph's Q4_1 and Q4_K zero points made exact from the file's bytes (checked
    there), saved in its place; its 8-bit weights checked against the file's (WrongWeights:
    not published)."""
    import openvino as ov

    from npu_proxy.workers.generation.gguf_check import WrongWeights, check_8_bit
    from npu_proxy.workers.generation.gguf_exact import exact_zero_points

    model = ov.Core().read_model(folder / "openvino_model.xml")
    try:
        exact = exact_zero_points(model, gguf)
        check_8_bit(model, gguf)
    except WrongWeights:
        raise
    except Exception:
        # NOTE: a file GenAI read but whose tensor table this reader cannot follow (an
        # offset past its end, a type it does not know) keeps the graph as GenAI made it.
        log.exception("could not check the weights against the file: keeping them as "
                      "converted")
        return
    if exact:
        # NOTE: saved beside, then renamed over: the model read maps the old .bin file.
        ov.save_model(model, folder / "exact.xml", compress_to_fp16=False)
        del model
        for suffix in (".bin", ".xml"):
            os.replace(folder / f"exact{suffix}", folder / f"openvino_model{suffix}")


def _rewrite(folder: Path) -> None:
    """The saved graph through workers/ir_fusion.py, saved in its place if it still computes
    the same numbers (agrees())."""
    import openvino as ov

    from npu_proxy.workers.ir_fusion import optimize

    model = ov.Core().read_model(folder / "openvino_model.xml")
    optimize(model)
    # NOTE: saved beside, then renamed over: the model read maps the old .bin file.
    ov.save_model(model, folder / "rewritten.xml", compress_to_fp16=False)
    del model
    try:
        same = agrees(folder / "openvino_model.xml", folder / "rewritten.xml", folder)
    except Exception:
        log.exception("could not check the rewritten graph: keeping the graph as converted")
        same = False
    for suffix in (".bin", ".xml"):
        if same:
            os.replace(folder / f"rewritten{suffix}", folder / f"openvino_model{suffix}")
        else:
            (folder / f"rewritten{suffix}").unlink()


def _lift_tokenizer_cap(folder: Path) -> None:
    """GenAI's GGUF reader caps the tokenizer's output at 8,192 tokens whatever the model's
    context: the folder's tokenizer files rewritten without the cap (tokenizer_cap.py), so
    the pipeline's own tokenizer encodes whole prompts and the worker builds no second one."""
    try:
        lift_in_place(folder)
    except OSError as exc:  # NOTE: a read-only cache: the worker lifts it in memory then
        log.warning("could not lift the tokenizer's length cap in %s: %s", folder, exc)


def _flush(folder: Path) -> None:
    """The folder's files written through to the disk, before the COMPLETE file says it is
    whole: a crash or a power cut then never leaves a complete-looking folder with a file cut
    short, and the page cache holds clean pages, which weights.py read_back_by_page can take
    out of it (a dirty page stays until writeback)."""
    for path in folder.iterdir():
        if path.is_file() and not path.is_symlink():
            with path.open("rb+") as f:
                os.fsync(f.fileno())


def _convert(gguf: Path, done: Path, staging: Path | None = None, hang: bool = False) -> None:
    """`gguf` converted into `done`, made in `staging` and renamed once complete. In-process:
    what the conversion's child process runs (loadable() starts it)."""
    import openvino_genai as ov_genai

    staging = staging or done.with_name(f"{done.name}.{os.getpid()}.partial")
    digest = _digest(done.parent, gguf)  # NOTE: the record's, as ir_folder() named `done`
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        # NOTE: GenAI saves the IR beside the file it loads, so it loads a link placed in the
        # staging folder. Only LLMPipeline saves the tokenizers too (ContinuousBatching-
        # Pipeline saves the model alone), and CPU compiles fastest, whatever the device.
        link = staging / gguf.name
        if os.access(gguf, os.W_OK):
            link.symlink_to(gguf.resolve())
        else:
            # NOTE: GenAI opens a GGUF read-write (O_RDWR|O_APPEND, seen with strace), so a
            # file this user may not write (a package's, root's: the Debian service) fails
            # with "gguf_open"; a copy it owns loads. Only while converting.
            shutil.copyfile(gguf, link)
        log.info("converting %s to IR in %s (once)", gguf.name, done)
        pipe = ov_genai.LLMPipeline(str(link), "CPU", enable_save_ov_model=True)
        del pipe
        link.unlink()
        if not (staging / "openvino_model.xml").is_file():
            raise RuntimeError("OpenVINO GenAI saved no openvino_model.xml")
        _exact_weights(staging, gguf)
        _rewrite(staging)
        _lift_tokenizer_cap(staging)
        while hang:
            # NOTE: the test fault hook hang_in_conversion: all saved but the COMPLETE file.
            log.error("fault hook: conversion held before the folder is complete")
            time.sleep(3600)
        _flush(staging)
        (staging / COMPLETE).write_text(f"{gguf.resolve()}\n{digest}\n")
        try:
            staging.rename(done)
        except OSError:
            # NOTE: another worker converted the same file meanwhile; its folder is as good.
            if not (done / COMPLETE).is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def main(argv: list[str]) -> int:
    """The conversion's child process (`python -m npu_proxy.workers.gguf_ir`, started by
    loadable() through workers/generation/conversion.py)."""
    return child_main(argv, _convert, log)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
