"""Who may talk to the HTTP port, driven over loopback with the headers a browser page sends:
Host allow-list (DNS rebinding), Origin policy and CORS, Fetch Metadata, JSON-only bodies,
the key on every route that does work or shows state, the bind policy, a redacted
`npx-supervisor config`, and a runtime folder that is a link.
"""

from __future__ import annotations

import json
import socket
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import tomli_w
from serverctl import SUPERVISOR, Server
from test_observability import query, running_prometheus, wait_for

from npu_proxy.protocol.config import load_config
from npu_proxy.protocol.sockets import ipc_path_refusal

LLM = "smollm2:135m"
KEY = "sec-test-key-5f1c"
EVIL = "http://evil.example"
ALLOWED = "https://chat.example.com"
# What Chrome adds to a fetch() from a page on another site.
BROWSER = {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "cors", "Sec-Fetch-Dest": "empty"}
PROBE = {"model": LLM, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
# One JSON route per API, with the body each expects, and how each API shapes an error.
ROUTES: list[tuple[str, dict[str, Any]]] = [
    ("/v1/chat/completions", PROBE),
    ("/v1/messages", PROBE),
    ("/api/generate", {"model": LLM, "prompt": "hi", "stream": False}),
    ("/api/chat", {"model": LLM, "messages": PROBE["messages"], "stream": False}),
]


def error_shape(path: str, body: dict[str, Any]) -> str:
    """Which API's error shape `body` is, checked whole."""
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
        return "anthropic"
    if path.startswith("/v1/"):
        assert set(body["error"]) == {"message", "type", "param", "code"}
        return "openai"
    assert isinstance(body["error"], str)
    return "ollama"


def cors_headers(r: httpx.Response) -> set[str]:
    return {k for k in r.headers if k.lower().startswith("access-control-")}


# --- the default server (loopback, no key, no origins configured) --------------------------


def test_the_issue_request_from_a_foreign_page_is_refused(base_url: str) -> None:
    """The request from the issue: a page's text/plain POST, its Origin, a rebound Host."""
    r = httpx.post(base_url + "/api/generate", content='{"model":"smollm2:135m","prompt":"x"}',
                   headers={"Content-Type": "text/plain;charset=UTF-8", "Origin": EVIL,
                            "Host": "evil.example", **BROWSER})
    assert r.status_code == 403 and "evil.example" in r.json()["error"]
    assert not cors_headers(r)


@pytest.mark.parametrize(("path", "body"), ROUTES)
def test_a_foreign_host_is_refused_in_each_api_shape(base_url: str, path: str,
                                                     body: dict[str, Any]) -> None:
    port = base_url.rsplit(":", 1)[1]
    for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.evil.example",
                 f"localhost.evil.example:{port}"):
        r = httpx.post(base_url + path, json=body, headers={"Host": host})
        assert r.status_code == 403, (host, r.text)
        error_shape(path, r.json())
    r = httpx.post(base_url + path, json=body, headers={"Host": "evil.example"})
    if path == "/v1/messages":
        assert r.json()["error"]["type"] == "permission_error"


def test_local_hosts_are_served(base_url: str) -> None:
    port = base_url.rsplit(":", 1)[1]
    hostname = socket.gethostname()
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "LOCALHOST",
                 "127.0.0.1", f"0.0.0.0:{port}",
                 # Open WebUI in Docker, mDNS and other local-only names (Ollama's list).
                 f"host.docker.internal:{port}", "gateway.docker.internal", "npu-box.local",
                 f"{hostname}.local:{port}", "app.localhost", f"{hostname}:{port}",
                 # IP literals no rebound name sends: private, link-local, unspecified.
                 f"192.168.7.9:{port}", "10.1.2.3", "172.16.0.5", f"[fe80::1]:{port}",
                 "169.254.10.20", "[fd00::5]", "[::]"):
        r = httpx.get(base_url + "/api/tags", headers={"Host": host})
        assert r.status_code == 200, (host, r.text)
    # Public names and public IP literals stay refused on a loopback bind.
    for host in ("evil.example", "8.8.8.8", "[2001:4860::8888]", "local.evil.example",
                 "internal.evil.example:80", "docker.internal.evil.example",
                 f"{hostname}.evil.example"):
        r = httpx.get(base_url + "/api/tags", headers={"Host": host})
        assert r.status_code == 403, (host, r.text)


