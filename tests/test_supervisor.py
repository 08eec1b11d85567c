"""The supervisor's life cycle: start, status, SIGTERM with no process left behind."""

from __future__ import annotations

from pathlib import Path

import httpx
from serverctl import Server, alive, descendants


def test_sigterm_leaves_no_process(tmp_path: Path) -> None:
    srv = Server(tmp_path, workers=[{"name": "llm", "role": "llm"}]).start()
    assert srv.proc is not None
    kids = descendants(srv.proc.pid)
    pids = {c["pid"] for c in srv.children().values()}
    assert len(pids) == 2 and pids <= kids
    out = srv.cli("status").stdout
    assert "llm" in out and "ready" in out and "smollm2:135m" in out
    r = httpx.post(srv.url + "/v1/completions", json={"model": "smollm2", "prompt": "Hi",
                                                      "max_tokens": 2})
    assert r.status_code == 200
    left = srv.stop()
    assert srv.proc.returncode == 0
    assert left == set()
    assert not any(alive(p) for p in kids)
    assert "npu-proxy listening on http://127.0.0.1:" in srv.logs()
