"""The protocol of a server adapter: load policy S from the run root, report the step served."""

from __future__ import annotations

import abc
import re
from typing import Any

import httpx

_STEP_IN_PATH = re.compile(r"step-(\d+)(?:/hf)?/?$")


class ServerLoadError(RuntimeError):
    """The server refused or failed to load a policy; the message names the URL, status and body."""


def step_from_path(path: str | None) -> int | None:
    """The policy step of a `.../policies/step-S` or `.../policies/step-S/hf` folder path, or None."""
    if not path:
        return None
    m = _STEP_IN_PATH.search(str(path).rstrip("/"))
    return int(m.group(1)) if m else None


class ServerAdapter(abc.ABC):
    """Tells one server to load a committed policy and says which policy it serves.

    `needs_hf = True`: the server loads Hugging Face folders (`policies/step-S/hf/`), which must exist first.
    `announces = True`: the server, started with port 0, binds a port itself and announces it
    (`pipeline.process.ports`); otherwise the worker must give it a port number. `identity_route`: a GET route
    that answers 200 to the start's secret and 401 to any other (the worker's identity check). `secret_env`: an
    environment variable the server reads its API key from; a started server finds the start's secret there, so the
    command need not show it (`{api_key}` on a command line is visible to every user of the host).
    """

    name = "abstract"
    needs_hf = False
    announces = False
    identity_route = "/v1/models"
    secret_env: str | None = None

    def __init__(self, root_url: str, client: httpx.Client) -> None:
        self.root_url = root_url.rstrip("/")
        self.client = client

    @abc.abstractmethod
    def load(self, step: int, policy_dir: str, hf_dir: str, timeout_s: float) -> None:
        """Ask the server to serve policy `step` (raw policy folder `policy_dir`, HF folder `hf_dir`).

        Returns once the server accepted the request; raises ServerLoadError if it refused.
        """

    @abc.abstractmethod
    def served_step(self) -> int | None:
        """The policy step the server reports serving now (None: not known yet)."""

    def healthy(self) -> bool:
        """True when the server answers its health check."""
        try:
            return self.client.get(f"{self.root_url}/health", timeout=5.0).status_code == 200
        except httpx.HTTPError:
            return False

    def _get_info(self, path: str) -> dict[str, Any]:
        """The JSON object `GET <path>` answers; {} when the server cannot be reached or does not answer 200 (a
        step report is then "not known yet")."""
        try:
            r = self.client.get(f"{self.root_url}{path}", timeout=30.0)
        except httpx.HTTPError:
            return {}
        return dict(r.json()) if r.status_code == 200 else {}

    def _post(self, path: str, body: dict[str, Any], timeout_s: float) -> Any:
        url = f"{self.root_url}{path}"
        try:
            r = self.client.post(url, json=body, timeout=timeout_s)
        except httpx.HTTPError as e:
            raise ServerLoadError(f"POST {url} failed: {type(e).__name__}: {e}") from e
        if r.status_code != 200:
            raise ServerLoadError(f"POST {url} -> {r.status_code}: {r.text[:500]}")
        return r.json() if r.content else None
