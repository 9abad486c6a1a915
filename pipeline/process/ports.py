"""Ports and addresses of the servers rlpipe starts, with no port handed from one process to another.

A port found free by binding port 0 and closing the socket is free only until somebody binds it: a child given
that number may lose it to any program (another worker's server, a generate endpoint, anything), and its parent
then talks to that program. So rlpipe never does that:

- A server rlpipe starts binds its own port (`bind_listener(host, 0)`) and announces the address it got: its parent
  names a file in `RLPIPE_SERVER_ANNOUNCE` (`ANNOUNCE_ENV`), the server writes `{"host", "port", "pid"}` there
  atomically once it accepts connections (`announce`: a temporary file, then `os.replace`), and the parent, which
  waits for that file while checking that the child is alive (`read_announcement`), talks to that address only.
- Every request to it carries a per-start secret (`new_secret`) that the parent passes in `RLPIPE_SERVER_TOKEN`
  (`TOKEN_ENV`): `Authorization: Bearer <secret>`. The server refuses every other request with 401, on every route
  (`bearer_ok`, compared with `hmac.compare_digest`). Before its first request the parent checks identity: the
  right secret must be accepted and a wrong one refused with 401, so a foreign server on that address is named in
  one line instead of being used.
- A port that a program must be given before it starts (jax.distributed's coordinator: gRPC binds the number it
  is told) is reserved with `reserve_port()`: a socket bound with SO_REUSEPORT on every address (not listening),
  held by the parent for as long as the program needs the port. Nobody else's bind, of that port or of port 0,
  can take it meanwhile, while gRPC, which sets SO_REUSEPORT itself, can still bind and listen on it.
- A third-party server that takes only a port number (vLLM, SGLang) gets a `candidate_port()`: a number nobody had
  bound a moment ago, NOT reserved. Whoever uses one must detect a clash (the server exits with "address already
  in use", or a foreign server answers the identity check) and start again on another.

`ServerIdentity.from_env()` is a child server's side of the protocol (its secret and where to announce). Only the
standard library is imported here: a server program of any weight (the test doubles included) can use it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hmac
import ipaddress
import json
import os
import secrets
import socket
from collections.abc import Mapping, MutableMapping
from typing import Any

ANNOUNCE_ENV = "RLPIPE_SERVER_ANNOUNCE"
"""Environment variable of a child server: the file to announce its bound `host:port` in."""
TOKEN_ENV = "RLPIPE_SERVER_TOKEN"
"""Environment variable of a child server: the secret every request must carry (`Authorization: Bearer ...`)."""
ADDRESS_IN_USE = ("address already in use", "errno 98", "eaddrinuse", "only one usage of each socket address")
"""What a server's log says (lowercased) when it could not bind its port."""


def new_secret() -> str:
    """A fresh random secret for one start of a server (256 bits, 64 hex digits): safe in a URL, a header and as
    a command-line option's value (a URL-safe token starts with `-` once in 64 draws, which argparse-based servers
    such as vLLM's and the test launcher read as a missing `--api_key` value)."""
    return secrets.token_hex(32)


def bearer_ok(authorization: str | None, token: str | None) -> bool:
    """True when the `Authorization` header value carries `token` as a bearer token (always, when `token` is None).
    Compared in constant time (`hmac.compare_digest`)."""
    if token is None:
        return True
    scheme, _, value = (authorization or "").strip().partition(" ")
    if scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(value.strip().encode(), token.encode())


def is_loopback(host: str) -> bool:
    """True for `localhost` and loopback addresses (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def bind_listener(host: str, port: int = 0, backlog: int = 256) -> socket.socket:
    """A TCP socket bound to `host:port` (port 0: one the kernel picks) and listening: bound by the server that
    uses it, so no other program can hold its port. SO_REUSEADDR is set (a restart on a fixed port is not held up
    by connections of the last one in TIME_WAIT; a port another socket listens on is still refused)."""
    family = _family(host)
    if host not in ("", "0.0.0.0", "::") and family == socket.AF_INET:
        try:  # a name such as localhost
            host = str(socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM)[0][4][0])
        except socket.gaierror:
            pass
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock


def connect_host(host: str) -> str:
    """The host a local client connects to for a server bound to `host` (a wildcard address: loopback)."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "::1"
    return host