@pytest.mark.parametrize(("path", "body"), ROUTES)
def test_a_foreign_origin_is_refused_without_cors(base_url: str, path: str,
                                                  body: dict[str, Any]) -> None:
    r = httpx.post(base_url + path, json=body, headers={"Origin": EVIL, **BROWSER})
    assert r.status_code == 403
    error_shape(path, r.json())
    assert not cors_headers(r) and "Origin" in r.headers["vary"]
    preflight = httpx.options(base_url + path, headers={
        "Origin": EVIL, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type", **BROWSER})
    assert preflight.status_code == 403 and not cors_headers(preflight)
    # `null` (a sandboxed frame, a file) is a foreign origin too.
    assert httpx.get(base_url + "/api/tags", headers={"Origin": "null"}).status_code == 403
    for other in ("https://evil.example", "http://localhost.evil.example:3000",
                  "https://127.0.0.1.evil.example", "http://0.0.0.0.evil.example",
                  "https://app.evil.example", "http://evil.example/app://x", "http://[zz"):
        r = httpx.get(base_url + "/api/tags", headers={"Origin": other, **BROWSER})
        assert r.status_code == 403 and not cors_headers(r), other


# Ollama's default origins (envconfig.AllowedOrigins) and the browser extensions.
DEFAULT_ORIGINS = ["http://0.0.0.0:8080", "https://0.0.0.0", "http://127.0.0.1",
                   "https://localhost:8443", "app://obsidian.md", "file://", "tauri://localhost",
                   "vscode-webview://1d8f0a7c2b", "vscode-file://vscode-app",
                   "chrome-extension://abcdefghijklmnopabcdefghijklmnop",
                   "moz-extension://2b5c4e8a-1f3d-4c6b-9a7e-0d1f2e3c4b5a",
                   "safari-web-extension://5f1c2d3e", "ms-browser-extension://x"]


@pytest.mark.parametrize("origin", DEFAULT_ORIGINS)
def test_ollamas_default_origins_and_extensions_get_cors_answers(base_url: str,
                                                                 origin: str) -> None:
    preflight = httpx.options(base_url + "/api/chat", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type", **BROWSER})
    assert preflight.status_code == 204
    assert preflight.headers["access-control-allow-origin"] == origin
    r = httpx.post(base_url + "/api/show", json={"model": LLM},
                   headers={"Origin": origin, **BROWSER})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
    # A page is a browser: its JSON must be JSON.
    r = httpx.post(base_url + "/api/show", content=json.dumps({"model": LLM}),
                   headers={"Origin": origin, "Content-Type": "text/plain", **BROWSER})
    assert r.status_code == 415


def test_a_cross_site_request_without_origin_is_refused_but_navigation_is_not(
        base_url: str) -> None:
    # An <img src> or <script src> on a foreign page: no Origin, no CORS, still a request.
    r = httpx.get(base_url + "/api/tags", headers={
        "Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "no-cors", "Sec-Fetch-Dest": "image"})
    assert r.status_code == 403
    # Following a link to the server shows it, as for any site.
    r = httpx.get(base_url + "/", headers={
        "Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "navigate",
        "Sec-Fetch-Dest": "document"})
    assert r.status_code == 200 and r.text == "Ollama is running"


@pytest.mark.parametrize(("path", "body"), ROUTES)
def test_simple_body_types_from_a_page_are_415_in_each_api_shape(
        base_url: str, path: str, body: dict[str, Any]) -> None:
    raw = json.dumps(body)
    # A page of an allowed (loopback) origin, and one whose fetch says it is same-site.
    pages = ({"Origin": "http://localhost:3000", **BROWSER},
             {"Sec-Fetch-Site": "same-site", "Sec-Fetch-Mode": "no-cors"})
    for page in pages:
        for ctype in ("text/plain", "text/plain;charset=UTF-8",
                      "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
            r = httpx.post(base_url + path, content=raw, headers={"Content-Type": ctype, **page})
            assert r.status_code == 415, (ctype, page, r.text)
            assert error_shape(path, r.json()) in ("openai", "anthropic", "ollama")
            assert "application/json" in r.text
    r = httpx.post(base_url + path, content=raw, headers={"Content-Type": "text/plain",
                                                          **pages[0]})
    assert r.headers["access-control-allow-origin"] == "http://localhost:3000"


def test_a_tool_may_send_json_with_any_content_type(base_url: str) -> None:
    """What `curl -d`, PowerShell's Invoke-RestMethod and Python's urllib send: a form type
    (or text/plain) with a JSON body, and no browser markers — read as JSON, as by Ollama."""
    show = json.dumps({"model": LLM})
    generate = json.dumps({"model": LLM, "prompt": "hi", "stream": False,
                           "options": {"num_predict": 1}})
    for ctype in ("application/x-www-form-urlencoded", "text/plain", "text/plain;charset=UTF-8",
                  "multipart/form-data; boundary=x", "application/octet-stream"):
        r = httpx.post(base_url + "/api/show", content=show, headers={"Content-Type": ctype})
        assert r.status_code == 200 and "model_info" in r.json(), (ctype, r.text)
        r = httpx.post(base_url + "/api/generate", content=generate,
                       headers={"Content-Type": ctype}, timeout=60)
        assert r.status_code == 200 and r.json()["done"] is True, (ctype, r.text)
    r = httpx.post(base_url + "/v1/chat/completions", content=json.dumps(PROBE),
                   headers={"Content-Type": "application/x-www-form-urlencoded"}, timeout=60)
    assert r.status_code == 200 and r.json()["object"] == "chat.completion"
    # Python's urllib with `data=`: application/x-www-form-urlencoded as well.
    with urllib.request.urlopen(base_url + "/api/show", data=show.encode(), timeout=60) as resp:
        assert resp.status == 200 and json.loads(resp.read())["details"]["format"]


def test_json_with_charset_and_no_content_type_are_accepted(base_url: str) -> None:
    body = json.dumps({"model": LLM})
    for headers in ({"Content-Type": "application/json; charset=utf-8"}, {}):
        r = httpx.post(base_url + "/api/show", content=body, headers=headers)
        assert r.status_code == 200, (headers, r.text)
        r = httpx.post(base_url + "/v1/messages/count_tokens", headers=headers, content=json.dumps(
            {"model": LLM, "messages": [{"role": "user", "content": "hi"}]}))
        assert r.status_code == 200 and r.json()["input_tokens"] > 0


def test_a_loopback_origin_gets_cors_answers(base_url: str) -> None:
    page = "http://localhost:5173"
    preflight = httpx.options(base_url + "/v1/chat/completions", headers={
        "Origin": page, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type", **BROWSER})
    assert preflight.status_code == 204
    assert preflight.headers["access-control-allow-origin"] == page
    assert "POST" in preflight.headers["access-control-allow-methods"]
    allowed = {h.strip().lower() for h in
               preflight.headers["access-control-allow-headers"].split(",")}
    assert {"authorization", "content-type"} <= allowed
    assert "Origin" in preflight.headers["vary"]
    r = httpx.post(base_url + "/v1/chat/completions", json=PROBE,
                   headers={"Origin": page, **BROWSER}, timeout=60)
    assert r.status_code == 200 and r.json()["object"] == "chat.completion"
    assert r.headers["access-control-allow-origin"] == page
    assert "x-request-id" in r.headers["access-control-expose-headers"].lower()
    for other in ("http://127.0.0.1:8080", "https://localhost", "http://[::1]:3000"):
        r = httpx.get(base_url + "/api/tags", headers={"Origin": other, **BROWSER})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == other


# --- a server opened up: 0.0.0.0 with a key, an origin and a host name configured ----------


@pytest.fixture(scope="module")
def opened(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("opened")
    # NOTE: no worker: every check here is answered by the gateway alone.
    server = Server(tmp, workers=[], host="0.0.0.0", api_key=KEY,
                    allowed_origins=[ALLOWED], allowed_hosts=["npu-box.lan"]).start()
    yield server
    server.stop()


def test_the_key_guards_every_route_that_works_or_tells(opened: Server) -> None:
    url = opened.url
    guarded = [("GET", "/metrics", None), ("GET", "/health/devices", None),
               ("GET", "/api/tags", None), ("GET", "/api/ps", None),
               ("GET", "/v1/models", None), ("GET", "/openapi.json", None),
               ("POST", "/api/show", {"model": LLM}), ("POST", "/api/pull", {"model": LLM}),
               ("DELETE", "/api/delete", {"model": LLM}),
               ("POST", "/api/copy", {"source": LLM, "destination": "copy"}),
               ("POST", "/v1/chat/completions", PROBE), ("POST", "/v1/messages", PROBE),
               ("POST", "/api/embed", {"model": "all-minilm", "input": "x"})]
    for method, path, body in guarded:
        r = httpx.request(method, url + path, json=body)
        assert r.status_code == 401, (path, r.text)
        error_shape(path, r.json())
    for method, path, body in guarded[:5]:
        r = httpx.request(method, url + path, json=body, headers={"x-api-key": KEY})
        assert r.status_code == 200, (path, r.text)
    for path in ("/", "/api/version", "/health", "/health/ready"):
        r = httpx.get(url + path)
        assert r.status_code in (200, 503), (path, r.text)  # ready: no LLM worker here
        assert "pid" not in r.text


def test_a_wildcard_bind_serves_any_host_with_the_key(opened: Server) -> None:
    """As Ollama: a server bound to the network is reached by names it cannot know (a LAN
    DNS name, a public IP); what guards it there is the key."""
    auth = {"Authorization": f"Bearer {KEY}"}
    for host in (f"npu-box.lan:{opened.port}", "NPU-BOX.LAN", f"192.168.7.9:{opened.port}",
                 f"[fe80::1]:{opened.port}", f"localhost:{opened.port}", "evil.example",
                 "203.0.113.7", "npu.corp.example.com:443"):
        r = httpx.get(opened.url + "/api/tags", headers={"Host": host, **auth})
        assert r.status_code == 200, (host, r.text)
        r = httpx.get(opened.url + "/api/tags", headers={"Host": host})
        assert r.status_code == 401, (host, r.text)


def test_a_configured_origin_gets_cors_answers(opened: Server) -> None:
    preflight = httpx.options(opened.url + "/v1/messages", headers={
        "Origin": ALLOWED, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers":
            "x-api-key,anthropic-version,anthropic-dangerous-direct-browser-access,"
            "content-type,x-stainless-lang,x-stainless-retry-count",
        "Access-Control-Request-Private-Network": "true", **BROWSER})
    # A preflight never carries the key; it is answered before the key is asked for.
    assert preflight.status_code == 204
    assert preflight.headers["access-control-allow-origin"] == ALLOWED
    methods = {m.strip() for m in preflight.headers["access-control-allow-methods"].split(",")}
    assert {"GET", "POST", "DELETE", "OPTIONS"} <= methods
    allowed = {h.strip().lower() for h in
               preflight.headers["access-control-allow-headers"].split(",")}
    assert {"authorization", "x-api-key", "content-type", "anthropic-version",
            "anthropic-beta", "anthropic-dangerous-direct-browser-access", "openai-beta",
            "x-stainless-lang", "x-stainless-retry-count", "x-stainless-os"} <= allowed
    assert "Origin" in preflight.headers["vary"]
    assert preflight.headers["access-control-allow-private-network"] == "true"
    # The page can read a refusal (no key) and an answer (key).
    r = httpx.get(opened.url + "/v1/models", headers={"Origin": ALLOWED, **BROWSER})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == ALLOWED
    r = httpx.get(opened.url + "/v1/models",
                  headers={"Origin": ALLOWED, "Authorization": f"Bearer {KEY}", **BROWSER})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ALLOWED
    # Another subdomain or scheme of it is not the configured origin.
    for other in ("https://evil.chat.example.com", "http://chat.example.com",
                  "https://chat.example.com.evil.example"):
        r = httpx.get(opened.url + "/v1/models",
                      headers={"Origin": other, "Authorization": f"Bearer {KEY}", **BROWSER})
        assert r.status_code == 403 and not cors_headers(r), other


def test_config_command_never_prints_the_key(opened: Server) -> None:
    out = opened.cli("config")
    assert KEY not in out.stdout + out.stderr
    assert 'api_key = "<redacted>"' in out.stdout
    assert KEY not in opened.logs()
    for name in ("gateway", "supervisor"):
        path = Path(opened.config.runtime_dir) / "logs" / f"{name}.log"
        if path.exists():
            assert KEY not in path.read_text(errors="replace")


def test_prometheus_scrapes_with_the_key(opened: Server, tmp_path: Path) -> None:
    with running_prometheus(opened, tmp_path, credentials=KEY) as prom:
        def scraped() -> bool:
            up = query(prom, 'up{job="npu-proxy"}')
            return bool(up) and up[0]["value"][1] == "1"

        wait_for(scraped, 30, every=0.3)
        samples = query(prom, 'scrape_samples_scraped{job="npu-proxy"}')
        assert float(samples[0]["value"][1]) > 0


# --- every web origin allowed ("*"), on loopback ----------------------------------------


@pytest.fixture(scope="module")
def every_origin(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = Server(tmp_path_factory.mktemp("star"), workers=[],
                    allowed_origins=["*"]).start()
    yield server
    server.stop()


def test_star_admits_every_web_origin_but_not_null(every_origin: Server) -> None:
    for origin in ("https://evil.example", "http://chat.example.com:8080", "app://x"):
        r = httpx.get(every_origin.url + "/api/tags", headers={"Origin": origin, **BROWSER})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
    # Any page can make itself `null` (a sandboxed frame): "*" is not an explicit "null".
    r = httpx.get(every_origin.url + "/api/tags", headers={"Origin": "null", **BROWSER})
    assert r.status_code == 403 and not cors_headers(r)


# --- starting: the bind policy and the runtime folder -------------------------------------


def _start(tmp: Path, *flags: str, **settings: Any) -> subprocess.CompletedProcess[str]:
    """`npx-supervisor start` on a configuration that must be refused before it serves."""
    config = tmp / "refused.toml"
    config.write_text(tomli_w.dumps({"port": 1, "runtime_dir": str(tmp / "rt"),
                                     "workers": [], **settings}))
    return subprocess.run([SUPERVISOR, "start", "--config", str(config), *flags],
                          capture_output=True, text=True, timeout=120,
                          stdin=subprocess.DEVNULL)


def test_a_remote_bind_without_a_key_is_refused_naming_the_options(tmp_path: Path) -> None:
    for host in ("0.0.0.0", "::", "192.168.7.9"):
        out = _start(tmp_path, host=host)
        assert out.returncode != 0
        for option in ("api_key", "NPU_PROXY_API_KEY", "127.0.0.1",
                       "allow_unauthenticated_remote", "--allow-unauthenticated-remote"):
            assert option in out.stderr, (option, out.stderr)
        assert not (tmp_path / "rt").exists()


def test_the_loud_opt_out_starts_a_remote_bind(tmp_path: Path) -> None:
    srv = Server(tmp_path, workers=[], host="0.0.0.0")
    srv.start(True, 240.0, ["--allow-unauthenticated-remote"])
    try:
        assert httpx.get(srv.url + "/api/tags").status_code == 200
        assert "ALLOW_UNAUTHENTICATED_REMOTE" in srv.logs()
    finally:
        srv.stop()


def test_a_symlinked_runtime_folder_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "planted"
    target.mkdir(mode=0o700)
    (tmp_path / "rt").symlink_to(target, target_is_directory=True)
    out = _start(tmp_path)
    assert out.returncode != 0
    assert "symbolic link" in out.stderr and str(tmp_path / "rt") in out.stderr
    assert list(target.iterdir()) == []


def test_a_runtime_folder_too_long_for_its_sockets_is_refused_naming_the_fix(
        tmp_path: Path) -> None:
    """A Unix socket's path has at most 107 bytes on Linux: a deep runtime folder is refused
    before anything starts, with what to change, not ZeroMQ's "File name too long" from a
    half-started supervisor."""
    deep = tmp_path / ("d" * (110 - len(str(tmp_path))))
    out = _start(tmp_path, runtime_dir=str(deep), workers=[{"name": "llm", "role": "llm"}])
    assert out.returncode != 0
    assert "Traceback" not in out.stderr, out.stderr
    for fix in ("NPU_PROXY_RUNTIME_DIR", "shorter", 'transport = "tcp"', str(deep)):
        assert fix in out.stderr, out.stderr
    assert not deep.exists()
    # NOTE: and the commands that talk to a running instance say the same, not a traceback.
    status = subprocess.run([SUPERVISOR, "status", "--config", str(tmp_path / "refused.toml")],
                            capture_output=True, text=True, timeout=60)
    assert status.returncode != 0
    assert "too long for its sockets" in status.stderr and "Traceback" not in status.stderr


def test_the_socket_path_limit_counts_the_longest_worker_name_in_bytes(tmp_path: Path) -> None:
    def refusal(runtime: str, name: str, transport: str = "ipc") -> str | None:
        config = tmp_path / "c.toml"
        config.write_text(tomli_w.dumps({"runtime_dir": runtime, "transport": transport,
                                         "workers": [{"name": name, "role": "embed"}]}))
        return ipc_path_refusal(load_config(config, env={}))

    folder = "/" + "r" * 50
    # "<folder>/<name>.out": 51 + 1 + len(name) + 4 bytes; 107 is the most.
    assert refusal(folder, "w" * 51) is None
    assert refusal(folder, "w" * 52) is not None
    assert refusal(folder, "é" * 26) is not None  # NOTE: 52 bytes in 26 characters
    assert refusal(folder, "w" * 52, "tcp") is None
