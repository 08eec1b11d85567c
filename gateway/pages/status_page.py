"""The status page's two documents: the live page and the API key form.

Each is self-contained (inline CSS and a small inline script); their Content-Security-Policy
allows exactly those inline blocks by hash. The page's only connection is its event stream,
the form's the JSON POST of the key, both on the same origin (gateway/pages/status.py). Data
from the server is put into the page as text (`textContent`), never as markup.
"""

from __future__ import annotations

import base64
import hashlib

STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5em; color: #222; background: #fafafa; }
h1 { font-size: 1.3em; margin: 0 0 .2em; }
h2 { font-size: 1.05em; margin: 1.4em 0 .4em; }
table { border-collapse: collapse; background: #fff; }
th, td { padding: .3em .8em; border-bottom: 1px solid #ddd; text-align: left; }
th { background: #eee; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
.conn { font-size: .9em; color: #666; }
.conn.live { color: #1a7f37; }
.conn.down { color: #b3261e; }
td.state { font-weight: 600; }
.st-ready, .st-busy, .st-running { color: #1a7f37; }
.st-starting, .st-loading, .st-warming, .st-backoff, .st-draining { color: #9a6700; }
.st-failed, .st-unresponsive, .st-stopped { color: #b3261e; }
.st-idle { color: #666; font-weight: normal; }
.empty { color: #888; }
form { margin-top: 1em; }
input { font: inherit; padding: .3em; }
.wrong { color: #b3261e; }
"""

SCRIPT = """
"use strict";
const $ = (id) => document.getElementById(id);
function cell(tr, text, cls) {
  const td = document.createElement("td");
  td.textContent = text;
  if (cls) td.className = cls;
  tr.appendChild(td);
}
function replace(id, rows, empty, width) {
  const body = document.createElement("tbody");
  body.id = id;
  for (const tr of rows) body.appendChild(tr);
  if (!rows.length) {
    const tr = document.createElement("tr");
    cell(tr, empty, "empty");
    tr.firstChild.colSpan = width;
    body.appendChild(tr);
  }
  $(id).replaceWith(body);
}
function workers(list) {
  return list.map((w) => {
    const tr = document.createElement("tr");
    tr.dataset.worker = w.name;
    tr.dataset.state = w.state;
    cell(tr, w.name);
    cell(tr, w.role);
    cell(tr, w.device);
    cell(tr, w.model);
    cell(tr, w.state === "idle" ? "idle (not loaded)" : w.state, "state st-" + w.state);
    cell(tr, String(w.restarts), "num");
    cell(tr, String(w.queue), "num");
    cell(tr, String(w.in_flight), "num");
    cell(tr, String(w.gateway_requests), "num");
    return tr;
  });
}
function windows(list) {
  return list.map((r) => {
    const tr = document.createElement("tr");
    cell(tr, "last " + r.seconds / 60 + " min");
    cell(tr, r.tokens_per_s.toFixed(2), "num");
    cell(tr, r.ttft_p50 === null ? "-" : (r.ttft_p50 * 1000).toFixed(0) + " ms", "num");
    cell(tr, String(r.requests), "num");
    return tr;
  });
}
function errors(list) {
  return list.map((e) => {
    const tr = document.createElement("tr");
    cell(tr, new Date(e.time * 1000).toLocaleTimeString());
    cell(tr, e.worker || "-");
    cell(tr, e.message);
    return tr;
  });
}
function connection(text, cls) {
  $("conn").textContent = text;
  $("conn").className = "conn " + cls;
}
const events = new EventSource("/status/events");
events.onmessage = (event) => {
  const s = JSON.parse(event.data);
  replace("workers", workers(s.workers), "no workers configured", 9);
  replace("windows", windows(s.windows), "", 4);
  replace("errors", errors(s.errors), "no errors", 3);
  connection("live, updated " + new Date().toLocaleTimeString(), "live");
};
events.addEventListener("shutdown", () => connection("the server is stopping", "down"));
events.onerror = () => {
  if (events.readyState === EventSource.CLOSED) {
    connection("disconnected: reload the page", "down");
  } else {
    connection("reconnecting...", "down");
  }
};
"""

PAGE = f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>npu-proxy status</title>
<style>{STYLE}</style>
</head>
<body>
<h1>npu-proxy</h1>
<div id="conn" class="conn">connecting...</div>
<h2>Workers</h2>
<table>
<thead><tr><th>worker</th><th>role</th><th>device</th><th>model</th><th>state</th>
<th>restarts</th><th title="waiting in the worker">queue</th>
<th title="generating in the worker">in flight</th>
<th title="open at the gateway now, waiting or streaming">open at the gateway</th>
</tr></thead>
<tbody id="workers"></tbody>
</table>
<h2>Generation</h2>
<table>
<thead><tr><th>window</th><th>tokens/s</th><th>TTFT p50</th><th>requests</th></tr></thead>
<tbody id="windows"></tbody>
</table>
<h2>Recent errors</h2>
<table>
<thead><tr><th>time</th><th>worker</th><th>message</th></tr></thead>
<tbody id="errors"></tbody>
</table>
<script>{SCRIPT}</script>
</body>
</html>
"""

LOGIN_SCRIPT = """
"use strict";
const form = document.getElementById("login");
const wrong = document.getElementById("wrong");
form.addEventListener("submit", async (event) => {
  event.preventDefault();
  wrong.hidden = true;
  try {
    const answer = await fetch("/status/login", {
      method: "POST",
      headers: {"Content-Type": "application/json"},
      body: JSON.stringify({key: form.elements.key.value}),
    });
    if (answer.ok) {
      location.reload();
      return;
    }
    wrong.textContent = answer.status === 401 ? "That is not the API key."
      : answer.status === 429 ? "Too many wrong keys: try again in a minute."
      : "The server answered " + answer.status + ".";
  } catch (error) {
    wrong.textContent = "The server could not be reached.";
  }
  wrong.hidden = false;
});
"""

LOGIN = f"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>npu-proxy status: API key</title>
<style>{STYLE}</style>
</head>
<body>
<h1>npu-proxy</h1>
<p>This server needs its API key to show its status.</p>
<p id="wrong" class="wrong" hidden></p>
<form id="login" method="post" action="/status/login">
<label>API key <input type="password" name="key" autocomplete="current-password"
 required autofocus></label>
<button type="submit">Show status</button>
</form>
<script>{LOGIN_SCRIPT}</script>
</body>
</html>
"""


def _sha256(text: str) -> str:
    digest = hashlib.sha256(text.encode()).digest()
    return "'sha256-" + base64.b64encode(digest).decode() + "'"


def _policy(script: str) -> str:
    return ("default-src 'none'; "
            f"script-src {_sha256(script)}; style-src {_sha256(STYLE)}; connect-src 'self'; "
            "img-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'")


def _headers(policy: str) -> dict[str, str]:
    return {
        "Content-Security-Policy": policy,
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
        "X-Frame-Options": "DENY",
        "Cache-Control": "no-store",
        "Vary": "Accept, Cookie",
    }


PAGE_HEADERS = _headers(_policy(SCRIPT))
LOGIN_HEADERS = _headers(_policy(LOGIN_SCRIPT))
