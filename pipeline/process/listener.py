"""A threading HTTP server that no client can exhaust: bounded handler threads, read timeouts, 503 beyond the bound.

`http.server.ThreadingHTTPServer` starts one thread per connection, without limit, and a connection that sends
nothing holds its thread forever. `BoundedHTTPServer` (with handlers derived from `BoundedHandler`) instead:

- serves at most `max_connections` connections at once, each in its own thread; a connection beyond that is
  answered `503` (`{"error": {..., "code": 503}}`, `Connection: close`) by one of `OVERFLOW_THREADS` spare
  threads, and closed at once when those are busy too;
- reads with a timeout (`read_timeout_s`; the spare threads: `OVERFLOW_READ_TIMEOUT_S`): a connection that sends
  nothing (or stops sending) within it is closed, and an idle keep-alive connection is closed after it too;
- `BoundedHTTPServer.from_socket(sock, handler)` serves a socket the caller bound (`pipeline.process.ports.
  bind_listener`: a server that binds its own port and announces it);
- SO_REUSEPORT is never set unless asked (`reuse_port=True`: to serve on a port that the program which started
  this one holds with `pipeline.process.ports.reserve_port`); two servers can then never share a port by chance.

Only the standard library is imported here.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

logger = logging.getLogger(__name__)

OVERFLOW_THREADS = 4
"""Spare threads that answer 503 to connections beyond `max_connections`."""
OVERFLOW_READ_TIMEOUT_S = 2.0
"""How long a spare thread waits for the request it refuses."""
OVERFLOW_DRAIN_BYTES = 1 << 20
"""The most request-body bytes a spare thread reads (so that the client gets its 503, not a reset) before closing."""


class BoundedHTTPServer(ThreadingHTTPServer):
    """See the module docstring. `max_connections`: connections served at once; `read_timeout_s`: socket timeout
    of a connection's reads and writes."""

    daemon_threads = True
    request_queue_size = 256  # a burst of concurrent connections must not overflow the listen backlog
    allow_reuse_port = False

    def __init__(
        self,
        server_address: tuple[Any, ...],
        handler: type[BaseHTTPRequestHandler],
        *,
        max_connections: int = 64,
        read_timeout_s: float = 60.0,
        reuse_port: bool = False,
        bind_and_activate: bool = True,
    ) -> None:
        if max_connections < 1:
            raise ValueError(f"max_connections={max_connections}: must be >= 1")
        if read_timeout_s <= 0:
            raise ValueError(f"read_timeout_s={read_timeout_s}: must be > 0")
        self.max_connections = int(max_connections)
        self.read_timeout_s = float(read_timeout_s)
        self.allow_reuse_port = reuse_port
        self._slots = threading.BoundedSemaphore(self.max_connections)
        self._spares = threading.BoundedSemaphore(OVERFLOW_THREADS)
        self._local = threading.local()
        self._count_lock = threading.Lock()
        self.open_connections = 0
        """Connections served now (not counting those being refused)."""
        self.refused_connections = 0
        """Connections answered 503 (or closed) because `max_connections` were open."""
        super().__init__(server_address, handler, bind_and_activate)

    @classmethod
    def from_socket(
        cls, sock: socket.socket, handler: type[BaseHTTPRequestHandler], **kwargs: Any
    ) -> BoundedHTTPServer:
        """A server on `sock`, a socket already bound and listening (the server owns it from now on)."""
        server = cls(sock.getsockname(), handler, bind_and_activate=False, **kwargs)
        server.socket.close()
        server.socket = sock
        server.address_family = sock.family
        server.server_address = sock.getsockname()
        return server

    def server_bind(self) -> None:
        """Bind as `socketserver.TCPServer` does (http.server's version resolves the host name, which may be slow)."""
        import socketserver

        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name = str(host)
        self.server_port = int(port)

    def overflowing(self) -> bool:
        """True in a spare thread: the connection it serves is to be refused with 503."""
        return bool(getattr(self._local, "overflow", False))

    def process_request(self, request: Any, client_address: Any) -> None:  # type: ignore[override]
        """Serve the connection in a thread of its own when fewer than `max_connections` are open; else refuse it
        (a spare thread answers 503; none free: closed at once)."""
        if self._slots.acquire(blocking=False):
            slots, target = self._slots, self._serve
            with self._count_lock:
                self.open_connections += 1
        elif self._spares.acquire(blocking=False):
            slots, target = self._spares, self._refuse
            with self._count_lock:
                self.refused_connections += 1
        else:
            with self._count_lock:
                self.refused_connections += 1
            self.shutdown_request(request)
            return
        try:
            threading.Thread(target=target, args=(request, client_address), daemon=True).start()
        except BaseException:  # no thread: give the slot back (the caller closes the connection)
            if slots is self._slots:
                with self._count_lock:
                    self.open_connections -= 1
            slots.release()
            raise

    def _serve(self, request: Any, client_address: Any) -> None:
        try:
            request.settimeout(self.read_timeout_s)
            self.finish_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)
            with self._count_lock:
                self.open_connections -= 1
            self._slots.release()

    def _refuse(self, request: Any, client_address: Any) -> None:
        self._local.overflow = True
        try:
            request.settimeout(OVERFLOW_READ_TIMEOUT_S)
            self.finish_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self._local.overflow = False
            self.shutdown_request(request)
            self._spares.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A connection that failed (reset, timed out) is logged at debug level, not printed."""
        logger.debug("connection from %s failed", client_address, exc_info=True)


class BoundedHandler(BaseHTTPRequestHandler):
    """A request handler for `BoundedHTTPServer` (which sets its connection's timeout); in a spare thread it
    answers every request 503 (`busy_body`) and closes the connection."""

    protocol_version = "HTTP/1.1"
    server: BoundedHTTPServer

    def busy_body(self) -> dict[str, Any]:
        """The JSON body of the 503 a refused connection gets."""
        n = self.server.max_connections
        return {
            "error": {
                "message": f"the server is busy: {n} connections are open; retry later",
                "type": "server_busy",
                "param": None,
                "code": 503,
            }
        }

    def parse_request(self) -> bool:
        if not super().parse_request():
            return False
        if not self.server.overflowing():
            return True
        size = self.headers.get("Content-Length")
        try:
            n = int(size) if size is not None else 0
        except ValueError:
            n = -1
        if 0 < n <= OVERFLOW_DRAIN_BYTES:
            try:
                self.rfile.read(n)
            except OSError:
                pass
        self.close_connection = True
        data = json.dumps(self.busy_body()).encode()
        self.send_response(503)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Retry-After", "1")
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)
        return False

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("%s - %s", self.address_string(), format % args)
