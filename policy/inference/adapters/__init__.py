"""How each kind of server is told to load policy S, and asked which policy it serves (one module per server).

`make_adapter(name, root_url, client)` returns the `ServerAdapter` of `levanter` (rlpipe's launcher around
levanter's `InferenceServer`), `sglang` or `vllm`; `policy.inference.server.ServerBackend` drives it.
"""

from __future__ import annotations

from typing import Any

from policy.inference.adapters.base import ServerAdapter, ServerLoadError


def make_adapter(name: str, root_url: str, client: Any) -> ServerAdapter:
    """The adapter for server kind `name` talking to `root_url` (no `/v1`) through the httpx `client`."""
    if name == "levanter":
        from policy.inference.adapters.levanter_server import LevanterServerAdapter

        return LevanterServerAdapter(root_url, client)
    if name == "sglang":
        from policy.inference.adapters.sglang import SGLangAdapter

        return SGLangAdapter(root_url, client)
    if name == "vllm":
        from policy.inference.adapters.vllm import VLLMAdapter

        return VLLMAdapter(root_url, client)
    raise ValueError(f"inference.adapter={name!r}: one of levanter, sglang, vllm")


__all__ = ["ServerAdapter", "ServerLoadError", "make_adapter"]
