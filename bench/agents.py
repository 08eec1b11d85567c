"""Real agent work (issue 42, point 5): the small tasks of bench/_agent_tasks.py, each in a
scratch folder of its own, done by the agent clients people run — Codex CLI (Responses),
Claude Code (Anthropic Messages), OpenCode, Qwen Code, Continue's `cn` and aider (OpenAI
chat) — against this server and against llama.cpp's `llama-server --jinja` on the same GGUF,
in one run.

    python bench/agents.py --llama-server PATH [--model-gguf PATH] [--clients codex,claude]
                           [--tasks read-and-answer,create-a-file] [--timeout 2400]
                           [--trim] [--short] [--runs N] [--results FILE]

The clients are the ones `make setup` installs into .clients/ (pinned in tests/clients/: the
npm ones, and aider in a venv of its own), each started as tests/clientlaunch.py starts them
(private HOME, a placeholder key, telemetry and updates off, only loopback reachable for the
node ones), in its own auto-approve mode (Codex `workspace-write`, Claude Code `acceptEdits`
with its file and Bash tools, OpenCode's permissions set to allow, Qwen Code `--yolo`, cn
`--auto`, aider `--yes-always` with the folder's files added on its command line), through a
capturing proxy that counts each request and the prompt tokens the server reported (none for
aider: it streams without asking for usage). With their own system prompts and tools: the
first request of a client is its full agent prompt (8-20k tokens; aider's is ~1k), read in
minutes on 2 cores; later tasks of the same client reuse the prefix each server keeps.
`--trim` turns each client's extras off with its own switches, as a user with a small model
would (tools no task needs, memory and skills notes; their system prompts stay). `--short`
replaces a client's own system prompt (8-12k tokens for Codex and Qwen Code) with a short
one of four sentences, through the client's own switch (tests/clientlaunch.py Ask.short).
`--runs N` runs each client, task and server N times (the clients sample, so one run is one
draw of the model's choices), alternating the servers.

Success is judged by what the task left (files, programs run again, the one fact asked for
in the output), never by the exit code alone. The model is the Qwen2.5-Coder-1.5B-Instruct
Q4_K_M GGUF from PyPI (tests/qwen_coder.py) unless --model-gguf names another; both servers
get each client's own sampling parameters. One server busy at a time: each task runs on this
server, then on llama-server. Prints a line per run, then per client and server: tasks
completed, requests, prompt tokens, wall time.

The whole run is hours on 2 cores (each client's first prompt alone is minutes on each
server), so it can be taken in parts: with `--results FILE` each run's outcome is appended to
FILE as a JSON line once it ends, runs already there are not run again, and the summary counts
every run in FILE. A part that starts anew starts both servers anew, so its first task of a
client reads that client's prompt without a kept prefix, as the run's first part did.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import pytest
from _agent_tasks import TASKS, Task
from _llama_server import LlamaServer
from clientlaunch import ASKED, Ask, Run, execute
from peers import start_private
from qwen_coder import ensure
from serverctl import MODEL_CACHE

MODEL = "qwen2.5-coder:1.5b"
CONTEXT = 32768
OUTPUT = 4096
# The prompt tokens a reply reports, in each API's words (the last one of a stream counts).
USAGE = re.compile(rb'"(?:prompt_tokens|input_tokens|prompt_eval_count)"\s*:\s*(\d+)')


@dataclass
class Outcome:
    client: str
    server: str
    task: str
    done: bool
    requests: int
    prompt_tokens: int
    seconds: float
    rc: int
    why: str
    # The product's commit the run was made with (product_commit: HEAD, -dirty): parts of
    # one results file taken in several sessions say which code each part ran.
    commit: str = ""
    # Which of the --runs repeats of this client, task and server (1 for a single run).
    run: int = 1


def product_commit() -> str:
    """HEAD's commit, `-dirty` when a tracked file differs from it: bench/results/ left out,
    as the run's own rows are appended there."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(Path(__file__).resolve().parents[1]), *args],
                              capture_output=True, text=True, check=False).stdout.strip()

    changed = git("status", "--porcelain", "--untracked-files=no", "--", ".",
                  ":(exclude)bench/results")
    return git("rev-parse", "--short", "HEAD") + ("-dirty" if changed else "")


