"""No server rlpipe starts runs on a borrowed port, and only its owner can reach it (`pipeline.process.ports`).

- 50 worker-and-server pairs started at once on this host through the real `ServerBackend` / `ServerProcess`
  path, each server a light stand-in of rlpipe's levanter launcher (`tests/fake_servers.py launcher`: the same
  announce and secret protocol, no JAX): every server binds its own port and announces it, every backend talks to
  its own server only (the server answers its process id), and a backend's secret is refused by the others.
- A foreign HTTP server on a fixed port is named in one line; on a port the worker picked (vLLM, SGLang), a start
  that finds it taken (by a foreign HTTP server, or by a socket that makes the server's bind fail) is retried on
  another port and is not counted as a start.
- The generate endpoint: a wrong token is refused with 401; connections that send nothing do not block a real
  request, a connection beyond `max_connections` gets 503, and a silent one is closed after `read_timeout_s`; a
  flood of twice `max_pending` requests gets 503 for the excess at once, and every accepted request is answered.
- A reserved port (jax.distributed's coordinator) cannot be bound by anyone else while it is held, and a server
  that sets SO_REUSEPORT (as gRPC does) can listen on it.

Waits are on conditions, with deadlines; nothing here sleeps to wait.
"""

from __future__ import annotations

import argparse
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from pipeline.config import ConfigError, ServerInferenceConfig
from pipeline.environments.base import Completion
from pipeline.environments.endpoint import GenerateEndpoint
from pipeline.process.listener import BoundedHandler, BoundedHTTPServer
from pipeline.process.ports import (
    ServerIdentity,
    bearer_ok,
    bind_listener,
    new_secret,
    read_announcement,
    reserve_port,
)
from policy.inference.adapters import ServerLoadError
from policy.inference.server import ServerBackend

FAKE = Path(__file__).resolve().parent / "fake_servers.py"
LAUNCHER = f"{{python}} {FAKE} launcher --host {{host}} --port {{port}} --step {{step}}"
DEADLINE_S = 60.0


def wait_for(what: str, cond: Callable[[], Any], timeout: float = DEADLINE_S) -> Any:
    """`cond()` once it is truthy (polled), AssertionError naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        out = cond()
        if out:
            return out
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def backend(tmp_path: Path, name: str, **config: Any) -> ServerBackend:
    cfg = ServerInferenceConfig(**{"command": LAUNCHER, "port": 0, "startup_timeout_s": 120,
                                   "load_timeout_s": 60, **config})  # fmt: skip
    b = ServerBackend(cfg, None)
    b.attach(str(tmp_path / name), "{}", str(tmp_path / f"{name}.server.log"))
    return b


# ---------------------------------------------------------------------------------------------
# worker and server pairs
# ---------------------------------------------------------------------------------------------


def test_fifty_concurrent_starts_each_talk_to_their_own_server(tmp_path: Path) -> None:
    n = 50
    backends = [backend(tmp_path, f"w{i}") for i in range(n)]
    try:
        with ThreadPoolExecutor(n) as pool:
            list(pool.map(lambda i: backends[i].load_policy(i), range(n)))
        addresses = set()
        for i, b in enumerate(backends):
            assert b.process is not None and b.process.starts == 1 and b.loaded_step == i
            assert b.process.argv[b.process.argv.index("--port") + 1] == "0"  # the server chose its own port
            answer = b._client.get(f"{b.root_url}/rlpipe/policy_step", timeout=30).json()
            assert answer == {"step": i, "pid": b.process.pid}, (i, answer)  # its own server, nobody else's
            addresses.add(b.address)
        assert len(addresses) == n
        for i in range(0, n, 7):  # a backend's secret opens no other backend's server
            other = backends[(i + 1) % n]
            r = backends[i]._client.get(f"{other.root_url}/rlpipe/policy_step", timeout=30)
            assert r.status_code == 401, r.text
    finally:
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda b: b.shutdown(), backends))
    assert all(b.process is not None and not b.process.alive() for b in backends)


class _Squatter:
    """A plain HTTP server on loopback that is not rlpipe's: 404 for every route, and it counts what it gets."""

    def __init__(self) -> None:
        self.requests: list[str] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                owner.requests.append(self.path)
                self.send_error(404, "nothing here")

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = int(self.httpd.server_address[1])
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def squatter() -> Iterator[_Squatter]:
    s = _Squatter()
    yield s
    s.stop()


