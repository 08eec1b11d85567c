"""Every setting is in docs/settings.md with the code's default, and some other test uses it.

Read from the code and the files (the `config` command is run as a user runs it, without a
server): a setting added without a row, a row whose default or environment variable
differs from the code, or a row for a setting that no longer exists fails here, as does a
setting no test names (unless listed in UNTESTED with the reason).
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import msgspec
import tomli_w
from serverctl import SUPERVISOR

from npu_proxy.protocol.config import (
    ENV_VARS,
    TEST_ONLY_FIELDS,
    Config,
    FaultHooks,
    ModelSource,
    WorkerSpec,
    load_config,
)

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "settings.md"
# Fields of the configuration that are state the supervisor hands its children, not settings
# (the page says so in one line).
NOT_SETTINGS = {"devices", "workers.switched_from"}
# Settings no test names, each with the reason a test of its effect is not worth a server.
UNTESTED = {
    "max_frame_bytes": "a cap on internal worker frames; no client request makes one that big",
    "embedding_max_batch": "speed only: vectors are the same whatever the batch "
                           "(bench/embeddings.py measures it)",
    "embedding_batch_wait": "speed only, as embedding_max_batch (bench/embeddings.py)",
    "responses_store_ttl": "expiry by wall time; the store's eviction is shown by "
                           "responses_store_max (test_settings_effects.py)",
    "responses_store_max_bytes": "same eviction path as responses_store_max",
    "workers.prompt_lookup_ngram": "speed only: output is unchanged (bench/lookup.py)",
    "workers.draft_confidence": "speed only: greedy output is unchanged (bench/decode.py)",
    "models.*.npu_ready": "picks NPU-ready weights; needs an NPU to matter",
}
# Fault hooks no test uses (removing one touches workers/engine.py, being split elsewhere).
UNUSED_HOOKS = {"abort_after_tokens"}

ROW = re.compile(r"^\| `([^`]+)` \|([^|]*)\|([^|]*)\|([^|]*)\|([^|]*)\|(.*)\|\s*$")
CODE = re.compile(r"`([^`]*)`")


def _fields(struct: type[msgspec.Struct], prefix: str) -> dict[str, msgspec.structs.FieldInfo]:
    return {prefix + f.name: f for f in msgspec.structs.fields(struct)
            if f.name not in TEST_ONLY_FIELDS and prefix + f.name not in NOT_SETTINGS}


def settings() -> dict[str, msgspec.structs.FieldInfo]:
    """Every setting by its key as the page spells it."""
    return {**_fields(Config, ""), **_fields(WorkerSpec, "workers."),
            **_fields(ModelSource, "models.*.")}


def render(value: Any) -> str:
    """A default as the page shows it (TOML-like; a list of workers by their names)."""
    if value is msgspec.NODEFAULT:
        return "required"
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list):
        return json.dumps([getattr(v, "name", v) for v in value])
    return json.dumps(value)


def default(field: msgspec.structs.FieldInfo) -> str:
    if field.default_factory is not msgspec.NODEFAULT:
        return render(field.default_factory())
    return render(field.default)


def rows() -> dict[str, tuple[str, str]]:
    """Each row of the page: key -> (environment cell, first code span of the default)."""
    found: dict[str, tuple[str, str]] = {}
    for line in PAGE.read_text(encoding="utf-8").splitlines():
        m = ROW.match(line)
        if m:
            assert m.group(1) not in found, f"{m.group(1)} is documented twice"
            spans = CODE.findall(m.group(4))
            found[m.group(1)] = (m.group(2).strip(), spans[0] if spans else "")
    return found


def test_every_setting_is_documented_and_every_row_is_a_setting() -> None:
    documented, known = set(rows()), set(settings())
    assert sorted(known - documented) == [], "settings missing from docs/settings.md"
    assert sorted(documented - known) == [], "rows of docs/settings.md for no setting"


def test_the_page_shows_the_codes_defaults() -> None:
    page = rows()
    wrong = {key: (page[key][1], default(field)) for key, field in settings().items()
             if key in page and page[key][1] != default(field)}
    assert wrong == {}, "page default vs code default"


def test_the_page_names_each_environment_variable() -> None:
    env_of = {field: var for var, (field, _) in ENV_VARS.items()}
    wrong = {key: (cell, env_of.get(key, "")) for key, (cell, _) in rows().items()
             if CODE.findall(cell) != ([env_of[key]] if key in env_of else [])}
    assert wrong == {}


def test_fault_hooks_are_not_documented() -> None:
    text = PAGE.read_text(encoding="utf-8")
    shown = [name for name in FaultHooks.__struct_fields__ if re.search(rf"\b{name}\b", text)]
    assert shown == []


def _tests_text() -> str:
    return "\n".join(p.read_text(encoding="utf-8") for p in sorted(ROOT.glob("tests/*.py"))
                     if p.name != Path(__file__).name)


def test_every_setting_is_used_by_some_test() -> None:
    text = _tests_text()
    env_of = {field: var for var, (field, _) in ENV_VARS.items()}
    untested = sorted(key for key in settings()
                      if not re.search(rf"\b{key.rsplit('.', 1)[-1]}\b", text)
                      and not (key in env_of and env_of[key] in text))
    assert untested == sorted(UNTESTED)


def test_every_fault_hook_is_used_by_some_test() -> None:
    text = _tests_text()
    unused = {name for name in FaultHooks.__struct_fields__
              if not re.search(rf"\b{name}\b", text)}
    assert unused == UNUSED_HOOKS


def test_config_command_hides_the_fault_hooks_yet_they_are_read(tmp_path: Path) -> None:
    path = tmp_path / "npu-proxy.toml"
    path.write_text(tomli_w.dumps({"runtime_dir": str(tmp_path / "rt"), "workers": [
        {"name": "llm", "role": "llm", "faults": {"hang_in_load": True, "spin_seconds": 2.0}}]}))
    out = subprocess.run([SUPERVISOR, "config", "--config", str(path)], capture_output=True,
                         text=True, check=True, timeout=120).stdout
    assert 'name = "llm"' in out and "load_timeout" in out
    hooks = [name for name in ("faults", *FaultHooks.__struct_fields__) if name in out]
    assert hooks == []
    # NOTE: still set the way the tests set them: a [[workers]] section's `faults` table.
    assert load_config(path, env={}).workers[0].faults.hang_in_load


def test_a_retired_setting_is_ignored_with_a_warning_and_a_typo_still_fails(
        tmp_path: Path, caplog: Any) -> None:
    """A config file written for an earlier version still starts; an unknown key does not."""
    from npu_proxy.protocol.config import ConfigError, load_config

    old = tmp_path / "old.toml"
    old.write_text('heartbeat_interval = 0.5\nconverter_python = "/x/python"\n'
                   '[models."m"]\npath = "/x.gguf"\n'
                   'description = "mine"\n')
    with caplog.at_level("WARNING"):
        config = load_config(old, env={})
    assert config.models["m"].path == "/x.gguf"
    for key in ("heartbeat_interval", "converter_python", "models.m.description"):
        assert key in caplog.text
    typo = tmp_path / "typo.toml"
    typo.write_text("heartbeat_timeot = 10\n")
    try:
        load_config(typo, env={})
    except ConfigError as exc:
        assert "heartbeat_timeot" in str(exc)
    else:
        raise AssertionError("a misspelt setting was accepted")
