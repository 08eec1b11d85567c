"""Children's logs: rotation caps their size, a failing disk never stops the drain (a child
blocked on a full pipe would be killed as stalled), and `logs` reads only the tail."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest
from serverctl import SUPERVISOR

from npu_proxy.supervisor.logfiles import MAX_LINE, RotatingLog, follow, tail, tee


def test_rotation_keeps_size_and_backups(tmp_path: Path) -> None:
    log = RotatingLog(tmp_path / "llm.log", max_bytes=1000, backups=2)
    for i in range(100):
        log.write(f"line {i:04d} ".encode() + b"x" * 40 + b"\n")
    log.close()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["llm.log", "llm.log.1", "llm.log.2"]
    for name in files:
        assert (tmp_path / name).stat().st_size <= 1000
    # The newest lines are in llm.log, the ones just before them in llm.log.1.
    assert (tmp_path / "llm.log").read_bytes().splitlines()[-1].startswith(b"line 0099")
    last_of_1 = (tmp_path / "llm.log.1").read_bytes().splitlines()[-1]
    first_of_0 = (tmp_path / "llm.log").read_bytes().splitlines()[0]
    assert int(last_of_1[5:9]) + 1 == int(first_of_0[5:9])


def test_write_errors_never_stop_the_drain(tmp_path: Path) -> None:
    """/dev/full fails every write (ENOSPC): the tee still reads the child's output to the
    end, so the child never blocks on a full pipe."""
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full here")
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys\nfor i in range(20000): print('x' * 100, i)"],
        stdout=subprocess.PIPE)
    assert child.stdout is not None
    out = RotatingLog(Path("/dev/full"), max_bytes=1 << 40, backups=0)
    drain = threading.Thread(target=tee, args=(child.stdout, out, False))
    drain.start()
    assert child.wait(timeout=120) == 0
    drain.join(timeout=120)
    assert not drain.is_alive()
    assert out.dropped == 20000


def test_a_line_without_newline_is_read_in_bounded_pieces(tmp_path: Path) -> None:
    source = tmp_path / "output"
    source.write_bytes(b"y" * (MAX_LINE * 3 + 5))
    log = RotatingLog(tmp_path / "g.log", max_bytes=1 << 30, backups=1)
    with open(source, "rb") as r:
        tee(r, log, False)
    assert (tmp_path / "g.log").stat().st_size == MAX_LINE * 3 + 5


def test_tail_reads_from_the_end(tmp_path: Path) -> None:
    path = tmp_path / "big.log"
    with open(path, "wb") as f:
        for i in range(200_000):
            f.write(b"line %d\n" % i)
    assert tail(path, 3) == [b"line 199997\n", b"line 199998\n", b"line 199999\n"]
    assert tail(path, 0) == []
    (tmp_path / "short.log").write_bytes(b"a\nb")
    assert tail(tmp_path / "short.log", 10) == [b"a\n", b"b"]


def test_follow_goes_on_across_a_rotation(tmp_path: Path) -> None:
    log = RotatingLog(tmp_path / "w.log", max_bytes=12, backups=1)
    log.write(b"before\n")
    lines = follow(tmp_path / "w.log", poll=0.01)
    log.write(b"one\n")
    assert next(lines) == b"one\n"
    log.write(b"two\n")  # past 12 bytes: w.log becomes w.log.1, "two" starts a new w.log
    log.write(b"three\n")
    assert (tmp_path / "w.log.1").read_bytes() == b"before\none\n"
    assert next(lines) == b"two\n"
    assert next(lines) == b"three\n"
    lines.close()
    log.close()


def test_logs_command_prints_the_tail(tmp_path: Path) -> None:
    logs = tmp_path / "run" / "logs"
    logs.mkdir(parents=True)
    (logs / "llm.log").write_bytes(b"".join(b"entry %d\n" % i for i in range(1000)))
    run = subprocess.run([SUPERVISOR, "logs", "llm", "-n", "2", "--runtime-dir",
                          str(tmp_path / "run")], capture_output=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout == b"entry 998\nentry 999\n"
    run = subprocess.run([SUPERVISOR, "logs", "../llm", "--runtime-dir",
                          str(tmp_path / "run")], capture_output=True, timeout=60)
    assert run.returncode != 0 and b"no log" in run.stderr