def test_a_secret_is_a_command_line_value_every_time() -> None:
    """The per-start secret goes to a third-party server as an option's value (`--api-key <secret>`); argparse reads a
    value that starts with `-` as a missing one (a URL-safe token did, once in 64 starts: a flaky start)."""
    parser = argparse.ArgumentParser(exit_on_error=False)
    parser.add_argument("--api_key")
    for _ in range(2000):  # a 1-in-64 fault shows here with probability 1 - (63/64)^2000, all but certain
        secret = new_secret()
        assert parser.parse_args(["--api_key", secret]).api_key == secret and len(secret) >= 43


def test_a_foreign_server_on_a_fixed_port_is_named_in_one_line(tmp_path: Path, squatter: _Squatter) -> None:
    b = backend(tmp_path, "fixed", port=squatter.port)
    try:
        with pytest.raises(ServerLoadError) as ei:
            b.load_policy(0)
    finally:
        b.shutdown()
    message = str(ei.value)
    assert not isinstance(ei.value, ConfigError) and "\n" not in message
    assert message.startswith(f"a foreign server answers on 127.0.0.1:{squatter.port}: GET /rlpipe/policy_step -> 404")
    assert squatter.requests == ["/rlpipe/policy_step"]  # asked who it is; never told to load anything


@pytest.mark.parametrize("kind", ["http", "bound"])
def test_a_picked_port_found_taken_is_retried_on_another(
    tmp_path: Path, squatter: _Squatter, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    import policy.inference.server as server_module

    blocker = socket.socket()  # bound, not listening: the server's bind fails, connections are refused
    blocker.bind(("127.0.0.1", 0))
    taken = squatter.port if kind == "http" else int(blocker.getsockname()[1])
    picks = iter([taken])
    real = server_module.candidate_port
    monkeypatch.setattr(server_module, "candidate_port", lambda host: next(picks, None) or real(host))
    command = f"{{python}} {FAKE} launcher --host {{host}} --port {{port}} --api_key {{api_key}}"
    b = backend(tmp_path, kind, command=command, adapter="vllm")
    try:
        assert b.checks_secret and not b.announced
        b.load_policy(4)
        assert b.process is not None and b.process.starts == 1  # the clash was not a start
        assert b.address != f"127.0.0.1:{taken}" and b.served_policy_step() == 4
        assert "<secret>" in b.process.shown() and b._client.headers["authorization"][7:] not in b.process.shown()
    finally:
        b.shutdown()
        blocker.close()
    if kind == "http":
        assert squatter.requests == ["/v1/models"]
    else:
        assert "Address already in use" in (tmp_path / f"{kind}.server.log").read_text()


def test_vllm_finds_the_secret_in_its_environment_not_on_the_command_line(tmp_path: Path) -> None:
    """vLLM reads its key from `VLLM_API_KEY` when `--api-key` is not given: the worker puts the start's secret there,
    so a command without `{api_key}` still gets the identity check, and no process listing shows the secret."""
    command = f"{{python}} {FAKE} launcher --host {{host}} --port {{port}} --key_env VLLM_API_KEY"
    b = backend(tmp_path, "envkey", command=command, adapter="vllm")
    try:
        assert b.checks_secret and not b.announced
        b.load_policy(2)
        assert b.process is not None and b.process.proc is not None and b.served_policy_step() == 2
        secret = b._client.headers["authorization"][len("Bearer ") :]
        cmdline = Path(f"/proc/{b.process.proc.pid}/cmdline").read_bytes().decode()
        assert secret not in cmdline and secret not in " ".join(b.process.argv)
        wrong = httpx.get(f"{b.root_url}/v1/models", headers={"Authorization": "Bearer wrong"}, timeout=30)
        assert wrong.status_code == 401  # the server checks the secret it found in its environment
    finally:
        b.shutdown()


def test_a_running_server_without_command_is_checked_when_it_has_a_key(
    tmp_path: Path, squatter: _Squatter, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RLPIPE_TEST_SERVER_KEY", "k3y")
    cfg = ServerInferenceConfig(openai_base_url=f"http://127.0.0.1:{squatter.port}/v1", adapter="sglang",
                                api_key_env="RLPIPE_TEST_SERVER_KEY", load_timeout_s=5)  # fmt: skip
    b = ServerBackend(cfg, None)
    b.attach(str(tmp_path))
    try:
        with pytest.raises(ServerLoadError, match=f"^a foreign server answers on 127.0.0.1:{squatter.port}: GET"):
            b.load_policy(1)
        assert b._client.headers["authorization"] == "Bearer k3y"
    finally:
        b.shutdown()


# ---------------------------------------------------------------------------------------------
# the generate endpoint
# ---------------------------------------------------------------------------------------------


class _Tokenizer:
    eos_token_id = 2

    def __len__(self) -> int:
        return 64


class _BlockedSampler:
    """An InferenceContext whose `generate` waits until `release` is set (then one token per completion)."""

    def __init__(self) -> None:
        self.tokenizer = _Tokenizer()
        self.policy_step = 7
        self.release = threading.Event()
        self.calls = 0

    def generate(self, request: Any) -> list[list[Completion]]:
        self.calls += 1
        assert self.release.wait(DEADLINE_S), "never released"
        return [[Completion([5], [-0.5], "length") for _ in range(request.n)] for _ in request.prompts]


def _generate(url: str, **kw: Any) -> httpx.Response:
    body = {"token_ids": [1, 3], "sampling_params": {"max_tokens": 1}}
    return httpx.post(f"{url}/inference/v1/generate", json=body, timeout=DEADLINE_S, **kw)


def test_endpoint_token_is_required_on_every_route() -> None:
    ctx = _BlockedSampler()
    ctx.release.set()
    with GenerateEndpoint(ctx, max_seq_len=16, token="s3cret") as ep:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret"}):
            for path in ("/health", "/v1/models"):
                r = httpx.get(ep.base_url + path, headers=headers, timeout=DEADLINE_S)
                assert r.status_code == 401 and r.json()["error"]["code"] == 401
            assert _generate(ep.base_url, headers=headers).status_code == 401
        assert ctx.calls == 0
        assert httpx.get(ep.base_url + "/health", headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert _generate(ep.base_url, headers={"Authorization": "bearer s3cret"}).status_code == 200


def _idle(ep: GenerateEndpoint) -> socket.socket:
    return socket.create_connection(("127.0.0.1", ep.port), timeout=DEADLINE_S)


def test_silent_connections_neither_block_requests_nor_hold_the_server() -> None:
    ctx = _BlockedSampler()
    ctx.release.set()
    with GenerateEndpoint(ctx, max_seq_len=16, max_connections=4, read_timeout_s=DEADLINE_S) as ep:
        server = ep._server
        assert server is not None
        idle = [_idle(ep) for _ in range(3)]
        wait_for("3 open connections", lambda: server.open_connections == 3)
        assert _generate(ep.base_url).status_code == 200  # a free handler serves it at once
        wait_for("that request's connection closed", lambda: server.open_connections == 3)
        idle.append(_idle(ep))
        wait_for("4 open connections", lambda: server.open_connections == 4)
        busy = _generate(ep.base_url)
        assert busy.status_code == 503 and busy.json()["error"]["type"] == "server_busy"
        for s in idle:
            s.close()
        wait_for("the silent connections closed", lambda: server.open_connections == 0)
        assert _generate(ep.base_url).status_code == 200
    # a connection that never sends anything is closed by the server after read_timeout_s
    with GenerateEndpoint(ctx, max_seq_len=16, read_timeout_s=0.2) as ep:
        s = _idle(ep)
        assert s.recv(1) == b""  # closed by the server, well before the client's own timeout
        s.close()
        assert ep._server is not None
        wait_for("no open connection", lambda: ep._server is not None and ep._server.open_connections == 0)


def test_a_flood_of_twice_max_pending_gets_503_for_the_excess_and_answers_the_rest() -> None:
    cap = 4
    ctx = _BlockedSampler()
    with GenerateEndpoint(ctx, max_seq_len=16, max_pending=cap) as ep:
        results: list[httpx.Response] = []
        lock = threading.Lock()

        def ask() -> None:
            r = _generate(ep.base_url)
            with lock:
                results.append(r)

        threads = [threading.Thread(target=ask) for _ in range(2 * cap)]
        for t in threads:
            t.start()
        wait_for(f"{cap} requests refused", lambda: len(results) == cap)  # while the sampler is blocked
        assert [r.status_code for r in results] == [503] * cap and ep.pending == cap
        assert all("requests already wait for the sampler" in r.json()["error"]["message"] for r in results)
        ctx.release.set()
        for t in threads:
            t.join(DEADLINE_S)
        assert sorted(r.status_code for r in results) == [200] * cap + [503] * cap
        assert ep.pending == 0 and ep.requests_served == cap


# ---------------------------------------------------------------------------------------------
# the protocol's parts
# ---------------------------------------------------------------------------------------------


def test_a_reserved_port_cannot_be_bound_by_anyone_else() -> None:
    with reserve_port() as reserved:
        for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET, "0.0.0.0")):
            with socket.socket(family) as other, pytest.raises(OSError):
                other.bind((host, reserved.port))
        # a server that sets SO_REUSEPORT (gRPC: jax.distributed's coordinator) binds and listens on it
        with socket.socket(reserved.family) as grpc_like:
            if reserved.family == socket.AF_INET6:
                grpc_like.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            grpc_like.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            grpc_like.bind(("::" if reserved.family == socket.AF_INET6 else "0.0.0.0", reserved.port))
            grpc_like.listen(1)
            client = socket.create_connection(("127.0.0.1", reserved.port), timeout=DEADLINE_S)
            conn, _ = grpc_like.accept()
            client.close()  # the client closes first: no TIME_WAIT left on the reserved port
            assert conn.recv(1) == b""
            conn.close()
        # so can an HTTP server asked to (`steps.serve --reuse_port true`: on a port its starter reserved)
        http = BoundedHTTPServer(("127.0.0.1", reserved.port), BoundedHandler, reuse_port=True)
        threading.Thread(target=http.serve_forever, args=(0.05,), daemon=True).start()
        try:
            assert httpx.get(f"http://{reserved.address}/", timeout=DEADLINE_S).status_code == 501  # no do_GET
        finally:
            http.shutdown()
            http.server_close()
    assert not reserved.held


def test_bearer_check_and_announcement(tmp_path: Path) -> None:
    assert bearer_ok("Bearer abc", "abc") and bearer_ok("bearer  abc ", "abc") and bearer_ok(None, None)
    assert not bearer_ok("Bearer abd", "abc") and not bearer_ok("abc", "abc") and not bearer_ok(None, "abc")
    assert not bearer_ok("Bearer", "abc") and not bearer_ok("Bearer ü", "abc")
    env = {"RLPIPE_SERVER_TOKEN": "t0k", "RLPIPE_SERVER_ANNOUNCE": str(tmp_path / "a.json")}
    identity = ServerIdentity.from_env(env)
    assert identity == ServerIdentity("t0k", str(tmp_path / "a.json")) and "RLPIPE_SERVER_TOKEN" not in env
    assert identity.check({"authorization": "Bearer t0k"}) and not identity.check({})
    assert read_announcement(str(tmp_path / "a.json")) is None
    with bind_listener("127.0.0.1", 0) as sock:
        announced = identity.announce(sock)
        assert announced is not None and read_announcement(str(tmp_path / "a.json")) == announced
        assert announced.address == f"127.0.0.1:{sock.getsockname()[1]}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json"]  # no temporary file left