def url_host(host: str) -> str:
    """`host` as it is written in a URL (an IPv6 address in brackets)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


@dataclasses.dataclass(frozen=True)
class Announcement:
    """What a server announced: the address it is bound to and its process id."""

    host: str
    port: int
    pid: int

    @property
    def address(self) -> str:
        """`host:port` (an IPv6 host in brackets)."""
        return f"{url_host(self.host)}:{self.port}"


def announce(path: str, sock: socket.socket) -> Announcement:
    """Write the address `sock` is bound to (and this process's id) to `path`, atomically: a reader sees the
    whole announcement or none."""
    host, port = sock.getsockname()[:2]
    out = Announcement(str(host), int(port), os.getpid())
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(dataclasses.asdict(out), f)
    os.replace(tmp, path)
    return out


def read_announcement(path: str) -> Announcement | None:
    """The announcement written to `path`, or None while there is none."""
    try:
        with open(path, encoding="utf-8") as f:
            data: dict[str, Any] = json.load(f)
    except FileNotFoundError:
        return None
    return Announcement(str(data["host"]), int(data["port"]), int(data["pid"]))


@dataclasses.dataclass(frozen=True)
class ServerIdentity:
    """A child server's side of the protocol: the secret every request must carry (None: none required) and the
    file to announce its address in (None: do not announce)."""

    token: str | None
    announce_file: str | None

    @classmethod
    def from_env(cls, environ: MutableMapping[str, str] | None = None, *, keep: bool = False) -> ServerIdentity:
        """Read `RLPIPE_SERVER_TOKEN` and `RLPIPE_SERVER_ANNOUNCE`; the token is removed from the environment
        (`keep=False`) so that programs this server may start do not inherit it."""
        env: MutableMapping[str, str] = os.environ if environ is None else environ
        token = env.get(TOKEN_ENV) or None
        if token is not None and not keep:
            env.pop(TOKEN_ENV, None)
        return cls(token, env.get(ANNOUNCE_ENV) or None)

    def check(self, headers: Mapping[str, str]) -> bool:
        """True when a request with these headers (any case of `Authorization`) carries the secret."""
        value = next((v for k, v in headers.items() if k.lower() == "authorization"), None)
        return bearer_ok(value, self.token)

    def announce(self, sock: socket.socket) -> Announcement | None:
        """Announce `sock`'s address in the announce file (nothing without one)."""
        return None if self.announce_file is None else announce(self.announce_file, sock)


class ReservedPort:
    """A TCP port held for a program that must be given its number before it starts (see the module docstring):
    `port`, `address` (`127.0.0.1:<port>`, what a local process connects to); `close()` (or leaving the `with`
    block) releases it."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock: socket.socket | None = sock
        self.family = sock.family
        """AF_INET6 (dual-stack: every IPv6 and IPv4 address) or AF_INET (every IPv4 address)."""
        self.port = int(sock.getsockname()[1])
        self.address = f"127.0.0.1:{self.port}"

    @property
    def held(self) -> bool:
        """True until `close()`."""
        return self._sock is not None

    def close(self) -> None:
        """Release the port (idempotent)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> ReservedPort:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


def reserve_port() -> ReservedPort:
    """Reserve a free TCP port on every local address (IPv6 and IPv4 where the host has both): a socket bound with
    SO_REUSEPORT, not listening, held until released. A plain bind of that port, or a bind of port 0, by any other
    program fails or gets another port meanwhile; a server of the same user that sets SO_REUSEPORT (gRPC, and so
    jax.distributed's coordinator) binds and listens on it, and connections reach that server only."""
    reuse_port = getattr(socket, "SO_REUSEPORT", None)
    attempts: list[tuple[socket.AddressFamily, str]] = [(socket.AF_INET6, "::"), (socket.AF_INET, "0.0.0.0")]
    last: OSError | None = None
    for family, host in attempts:
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError as e:  # no IPv6 on this host
            last = e
            continue
        try:
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # IPv4 too
            if reuse_port is not None:
                sock.setsockopt(socket.SOL_SOCKET, reuse_port, 1)
            sock.bind((host, 0))
        except OSError as e:
            sock.close()
            last = e
            continue
        return ReservedPort(sock)
    raise OSError(f"could not reserve a port: {last}")


def candidate_port(host: str = "127.0.0.1") -> int:
    """A port nobody had bound on `host` a moment ago: NOT reserved (see the module docstring). Only for a server
    that must be given a number; whoever uses it detects a clash and tries another."""
    with socket.socket(_family(host), socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def address_in_use(text: str) -> bool:
    """True when a server's output says it could not bind its port."""
    low = text.lower()
    return any(marker in low for marker in ADDRESS_IN_USE)
