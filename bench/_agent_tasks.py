"""The small agent tasks bench/agents.py gives each client (issue 42, point 5): the files a
scratch folder starts with, what the client is asked, and a check of what the task left (the
folder's files, the programs in it run again, the client's final output) — never of how the
model worded its answer beyond the one fact asked for."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# A check: the folder the client worked in and what it printed; True when the task is done.
Check = Callable[[Path, str], bool]


@dataclass(frozen=True)
class Task:
    name: str
    files: dict[str, str]
    prompt: str
    check: Check


def _read(work: Path, name: str) -> str | None:
    path = work / name
    return path.read_text(errors="replace") if path.is_file() else None


def _runs(work: Path, *argv: str, expect: str | None = None) -> bool:
    """`python argv` in the folder exits 0 (and prints `expect`, when given)."""
    try:
        done = subprocess.run([sys.executable, *argv], cwd=work, capture_output=True,
                              text=True, timeout=60, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return False
    return done.returncode == 0 and (expect is None or done.stdout.strip() == expect)


def _word(text: str, word: str) -> bool:
    return re.search(rf"(?<![\w.]){re.escape(word)}(?!\w)", text, re.IGNORECASE) is not None


CSV = "name,qty\n" + "".join(f"item{i},{i * 3}\n" for i in range(1, 17))  # 17 lines
MATH = "def is_even(n):\n    return n % 2 == 1\n"
MATH_TEST = ("from mathutil import is_even\n\nassert is_even(4)\nassert not is_even(7)\n"
             "assert is_even(0)\nprint('ok')\n")
UTIL = "def old_name(x):\n    return x * 2\n"
MAIN = "from util import old_name\n\nprint(old_name(21))\n"
SOURCE = "first line\nsecond line, with a comma\nthird: 3\n"
TODO = "write report\ncall Alice\nfix bike\n"


def _renamed(work: Path, _: str) -> bool:
    util, main = _read(work, "util.py") or "", _read(work, "main.py") or ""
    return ("def new_name" in util and "old_name" not in util + main
            and _runs(work, "main.py", expect="42"))


def _appended(work: Path, _: str) -> bool:
    lines = (_read(work, "todo.txt") or "").strip().splitlines()
    return lines[:3] == TODO.strip().splitlines() and len(lines) == 4 \
        and lines[3].strip().lower() == "buy milk"


def _config(work: Path, _: str) -> bool:
    try:
        return bool(json.loads(_read(work, "config.json") or "") == {"debug": True, "port": 8080})
    except ValueError:
        return False


TASKS: tuple[Task, ...] = (
    Task("read-and-answer",
         {"hello.py": 'GREETING = "Bonjour from Lyon"\nprint(GREETING)\n'},
         "Read hello.py and tell me which city its greeting names. Answer with the city only.",
         lambda work, out: _word(out, "Lyon")),
    Task("create-a-file",
         {"hello.py": 'print("hello")\n'},
         "Read hello.py and create a file named answer.txt containing only the word Paris.",
         lambda work, out: (_read(work, "answer.txt") or "").strip().strip(".").lower()
         == "paris"),
    Task("edit-a-function",
         {"calc.py": "def add(a, b):\n    return a - b\n"},
         "The function add in calc.py subtracts instead of adding. Fix it.",
         lambda work, out: _runs(work, "-c", "import calc; assert calc.add(2, 3) == 5")),
    Task("fix-a-failing-test",
         {"mathutil.py": MATH, "test_mathutil.py": MATH_TEST},
         "Run `python test_mathutil.py`: it fails. Fix the bug in mathutil.py so that it "
         "passes, without changing the test.",
         lambda work, out: _read(work, "test_mathutil.py") == MATH_TEST
         and _runs(work, "test_mathutil.py", expect="ok")),
    Task("find-a-symbol",
         {"src/app.py": "from src.net.wire import parse_header\n",
          "src/net/wire.py": "def parse_header(raw):\n    return raw.split(b':', 1)\n",
          "src/net/util.py": "def checksum(data):\n    return sum(data) % 256\n"},
         "Which file in this folder defines the function parse_header? Answer with its path.",
         lambda work, out: "wire.py" in out),
    Task("count-lines",
         {"data.csv": CSV},
         "How many lines does data.csv have? Answer with the number only.",
         lambda work, out: _word(out, "17")),
    Task("append-a-line",
         {"todo.txt": TODO},
         "Add the line 'buy milk' at the end of todo.txt.",
         _appended),
    Task("write-a-script",
         {},
         "Create a Python script greet.py that prints exactly: Hello, World!",
         lambda work, out: _runs(work, "greet.py", expect="Hello, World!")),
    Task("change-a-setting",
         {"config.json": '{"debug": false, "port": 8080}\n'},
         "In config.json, set debug to true and leave everything else as it is.",
         _config),
    Task("rename-a-function",
         {"util.py": UTIL, "main.py": MAIN},
         "Rename the function old_name to new_name in util.py and in main.py, which calls it.",
         _renamed),
    Task("copy-a-file",
         {"source.txt": SOURCE},
         "Copy the contents of source.txt into a new file copy.txt.",
         lambda work, out: (_read(work, "copy.txt") or "").strip() == SOURCE.strip()),
)
