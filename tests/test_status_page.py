"""The live status page: what a browser gets at `/` (and what every other client still gets),
its snapshot and event stream, the API key in front of them, and the page itself in a real
Chromium watching a worker die and come back."""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from playwright.sync_api import expect, sync_playwright
from serverctl import Server, small_llm, wait_for

from npu_proxy.gateway.core.recent import Recent
from npu_proxy.gateway.pages.status import cookie_name, cookie_token

LLM = "smollm2:135m"
KEY = "status-key-456"
BROWSER_ACCEPT = ("text/html,application/xhtml+xml,application/xml;q=0.9,image/avif,"
                  "image/webp,*/*;q=0.8")
NOT_READY = re.compile(r"^(backoff|starting|loading|warming|unresponsive|failed)$")
SERVING = re.compile(r"^(ready|busy)$")




def next_event(lines: Iterator[str]) -> dict[str, Any]:
    """The next snapshot on an event stream's lines (the stream stays open)."""
    for line in lines:
        if line.startswith("data: "):
            return dict(json.loads(line[6:]))
    raise AssertionError("the stream ended without an event")


def first_event(url: str, **headers: str) -> dict[str, Any]:
    """The first snapshot an event stream sends; the stream is closed after it."""
    with httpx.stream("GET", url + "/status/events", headers=headers, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        return next_event(r.iter_lines())


# --- the snapshot's arithmetic -----------------------------------------------------------


def test_recent_windows_and_errors() -> None:
    now = [1000.0]
    recent = Recent(clock=lambda: now[0], wall=lambda: 1.7e9)
    recent.tokens(30)
    recent.finished("llm", 0.2, 30)
    now[0] += 100  # out of the 1-minute window, inside the 5-minute one
    recent.tokens(60)
    recent.finished("llm", 0.4, 60)
    recent.finished("llm", None, 0)  # failed before its first token
    one, five = recent.summary()["windows"]
    assert one == {"seconds": 60, "tokens_per_s": 1.0, "requests": 2, "ttft_p50": 0.4}
    assert five == {"seconds": 300, "tokens_per_s": 0.3, "requests": 3, "ttft_p50": 0.3}
    for i in range(30):
        recent.error("llm", f"error {i}\nsecond line")
    errors = recent.summary()["errors"]
    assert len(errors) == 20 and errors[0]["message"] == "error 29 second line"


# --- the shared server: no key -----------------------------------------------------------


def test_browsers_get_the_page_everyone_else_ollamas_answer(base_url: str) -> None:
    page = httpx.get(base_url + "/", headers={"Accept": BROWSER_ACCEPT})
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "<title>npu-proxy status</title>" in page.text
    csp = page.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "connect-src 'self'" in csp
    assert re.search(r"script-src 'sha256-[A-Za-z0-9+/=]+'", csp)
    assert page.headers["x-content-type-options"] == "nosniff"
    assert page.headers["referrer-policy"] == "no-referrer"
    assert page.headers["x-frame-options"] == "DENY"
    assert not re.search(r"(src|href)=", page.text), "the page loads nothing else"
    for accept in ("*/*", "application/json", "text/plain", "text/html;q=0"):
        r = httpx.get(base_url + "/", headers={"Accept": accept})
        assert r.status_code == 200 and r.text == "Ollama is running", accept
        assert r.headers["content-type"].startswith("text/plain")
    head = httpx.head(base_url + "/", headers={"Accept": BROWSER_ACCEPT})
    assert head.headers["content-type"].startswith("text/plain")
    # A client that sends no Accept at all (http.client sends none).
    conn = http.client.HTTPConnection(base_url.removeprefix("http://"), timeout=10)
    try:
        conn.request("GET", "/")
        resp = conn.getresponse()
        assert resp.status == 200 and resp.read() == b"Ollama is running"
    finally:
        conn.close()


def test_snapshot_shows_workers_rates_and_open_pages(base_url: str) -> None:
    r = httpx.post(base_url + "/v1/chat/completions", timeout=120, json={
        "model": LLM, "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 200
    snap = httpx.get(base_url + "/status.json").json()
    rows = {w["name"]: w for w in snap["workers"]}
    assert set(rows) == {"llm", "embed", "rerank"}
    assert rows["llm"]["role"] == "llm" and rows["llm"]["model"] == LLM
    assert rows["llm"]["state"] in ("ready", "busy") and rows["llm"]["restarts"] >= 0
    assert {"device", "queue", "in_flight"} <= set(rows["embed"])
    one, five = snap["windows"]
    assert (one["seconds"], five["seconds"]) == (60, 300)
    assert one["requests"] >= 1 and one["tokens_per_s"] > 0 and one["ttft_p50"] > 0
    assert five["requests"] >= one["requests"]
    # The stream's first event is the same snapshot, with this page counted.
    event = first_event(base_url)
    assert [w["name"] for w in event["workers"]] == [w["name"] for w in snap["workers"]]
    assert event["pages"] >= 1
    # A page that went away leaves no stream behind.
    wait_for(lambda: httpx.get(base_url + "/status.json").json()["pages"] == 0)


# --- a server with an API key, and a browser ---------------------------------------------


# The file without which the keyed server's llm worker stays loading (its fault hook).
LOAD_GATE = "llm-may-load"


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("status")
    (tmp / LOAD_GATE).touch()
    # NOTE: the embedded model cut to two layers (serverctl.small_llm): these tests are about
    # the page, keys and states, never what the model says. Its restart is quick enough to
    # come and go between two of the page's snapshots (one a second), so the browser test
    # holds the restarted worker's load (hold_load_until) until the page has shown it.
    server = Server(tmp, workers=[
        {"name": "llm", "role": "llm", "faults": {"hold_load_until": str(tmp / LOAD_GATE)}},
        {"name": "embed", "role": "embed"},
    ], api_key=KEY, backoff_initial=0.2, status_max_streams=2, models=small_llm()).start()
    yield server
    server.stop()


def test_the_key_guards_page_stream_and_snapshot(keyed: Server) -> None:
    url = keyed.url
    page = httpx.get(url + "/", headers={"Accept": BROWSER_ACCEPT})
    assert page.status_code == 401
    assert 'name="key"' in page.text and 'id="login"' in page.text
    assert LLM not in page.text and "data-worker" not in page.text
    assert "content-security-policy" in page.headers
    # Ollama's probe stays open.
    assert httpx.get(url + "/").text == "Ollama is running"
    for path in ("/status/events", "/status.json"):
        assert httpx.get(url + path).status_code == 401
        assert httpx.get(url + path, headers={"Authorization": "Bearer wrong"}).status_code \
            == 401
    assert httpx.get(url + "/status.json", headers={"x-api-key": KEY}).status_code == 200
    assert first_event(url, authorization=f"Bearer {KEY}")["workers"]

    wrong = httpx.post(url + "/status/login", json={"key": "nope"})
    assert wrong.status_code == 401 and "set-cookie" not in wrong.headers
    assert httpx.post(url + "/status/login", content=b"{",
                      headers={"content-type": "application/json"}).status_code == 400
    ok = httpx.post(url + "/status/login", json={"key": KEY})
    assert ok.status_code == 204
    cookie = ok.headers["set-cookie"]
    assert "httponly" in cookie.lower() and "samesite=strict" in cookie.lower()
    assert KEY not in cookie, "the cookie holds a token, not the key"
    jar = {cookie_name(keyed.port): ok.cookies[cookie_name(keyed.port)]}
    with httpx.Client(base_url=url, cookies=jar) as client:
        shown = client.get("/", headers={"Accept": BROWSER_ACCEPT})
        assert shown.status_code == 200 and "<tbody id=\"workers\">" in shown.text
        assert client.get("/status.json").status_code == 200
        # The cookie is good for the status routes only, never as an API key.
        assert client.get("/api/tags").status_code == 401
        assert client.get("/v1/models").status_code == 401


def test_the_cookie_is_per_port_expires_and_logins_are_rate_limited(keyed: Server) -> None:
    ok = httpx.post(keyed.url + "/status/login", json={"key": KEY})
    name = cookie_name(keyed.port)
    assert ok.status_code == 204 and str(keyed.port) in name
    max_age = re.search(r"max-age=(\d+)", ok.headers["set-cookie"].lower())
    assert max_age is not None and 0 < int(max_age[1]) <= 7 * 24 * 3600

    def shown(value: str, cookie: str = name) -> int:
        return httpx.get(keyed.url + "/status.json", cookies={cookie: value}).status_code

    assert shown(ok.cookies[name]) == 200
    later = int(time.time()) + 3600
    assert shown(cookie_token(KEY, keyed.port, later)) == 200
    # A token for another port (another server with the same key), or one past its expiry,
    # or under the unscoped name, opens nothing.
    assert shown(cookie_token(KEY, keyed.port + 1, later)) == 401
    assert shown(cookie_token(KEY, keyed.port, int(time.time()) - 1)) == 401
    assert shown(ok.cookies[name], cookie="npu_proxy_key") == 401

    # Wrong keys from one address: after a few, 429 with Retry-After, even for the right key;
    # another address is not held back. NOTE: 127.0.0.2 is loopback too, so the addresses
    # the other tests log in from stay free.
    transport = httpx.HTTPTransport(local_address="127.0.0.2")
    with httpx.Client(base_url=keyed.url, transport=transport) as guesser:
        codes = [guesser.post("/status/login", json={"key": f"guess{i}"}).status_code
                 for i in range(12)]
        assert codes[0] == 401 and codes[-1] == 429, codes
        held = guesser.post("/status/login", json={"key": KEY})
        assert held.status_code == 429 and int(held.headers["retry-after"]) >= 1
        assert "set-cookie" not in held.headers
    assert httpx.post(keyed.url + "/status/login", json={"key": KEY}).status_code == 204


def test_pages_open_at_once_are_bounded(keyed: Server) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}

    def pages() -> int:
        return int(httpx.get(keyed.url + "/status.json", headers=auth).json()["pages"])

    wait_for(lambda: pages() == 0)
    with (httpx.Client(base_url=keyed.url, headers=auth, timeout=30) as client,
          client.stream("GET", "/status/events") as one,
          client.stream("GET", "/status/events") as two):
        # NOTE: each stream's line iterator is kept: an abandoned one closes its connection.
        lines = [one.iter_lines(), two.iter_lines()]
        next_event(lines[0])
        assert next_event(lines[1])["pages"] == 2
        third = client.get("/status/events")
        assert third.status_code == 503 and "status_max_streams" in third.text
        assert third.headers["retry-after"]
    wait_for(lambda: pages() == 0)
    assert first_event(keyed.url, **auth)["workers"]


def chromium() -> str | None:
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path is not None:
            return path
    return None


def test_page_in_a_browser_follows_a_worker_restart(keyed: Server) -> None:
    exe = chromium()
    if exe is None:
        pytest.skip("no Chromium found (Debian package `chromium`; .ci/run installs it)")
    args = ["--no-sandbox"] if os.geteuid() == 0 else []
    origin = keyed.url
    gate = keyed.tmp / LOAD_GATE
    requests: list[str] = []
    csp_errors: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=exe, headless=True, args=args)
        try:
            page = browser.new_page()
            page.on("request", lambda req: requests.append(req.url))
            page.on("console", lambda msg: csp_errors.append(msg.text)
                    if "Content Security Policy" in msg.text else None)
            navigations: list[str] = []
            page.on("framenavigated", lambda frame: navigations.append(frame.url)
                    if frame == page.main_frame else None)

            page.goto(origin + "/")
            expect(page.locator("input[name=key]")).to_be_visible()
            assert page.locator("tr[data-worker]").count() == 0
            page.fill("input[name=key]", "not-the-key")
            page.click("button[type=submit]")
            expect(page.locator("#wrong")).to_have_text("That is not the API key.")
            assert page.locator("tr[data-worker]").count() == 0
            page.fill("input[name=key]", KEY)
            page.click("button[type=submit]")

            llm = page.locator('tr[data-worker="llm"]')
            expect(llm).to_have_attribute("data-state", SERVING, timeout=60_000)
            expect(page.locator('tr[data-worker="embed"]')).to_be_visible()
            expect(page.locator("#conn")).to_contain_text("live")
            restarts = llm.locator("td").nth(5)
            before = int(restarts.inner_text())
            page.evaluate("window.__sameDocument = true")
            loads = len(navigations)

            gate.unlink()  # the restarted worker stays loading until the page shows it
            os.kill(int(keyed.children()["llm"]["pid"]), signal.SIGKILL)
            expect(llm).to_have_attribute("data-state", NOT_READY, timeout=60_000)
            gate.touch()
            expect(llm).to_have_attribute("data-state", SERVING, timeout=240_000)
            expect(restarts).to_have_text(str(before + 1), timeout=30_000)
            expect(page.locator("#errors")).to_contain_text("llm")

            assert page.evaluate("window.__sameDocument === true"), "the page was reloaded"
            assert len(navigations) == loads
        finally:
            gate.touch()
            browser.close()
    # One stream served the page throughout: no polling, no reconnect.
    assert sum(u.startswith(origin + "/status/events") for u in requests) == 1, requests
    elsewhere = [u for u in requests if not u.startswith(origin + "/")]
    assert elsewhere == [], "the page made requests to another host"
    assert csp_errors == []


# --- shutdown ----------------------------------------------------------------------------


def test_open_streams_end_cleanly_when_the_server_stops(tmp_path: Path) -> None:
    srv = Server(tmp_path, workers=[{"name": "embed", "role": "embed"}]).start()
    lines: list[str] = []
    failure: list[BaseException] = []
    opened = threading.Event()

    def read() -> None:
        try:
            with httpx.stream("GET", srv.url + "/status/events", timeout=60) as r:
                for line in r.iter_lines():
                    lines.append(line)
                    if line.startswith("data: "):
                        opened.set()
        except BaseException as exc:
            failure.append(exc)
        finally:
            opened.set()

    reader = threading.Thread(target=read)
    reader.start()
    try:
        assert opened.wait(30)
    finally:
        srv.stop()
    reader.join(30)
    assert not reader.is_alive()
    assert failure == [], failure
    assert "event: shutdown" in lines, lines[-5:]
