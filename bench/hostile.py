"""Hostile requests against a running server, each while a well-behaved stream runs on the
same llm worker (issue 27's corpus, the earlier ones, and issue 43's classes: schemas the
grammar compiler rejects or takes long over, regex automata, Whisper prompts, audio bombs and
odd audio headers, dense text to speech, slow encodes).

    python bench/hostile.py [--only NAME ...] [--list]

Starts a private server (an llm, an asr and a tts worker, an API key, a configured alias;
without espeak-ng, no tts worker and no speech attacks). First the victim's
idle baseline: a streamed `/v1/chat/completions` (`ignore_eos`, long) and its longest gap
between two chunks. Then per attack: a victim stream starts, the attack is sent once its first
token arrived, the victim keeps reading for a second after the attack's answer and is closed.
Per attack it prints the answer's status (or what the connection did), the victim's longest
gap beyond its idle baseline, the growth of the gateway's and the workers' peak RSS (VmHWM of
/proc/<pid>/status, pids from the supervisor's status), and whether any worker restarted.

Bars (issue 27): a stall above 1 s beyond the baseline, gateway growth above 64 MiB, any
restart or any 5xx is flagged in the last column.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import socket
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from serverctl import Server

LLM = "smollm2:135m"
KEY = "hostile-bench-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
HI = [{"role": "user", "content": "hi"}]
MIB = 1024 * 1024


def hwm_kib(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


class Victim(threading.Thread):
    """A long greedy stream; records the gaps between its chunks until told to stop."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.first = threading.Event()
        self.stop = threading.Event()
        self.gap = 0.0
        self.chunks = 0
        self.error = ""

    def run(self) -> None:
        body = {"model": LLM, "messages": [{"role": "user", "content": "Tell a long story."}],
                "stream": True, "max_tokens": 6000, "ignore_eos": True, "temperature": 0}
        try:
            with httpx.stream("POST", self.url + "/v1/chat/completions", json=body,
                              headers=AUTH, timeout=300) as r:
                last = None
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    now = time.perf_counter()
                    if last is not None:
                        self.gap = max(self.gap, now - last)
                    last = now
                    self.chunks += 1
                    self.first.set()
                    if self.stop.is_set():
                        return
        except httpx.HTTPError as exc:
            self.error = type(exc).__name__
        finally:
            self.first.set()


# --- the attacks: each returns what the client saw --------------------------------------


def wav(samples: int, rate: int = 16_000, channels: int = 1, declared_rate: int = 0) -> bytes:
    """A 16-bit PCM WAV of silence; `declared_rate` writes another rate into its header."""
    data = b"\0" * (2 * channels * samples)
    rate_field = declared_rate or rate
    fmt = struct.pack("<HHIIHH", 1, channels, rate_field,
                      (rate_field * 2 * channels) & 0xFFFFFFFF, 2 * channels, 16)
    return (b"RIFF" + struct.pack("<I", 36 + len(data)) + b"WAVEfmt " + struct.pack("<I", 16)
            + fmt + b"data" + struct.pack("<I", len(data)) + data)


