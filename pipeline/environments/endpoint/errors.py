"""The generate endpoint's refusals: `EndpointError` (the HTTP status, the request field at fault, a message) and
the JSON body a client gets for one (`{"error": {"message", "type", "param", "code"}}`, OpenAI's shape)."""

from __future__ import annotations

from typing import Any


class EndpointError(Exception):
    """A request the endpoint refuses: HTTP `status`, the request field at fault (`param`) and a message."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param
        self.message = message


def bad(param: str, why: str) -> EndpointError:
    """A 400 naming `param`; its message starts with the field, so a client sees which one is wrong."""
    return EndpointError(400, f"{param}: {why}", param)


def error_body(e: EndpointError) -> dict[str, Any]:
    """The JSON body answering `e`, typed as OpenAI names its errors."""
    kind = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error"}.get(e.status, "error")
    return {"error": {"message": e.message, "type": kind, "param": e.param, "code": e.status}}
