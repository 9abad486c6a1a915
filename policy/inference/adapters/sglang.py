"""SGLang: `POST /update_weights_from_disk` with the policy's Hugging Face folder; the step from `/get_model_info`.

Pinned: SGLang 0.4.6 (`python -m sglang.launch_server`). Native API reference:
https://docs.sglang.ai/backend/native_api.html (and `python/sglang/srt/entrypoints/http_server.py`).

- `POST /update_weights_from_disk` body `{"model_path": "<run root>/policies/step-S/hf"}` answers
  `{"success": bool, "message": str, ...}`; it returns after the weights are loaded (requests in flight are
  finished first by SGLang's scheduler).
- `GET /get_model_info` answers `{"model_path": str, "tokenizer_path": str, "is_generation": bool}`: the served
  step is read from `model_path` (`.../step-S/hf`).
- `GET /health` answers 200 when the server is up.
"""

from __future__ import annotations

from policy.inference.adapters.base import ServerAdapter, ServerLoadError, step_from_path


class SGLangAdapter(ServerAdapter):
    """Loads `policies/step-S/hf` through `/update_weights_from_disk`."""

    name = "sglang"
    needs_hf = True

    def load(self, step: int, policy_dir: str, hf_dir: str, timeout_s: float) -> None:
        """Ask SGLang to load the HF folder of `step`; ServerLoadError when it answers `success: false`."""
        out = self._post("/update_weights_from_disk", {"model_path": hf_dir}, timeout_s)
        if not isinstance(out, dict) or not out.get("success"):
            raise ServerLoadError(f"{self.root_url}/update_weights_from_disk refused {hf_dir}: {out}")

    def served_step(self) -> int | None:
        """The step in the `model_path` SGLang reports."""
        return step_from_path(self._get_info("/get_model_info").get("model_path"))
