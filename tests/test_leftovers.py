"""Nothing a test starts outlives the test process, however it ends (issue 46): a process
that started a server (as pytest does) is SIGKILLed, and the supervisor, the gateway and the
workers all end."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from serverctl import alive, descendants, wait_for

_STARTER = """
import sys, time
sys.path.insert(0, sys.argv[2])
from pathlib import Path
from serverctl import Server
srv = Server(Path(sys.argv[1]), workers=[{"name": "llm", "role": "llm", "lazy": True}])
srv.start()
print(srv.proc.pid, flush=True)
time.sleep(3600)
"""


def test_a_killed_test_process_leaves_no_server(tmp_path: Path) -> None:
    starter = subprocess.Popen(
        [sys.executable, "-c", _STARTER, str(tmp_path), str(Path(__file__).parent)],
        stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    tree: set[int] = set()
    try:
        assert starter.stdout is not None
        supervisor = int(starter.stdout.readline())
        tree = descendants(starter.pid)
        assert supervisor in tree and len(tree) >= 2  # the supervisor and its gateway
        os.kill(starter.pid, signal.SIGKILL)
        starter.wait()
        wait_for(lambda: not any(alive(pid) for pid in tree), timeout=60,
                 what=f"processes left after the test process was killed: {tree}")
    finally:
        if starter.poll() is None:
            starter.kill()
            starter.wait()
        for pid in tree:  # NOTE: what a failure left, so it does not outlive this test
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