def prompt_tokens(run: Run) -> int:
    total = 0
    for exchange in run.proxy.inference():
        counts = USAGE.findall(exchange.reply)
        if counts:
            total += int(counts[-1])
    return total


def keep(run: Run, work: Path, folder: Path) -> None:
    """The run's exchanges (requests and replies, whole) and the folder's files, for a
    post-mortem of what the model and the client did."""
    folder.mkdir(parents=True, exist_ok=True)
    with (folder / "exchanges.jsonl").open("w") as sink:
        for e in run.proxy.exchanges:
            sink.write(json.dumps({"method": e.method, "path": e.path, "status": e.status,
                                   "body": e.json(), "reply": e.reply.decode(errors="replace")})
                       + "\n")
    (folder / "client.txt").write_text(f"exit {run.rc}\n--- stdout\n{run.out}\n--- stderr\n"
                                       f"{run.err}\n")
    shutil.copytree(work, folder / "work", dirs_exist_ok=True)


def labelled(client: str, trim: bool, short: bool) -> str:
    """The client's name in the results: +trim for a run with its extras off, +short for
    one with the short system prompt."""
    return client + ("+trim" if trim else "") + ("+short" if short else "")


def attempt(client: str, task: Task, server: str, url: str, root: Path,
            timeout: float, kept: Path | None, trim: bool = False,
            short: bool = False, repeat: int = 1) -> Outcome:
    # NOTE: the folder's path is in the client's prompt: a first run's is the one earlier
    # results were made with; a repeat's folder is named after its number.
    label = labelled(client, trim, short).replace("+", "-")
    tmp = root / (f"{label}-{task.name}-{server.split()[0]}"
                  + (f"-{repeat}" if repeat > 1 else ""))
    work = tmp / "work"
    for name, text in task.files.items():
        (work / name).parent.mkdir(parents=True, exist_ok=True)
        (work / name).write_text(text)
    ask = Ask(prompt=task.prompt, model=MODEL, context=CONTEXT, output=OUTPUT, act=True,
              trim=trim, short=short)
    started = time.perf_counter()
    run = execute(f"{client}:{task.name}", ASKED[client](tmp, ask), tmp, url, timeout)
    seconds = time.perf_counter() - started
    try:
        done = task.check(work, run.out)
    except (OSError, ValueError):
        done = False
    if kept is not None:
        keep(run, work, kept / tmp.name)
    # NOTE: the scratch folders' paths are left out: the results file is kept in the tree.
    said = (run.err.strip() or run.out.strip()).replace(str(work), "<work>")
    why = "" if done else said.replace(str(root), "<tmp>")[-300:].replace("\n", " | ")
    return Outcome(labelled(client, trim, short), server, task.name, done,
                   len(run.proxy.inference()), prompt_tokens(run), seconds, run.rc, why,
                   product_commit(), repeat)


def recorded(results: Path | None) -> list[Outcome]:
    """The outcomes an earlier part of the run appended to `results`."""
    if results is None or not results.is_file():
        return []
    return [Outcome(**json.loads(line)) for line in results.read_text().splitlines() if line]


