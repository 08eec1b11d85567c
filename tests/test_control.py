"""The typed control plane, in process: the catalogue round-trips, the one client tells "no
supervisor" from "refused", and the supervisor has a handler for every command."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import get_args

import pytest
import zmq

from npu_proxy.protocol import control
from npu_proxy.protocol.config import Config, WorkerSpec
from npu_proxy.protocol.sockets import bind, control_endpoint
from npu_proxy.protocol.states import ProcessState
from npu_proxy.supervisor.service.commands import Refusal
from npu_proxy.supervisor.service.loop import Supervisor

COMMANDS: list[control.Command] = [
    control.Ping(), control.Status(), control.Start(worker="llm"), control.Stop(worker="llm"),
    control.Restart(worker="llm", now=True), control.Load(worker="llm", model="qwen2.5:0.5b"),
    control.Unload(worker="embed"), control.Shutdown(),
]


def test_every_command_round_trips() -> None:
    assert {type(c) for c in COMMANDS} == set(get_args(control.Command))
    decoder = control.command_decoder()
    for command in COMMANDS:
        assert decoder.decode(control.encode(command)) == command
    row = control.ChildStatus(name="llm", role="llm", device="CPU", model="m",
                              state=ProcessState.BACKOFF, pid=None, uptime=0.0, restarts=2,
                              last_error="exited with code -9")
    reply = control.StatusReply(pid=1, host="127.0.0.1", port=11435, children=[row])
    assert control.reply_decoder().decode(control.encode(reply)) == reply
    assert row.as_json()["state"] == "backoff"


def _answer_once(config: Config, reply: control.Reply) -> threading.Thread:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = ctx.socket(zmq.REP)
    sock.setsockopt(zmq.LINGER, 0)
    bind(sock, config, control_endpoint(config))

    def serve() -> None:
        try:
            control.command_decoder().decode(sock.recv())
            sock.send(control.encode(reply))
        finally:
            sock.close(0)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def test_the_client_tells_its_failures_apart(tmp_path: Path) -> None:
    config = Config(runtime_dir=str(tmp_path))
    with pytest.raises(control.NoSupervisor, match="no npu-proxy instance answers"):
        control.call(config, control.Ping(), control.Pong, timeout=0.2)
    _answer_once(config, control.Refused(error="no worker named 'x'"))
    with pytest.raises(control.CommandRefused, match="no worker named 'x'"):
        control.call(config, control.Stop(worker="x"), control.Ok, timeout=30)
    _answer_once(config, control.Pong(pid=42))
    assert control.call(config, control.Ping(), control.Pong, timeout=30).pid == 42


def test_the_supervisor_handles_every_command(tmp_path: Path) -> None:
    config = Config(runtime_dir=str(tmp_path / "rt"),
                    workers=[WorkerSpec(name="llm", role="llm", allow_switch=False)])
    supervisor = Supervisor(config, echo=False)
    try:
        assert set(supervisor._handlers) == set(get_args(control.Command))
        assert isinstance(supervisor._handlers[control.Ping](control.Ping()), control.Pong)
        status = supervisor._handlers[control.Status](control.Status())
        assert isinstance(status, control.StatusReply) and status.children == []
        with pytest.raises(Refusal, match="no worker named 'nope'"):
            supervisor._handlers[control.Stop](control.Stop(worker="nope"))
    finally:
        supervisor.ctx.term()
