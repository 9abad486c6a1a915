"""The generate endpoint's HTTP server: `EndpointServer` (a `pipeline.process.listener.BoundedHTTPServer`: at most
`max_connections` connections at once, each in its own thread, one more answered 503 and closed; a connection
silent for `read_timeout_s` closed) whose `EndpointHandler` reads each request's body (at most `MAX_BODY_BYTES`,
413 above) and writes the JSON answer of `answer(method, path, headers, body)`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from typing import Any

from pipeline.environments.endpoint.errors import EndpointError, error_body
from pipeline.process.listener import BoundedHandler, BoundedHTTPServer

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 32 << 20
"""Largest request body accepted (413 above)."""

AnswerFn = Callable[[str, str, Mapping[str, str], bytes], tuple[int, dict[str, Any]]]
"""(method, path, headers with lower-case names, body) -> (status, JSON body); never raises."""


class EndpointServer(BoundedHTTPServer):
    """The bounded HTTP server; `answer` is set before it serves."""

    answer: AnswerFn


class EndpointHandler(BoundedHandler):
    """One connection's requests: GET and POST, answered by the server's `answer`."""

    server: EndpointServer

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("endpoint %s - %s", self.address_string(), format % args)

    def _answer(self, method: str) -> None:
        length = self.headers.get("Content-Length")
        body = b""
        if length is not None:
            try:
                size = int(length)
            except ValueError:
                size = -1
            if size < 0 or size > MAX_BODY_BYTES:
                self._send(413 if size > 0 else 400, error_body(EndpointError(413, "bad or too large body")))
                return
            body = self.rfile.read(size)
        headers = {k.lower(): v for k, v in self.headers.items()}
        status, answer = self.server.answer(method, self.path, headers, body)
        self._send(status, answer)

    def _send(self, status: int, answer: dict[str, Any]) -> None:
        data = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if status == 401:
            self.send_header("WWW-Authenticate", "Bearer")
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._answer("GET")

    def do_POST(self) -> None:
        self._answer("POST")


def endpoint_server(
    address: tuple[str, int], answer: AnswerFn, *, max_connections: int, read_timeout_s: float, reuse_port: bool
) -> EndpointServer:
    """A bound `EndpointServer` answering with `answer` (not yet serving: call `serve_forever` in a thread)."""
    server = EndpointServer(
        address, EndpointHandler, max_connections=max_connections, read_timeout_s=read_timeout_s, reuse_port=reuse_port
    )
    server.answer = answer
    return server
