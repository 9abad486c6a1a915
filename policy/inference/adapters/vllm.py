"""vLLM: full-weight reload from the policy's Hugging Face folder through the dev-mode `/collective_rpc` endpoint.

Pinned: vLLM 0.10.1.1, started with `VLLM_SERVER_DEV_MODE=1 vllm serve <run root>/policies/step-00000000/hf
--served-model-name policy` (dev mode exposes `/collective_rpc`, `/reset_prefix_cache`). References:
https://docs.vllm.ai/en/v0.10.1.1/serving/openai_compatible_server.html and
https://docs.vllm.ai/en/v0.10.1.1/api/vllm/entrypoints/openai/api_server.html (`collective_rpc` route).

Loading step S is three calls, each answered 200 only after every worker finished it:
1. `POST /collective_rpc {"method": "update_config", "args": [{"model_config": {"model": "<hf dir>"}}]}`
   points the workers' model config at the new folder;
2. `POST /collective_rpc {"method": "reload_weights"}` reloads the weights in place from that folder;
3. `POST /reset_prefix_cache` drops KV cache entries computed with the old weights.
`/collective_rpc` answers `{"results": [...]}` (one entry per worker). vLLM does not report the folder it serves
through the OpenAI API, so the served step is the step of the last reload that completed (set only after all
three calls succeeded); a restarted server reports none until it is told to load again.
"""

from __future__ import annotations

from policy.inference.adapters.base import ServerAdapter


class VLLMAdapter(ServerAdapter):
    """Reloads weights from `policies/step-S/hf` through `/collective_rpc`."""

    name = "vllm"
    needs_hf = True
    secret_env = "VLLM_API_KEY"  # `vllm serve` takes `--api-key` or, without it, this variable

    def __init__(self, root_url: str, client: object) -> None:
        super().__init__(root_url, client)  # type: ignore[arg-type]
        self._step: int | None = None

    def load(self, step: int, policy_dir: str, hf_dir: str, timeout_s: float) -> None:
        """Point vLLM's workers at `hf_dir`, reload the weights and reset the prefix cache."""
        self._step = None
        rpc = "/collective_rpc"
        self._post(rpc, {"method": "update_config", "args": [{"model_config": {"model": hf_dir}}]}, timeout_s)
        self._post(rpc, {"method": "reload_weights", "args": [], "kwargs": {}}, timeout_s)
        self._post("/reset_prefix_cache", {}, timeout_s)
        self._step = step

    def served_step(self) -> int | None:
        """The step of the last completed reload (vLLM does not report its weights' folder)."""
        return self._step

    def forget(self) -> None:
        """The server restarted: nothing is known about its weights until the next load."""
        self._step = None