def report(outcomes: list[Outcome], servers: list[str]) -> None:
    width = max([9, *(len(o.client) + 1 for o in outcomes)])
    print(f"\n{'client':<{width}} server        done   requests  prompt tokens  wall s")
    for client in dict.fromkeys(o.client for o in outcomes):
        for server in servers:
            mine = [o for o in outcomes if o.client == client and o.server == server]
            if not mine:
                continue
            print(f"{client:<{width}} {server:<13} {sum(o.done for o in mine):>2}/{len(mine):<3}"
                  f"{sum(o.requests for o in mine):>8}  {sum(o.prompt_tokens for o in mine):>13}"
                  f"  {sum(o.seconds for o in mine):>6.0f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-server", type=Path)
    ap.add_argument("--model-gguf", type=Path)
    ap.add_argument("--clients", default=",".join(ASKED))
    ap.add_argument("--tasks", default=",".join(t.name for t in TASKS))
    ap.add_argument("--timeout", type=float, default=2400.0,
                    help="seconds one client may take for one task")
    ap.add_argument("--keep", type=Path, help="a folder to keep each run's exchanges and "
                    "files in")
    ap.add_argument("--trim", action="store_true", help="each client's extras off with its "
                    "own switches (tests/clientlaunch.py Ask.trim, docs/clients.md); counted "
                    "as CLIENT+trim")
    ap.add_argument("--short", action="store_true", help="each client's own system prompt "
                    "replaced by a short one through its own switch (Ask.short; cn and aider "
                    "keep theirs); counted as CLIENT+short")
    ap.add_argument("--runs", type=int, default=1, help="runs of each client, task and "
                    "server: the clients sample (their own parameters), so one run is one draw "
                    "of the model's choices; the summary counts every run")
    ap.add_argument("--results", type=Path, help="a JSON-lines file of outcomes: appended "
                    "to as runs end, and the runs already in it are not run again")
    args = ap.parse_args()
    # NOTE: SIGTERM ends the run as Ctrl-C does: both servers stopped on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    clients = [c for c in args.clients.split(",") if c]
    unknown = set(clients) - set(ASKED)
    tasks = [t for t in TASKS if t.name in args.tasks.split(",")]
    if unknown or not tasks or not 1 <= args.runs <= 100:
        raise SystemExit(f"clients: {', '.join(ASKED)}; tasks: "
                         f"{', '.join(t.name for t in TASKS)}; runs: 1-100")
    gguf = args.model_gguf or ensure(MODEL_CACHE)
    outcomes = recorded(args.results)
    done_before = {(o.client, o.task, o.server, o.run) for o in outcomes}
    with tempfile.TemporaryDirectory(prefix="npu-proxy-agents-") as tmp:
        root = Path(tmp)
        (root / "server").mkdir()
        # NOTE: the server's own deadlines (a client's first prompt takes minutes to read on
        # 2 cores: its reading has time of its own, workers.min_prefill_rate); 2 GB of KV
        # cache hold a 32k context and the prefixes the later tasks reuse.
        server, _, _ = start_private(root / "server", MODEL, gguf, {"kv_cache_gb": 2.0}, {})
        targets = [("this server", server.url)]
        llama = None
        try:
            if args.llama_server is not None:
                llama = LlamaServer(args.llama_server, gguf, 1, CONTEXT, 2,
                                    extra=["--jinja"]).start()
                targets.append(("llama-server", llama.url))
            for client, task, repeat, (name, url) in itertools.product(
                    clients, tasks, range(1, args.runs + 1), targets):
                if (labelled(client, args.trim, args.short), task.name, name,
                        repeat) not in done_before:
                    outcomes.append(run_one(args, client, task, name, url, root, repeat))
        finally:
            if llama is not None:
                llama.stop()
            server.stop()
    report(outcomes, [name for name, _ in targets])


def run_one(args: argparse.Namespace, client: str, task: Task, name: str, url: str,
            root: Path, repeat: int) -> Outcome:
    """One run, appended to the results file and printed as it ends."""
    try:
        outcome = attempt(client, task, name, url, root, args.timeout, args.keep, args.trim,
                          args.short, repeat)
    except pytest.skip.Exception as exc:
        raise SystemExit(f"{client}: {exc}") from None
    if args.results is not None:
        with args.results.open("a") as sink:
            sink.write(json.dumps(asdict(outcome)) + "\n")
    print(f"{outcome.client} {task.name} on {name}"
          + (f" (run {repeat})" if args.runs > 1 else "")
          + f": {'done' if outcome.done else 'NOT done'} (exit {outcome.rc}), "
          f"{outcome.requests} requests, {outcome.prompt_tokens} prompt tokens, "
          f"{outcome.seconds:.0f} s" + (f"; client said: {outcome.why}" if outcome.why else ""),
          flush=True)
    return outcome


if __name__ == "__main__":
    main()