def flac_bomb(seconds: int, rate: int, channels: int) -> bytes:
    """A small FLAC of silence that decodes to seconds x rate x channels samples."""
    import numpy as np
    import soundfile

    out = io.BytesIO()
    block = np.zeros((rate * 10, channels), dtype="int16")
    with soundfile.SoundFile(out, "w", rate, channels, format="FLAC") as f:
        for _ in range(seconds // 10):
            f.write(block)
    return out.getvalue()


def upload(url: str, audio: bytes, name: str, fields: dict[str, str]) -> str:
    r = httpx.post(url + "/v1/audio/transcriptions", headers=AUTH, timeout=300,
                   files={"file": (name, audio)}, data={"model": "whisper-1", **fields})
    return str(r.status_code)


def post(url: str, path: str, content: bytes, headers: dict[str, str] | None = None,
         method: str = "POST") -> str:
    try:
        r = httpx.request(method, url + path, content=content, timeout=120,
                          headers={**AUTH, "content-type": "application/json",
                                   **(headers or {})})
    except httpx.HTTPError as exc:
        return type(exc).__name__
    return str(r.status_code)


def raw_socket(url: str, send: Callable[[socket.socket], None]) -> str:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        try:
            send(s)
            reply = s.recv(200)
        except OSError as exc:
            return type(exc).__name__
    return reply.split(b"\r\n", 1)[0].decode(errors="replace")[9:12] or "closed"


def slowloris(url: str, count: int = 200, hold_s: float = 8.0) -> str:
    """`count` connections that send headers promising 32 MiB, then a byte a second."""
    host, port = url.removeprefix("http://").split(":")
    socks: list[socket.socket] = []
    head = (f"POST /api/chat HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {32 * MIB}\r\n\r\n{{").encode()
    for _ in range(count):
        try:
            s = socket.create_connection((host, int(port)), timeout=5)
            s.sendall(head)
            socks.append(s)
        except OSError:
            break
    deadline = time.monotonic() + hold_s
    alive = len(socks)
    while time.monotonic() < deadline:
        time.sleep(1)
        alive = 0
        for s in socks:
            try:
                s.sendall(b" ")
                alive += 1
            except OSError:
                pass
    for s in socks:
        s.close()
    return f"{alive}/{count} held"


def attacks(url: str) -> dict[str, Callable[[], str]]:
    enum = [1e15 + i for i in range(400_000)]
    # NOTE: written out by hand: the client's own JSON encoder stops at ~1000 levels.
    deep = (b'{"model":"' + LLM.encode() + b'","max_tokens":1,"messages":[{"role":"user",'
            b'"content":"hi"}],"tools":[{"type":"function","function":{"name":"f",'
            b'"parameters":' + b'{"type":"object","properties":{"x":' * 900
            + b'{"type":"string"}' + b"}}" * 900 + b"}}]}")
    many_tools = [{"type": "function", "function": {
        "name": f"f{i}", "parameters": {"type": "object", "properties": {
            f"p{j}": {"type": "string", "description": "d" * 200} for j in range(20)}}}}
        for i in range(2000)]
    def call(path: str, body: Any = None, content: bytes | None = None,
             headers: dict[str, str] | None = None, method: str = "POST") -> Callable[[], str]:
        # NOTE: encoded now, not while the victim streams: the client's own JSON encoding
        # holds its GIL and would show as a gap in the victim's thread.
        data = content if content is not None else json.dumps(body).encode()
        return lambda: post(url, path, content=data, headers=headers, method=method)

    speech = _speech_attacks(url, call) if shutil.which("espeak-ng") else {}
    return {
        **_grammar_attacks(call), **speech,
        "schema blow-up (format)": call("/api/chat", {
            "model": LLM, "messages": HI, "stream": False, "options": {"num_predict": 1},
            "format": {"type": "object", "properties": {
                "k" * 262_144: {"anyOf": [True] * 4000}}}}),
        "100k stop_sequences (anthropic)": call("/v1/messages", {
            "model": LLM, "max_tokens": 4, "messages": HI,
            "stop_sequences": [f"stop{i}" for i in range(100_000)]}),
        "100k stop (openai)": call("/v1/chat/completions", {
            "model": LLM, "max_tokens": 4, "messages": HI,
            "stop": [f"stop{i}" for i in range(100_000)]}),
        "100k options.stop (ollama)": call("/api/chat", {
            "model": LLM, "messages": HI, "stream": False,
            "options": {"num_predict": 4, "stop": [f"stop{i}" for i in range(100_000)]}}),
        "template x2000, 64 KiB prompt": call("/api/generate", {
            "model": LLM, "stream": False, "prompt": "p" * 65_536,
            "template": "{{ .Prompt }}" * 2000, "options": {"num_predict": 1}}),
        "template x2000, 8 MiB prompt": call("/api/generate", {
            "model": LLM, "stream": False, "prompt": "p" * (8 * MIB),
            "template": "{{ .Prompt }}" * 2000, "options": {"num_predict": 1}}),
        "detokenize 2M ids": call("/detokenize", {
            "model": LLM, "tokens": [42] * 2_000_000}),
        "tools: enum of 400k 1e15": call("/v1/chat/completions", {
            "model": LLM, "max_tokens": 1, "messages": HI, "tools": [{
                "type": "function", "function": {"name": "f", "parameters": {
                    "type": "object", "properties": {"n": {"enum": enum}}}}}]}),
        "tools: nested 900 deep": call("/v1/chat/completions", content=deep),
        "tools: 2000 x 20 params, required": call("/v1/chat/completions", {
            "model": LLM, "max_tokens": 1, "messages": HI, "tools": many_tools,
            "tool_choice": "required"}),
        "delete a configured alias": call("/api/delete", {"model": "aliasx"},
                                                  method="DELETE"),
        "log forging path (%0a, ESC)": call(
            "/api/x%0a2026-01-01 INFO forged%1b[2J", {}),
        "huge headers (2000 x 8 KiB)": lambda: raw_socket(url, lambda s: s.sendall(
            b"GET /api/tags HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            + b"".join(b"X-H%d: %s\r\n" % (i, b"a" * 8192) for i in range(2000)) + b"\r\n")),
        "slowloris: 200 slow 32 MiB bodies": lambda: slowloris(url),
        "nested JSON [ x 1M": call("/api/chat", content=b"[" * 1_000_000),
        "nested JSON in messages x 100k": call(
            "/v1/chat/completions",
            content=b'{"model":"m","messages":' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
        "invalid UTF-8 in content": call(
            "/api/chat", content=b'{"model":"' + LLM.encode()
            + b'","stream":false,"messages":[{"role":"user","content":"\xff\xfe\xc0"}]}'),
        "giant number (10^100000)": call(
            "/api/chat", content=b'{"model":"' + LLM.encode()
            + b'","messages":[],"options":{"num_predict":1' + b"0" * 100_000 + b"}}"),
        "30 MiB prompt": call("/api/generate", {
            "model": LLM, "stream": False, "prompt": "word " * (6 * MIB)}),
        "1M empty messages": call("/v1/chat/completions", {
            "model": LLM, "max_tokens": 1, "messages": [{"role": "user", "content": ""}]
            * 1_000_000}),
        "odd sampling (temp -1, min_p 5, nan)": call(
            "/api/chat", content=b'{"model":"' + LLM.encode()
            + b'","stream":false,"messages":[],"options":{"temperature":-1,"min_p":5,'
            b'"repeat_penalty":NaN}}'),
        "garbage inline image (20 MiB)": call("/api/chat", {
            "model": LLM, "stream": False, "messages": [{
                "role": "user", "content": "x", "images": ["QUFB" * (5 * MIB)]}]}),
        "body without key (16 MiB)": call(
            "/api/chat", content=b" " * (16 * MIB), headers={"Authorization": ""}),
    }


Call = Callable[..., Callable[[], str]]


def _grammar_attacks(call: Call) -> dict[str, Callable[[], str]]:
    """Issue 43: schemas the grammar compiler rejects natively (it took the worker down
    inside its step), regexes with huge automata, and compiles that take long."""
    def chat(**extra: Any) -> Callable[[], str]:
        return call("/v1/chat/completions", {"model": LLM, "max_tokens": 4, "messages": HI,
                                             **extra})

    def schema(value: dict[str, Any]) -> dict[str, Any]:
        return {"type": "json_schema", "json_schema": {"name": "x", "schema": value}}

    huge = {"type": "integer", "minimum": 1e19}
    return {
        "schema minimum 1e19 (response_format)": chat(response_format=schema(huge)),
        "schema minimum 1e19 (ollama format)": call("/api/chat", {
            "model": LLM, "messages": HI, "stream": False, "format": huge,
            "options": {"num_predict": 4}}),
        "schema minimum 1e19 (tools, auto)": chat(tools=[{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": {"n": huge}}}}]),
        "schema minimum 1e19 (responses text.format)": call("/v1/responses", {
            "model": LLM, "input": "hi", "max_output_tokens": 16, "text": {"format": {
                "type": "json_schema", "name": "x", "schema": huge}}}),
        "regex (?:a{0,300}){0,300}": chat(structured_outputs={"regex": "(?:a{0,300}){0,300}"}),
        "schema enum of 200k integers": chat(response_format=schema(
            {"enum": list(range(200_000))})),
        "schema maxLength 1e9": chat(response_format=schema(
            {"type": "string", "maxLength": 1_000_000_000})),
    }


def _speech_attacks(url: str, call: Call) -> dict[str, Callable[[], str]]:
    """Issue 43: Whisper prompts without a limit, decompression bombs, odd headers, dense text
    to speech and slow encodes."""
    second = wav(16_000)
    bomb = flac_bomb(600, 96_000, 8)
    return {
        "whisper prompt of 500 KB": lambda: upload(url, second, "a.wav",
                                                   {"prompt": "word " * 100_000}),
        f"FLAC bomb ({len(bomb) // 1024} KiB: 600 s, 96 kHz, 8 ch)": lambda: upload(
            url, bomb, "bomb.flac", {}),
        "WAV of 199 samples": lambda: upload(url, wav(199), "short.wav", {}),
        "WAV at 4294967295 Hz": lambda: upload(url, wav(16_000, declared_rate=4_294_967_295),
                                               "rate.wav", {}),
        "speech of 4096 emoji": call("/v1/audio/speech", {
            "model": "tts-1", "voice": "alloy", "input": "\U0001F600" * 4096,
            "response_format": "wav"}),
        "speech: 1000 characters as opus at speed 0.5": call("/v1/audio/speech", {
            "model": "tts-1", "voice": "alloy", "input": "The quick brown fox. " * 48,
            "response_format": "opus", "speed": 0.5}),
    }


# --- the run ----------------------------------------------------------------------------


def pids(server: Server) -> dict[str, tuple[int, int]]:
    """name -> (pid, restarts) for the gateway and every worker."""
    return {name: (int(c["pid"] or 0), int(c["restarts"]))
            for name, c in server.children().items()}


def baseline(url: str, runs: int = 2, seconds: float = 6.0) -> float:
    gaps = []
    for _ in range(runs):
        victim = Victim(url)
        victim.start()
        victim.first.wait(120)
        time.sleep(seconds)  # NOTE: a bench, not a test: an idle stretch of stream on purpose
        victim.stop.set()
        victim.join(60)
        gaps.append(victim.gap)
    return max(gaps)


def run(server: Server, name: str, attack: Callable[[], str], base: float) -> dict[str, Any]:
    before = pids(server)
    gw = next(pid for n, (pid, _) in before.items() if n == "gateway")
    workers = [pid for n, (pid, _) in before.items() if n != "gateway" and pid]
    gw0, wk0 = hwm_kib(gw), sum(hwm_kib(p) for p in workers)
    victim = Victim(server.url)
    victim.start()
    victim.first.wait(120)
    start = time.perf_counter()
    try:
        status = attack()
    except Exception as exc:
        status = type(exc).__name__
    took = time.perf_counter() - start
    time.sleep(1.0)
    victim.stop.set()
    victim.join(120)
    after = pids(server)
    restarted = [n for n in after if after[n] != before.get(n)]
    gw_growth = (hwm_kib(gw) - gw0) / 1024
    wk_growth = (sum(hwm_kib(p) for p in workers) - wk0) / 1024
    stall = victim.gap - base
    flags = []
    if stall > 1.0:
        flags.append("stall")
    if gw_growth > 64:
        flags.append("gateway mem")
    if restarted:
        flags.append("restart " + ",".join(restarted))
    if status.startswith("5"):
        flags.append("5xx")
    if victim.error:
        flags.append("victim " + victim.error)
    return {"attack": name, "status": status, "took_s": took, "gap_s": victim.gap,
            "stall_s": stall, "gw_mib": gw_growth, "workers_mib": wk_growth,
            "restarted": restarted, "flags": flags}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", default=None, help="substrings of attack names")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args()
    if args.list:
        print("\n".join(attacks("http://x:1")))
        return
    load = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-hostile-") as tmp:
        # NOTE: resident, so that a first use's start does not read as a restart.
        workers = [{"name": "llm", "role": "llm"},
                   {"name": "asr", "role": "asr", "lazy": False}]
        if shutil.which("espeak-ng"):
            workers.append({"name": "tts", "role": "tts", "lazy": False})
        server = Server(Path(tmp), workers=workers, api_key=KEY,
                        model_aliases={"aliasx": LLM}).start()
        rows = []
        try:
            base = baseline(server.url)
            print(f"victim idle baseline: longest gap {base * 1000:.0f} ms; "
                  f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on "
                  f"{os.cpu_count()} cores; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
            print("| attack | status | took s | victim gap s | stall beyond baseline s "
                  "| gateway peak +MiB | workers peak +MiB | restart | over a bar |")
            print("|---|---|---|---|---|---|---|---|---|")
            for name, attack in attacks(server.url).items():
                if args.only and not any(o in name for o in args.only):
                    continue
                row = run(server, name, attack, base)
                rows.append(row)
                print(f"| {name} | {row['status']} | {row['took_s']:.1f} | "
                      f"{row['gap_s']:.2f} | {row['stall_s']:+.2f} | {row['gw_mib']:.0f} | "
                      f"{row['workers_mib']:.0f} | {'yes' if row['restarted'] else 'no'} | "
                      f"{', '.join(row['flags']) or '-'} |", flush=True)
            listed = httpx.get(server.url + "/api/tags", headers=AUTH, timeout=30).json()
            kept = any(m["name"] == LLM for m in listed["models"])
            print(f"alias target {LLM} still listed after the alias delete: {kept}")
        finally:
            server.stop()
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
