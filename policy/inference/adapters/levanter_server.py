"""levanter's `InferenceServer` in the loop: a launcher program that serves committed policies of a run root, and
its adapter.

levanter's `InferenceServer` (levanter.inference.openai) serves `/v1/completions`, `/v1/chat/completions` and
`/health`, and swaps weights in process through `InferenceServer.reload(weight_source)` (it waits for the model
lock, so requests in flight finish on the old weights). It has no HTTP route for that, so this launcher adds
three, all reading `policies/step-S` of the run root through `policy.policy_format.read_policy` (sizes and sha256
checked against the commit marker):

    POST /rlpipe/load_policy {"step": S}   reload(weight source = committed policy S); answers {"step": S}
    GET  /rlpipe/policy_step               {"step": S}: the policy served now
    GET  /v1/models                        [{"id": "policy@step-<S:08d>"}]
and an `X-Policy-Step: S` header on every response, so each completion names the policy that produced it.

Run (what `inference.command` starts; placeholders are filled by the worker):
    python -m policy.inference.adapters.levanter_server --run_root {run_root} --host {host} --port {port} \
        --model_json '{model_json}' [--step {step}] [--max_seqs 16] [--page_size 16]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import threading
from typing import Any

import httpx

from policy.inference.adapters.base import ServerAdapter, ServerLoadError

logger = logging.getLogger(__name__)

LOAD_ROUTE = "/rlpipe/load_policy"
STEP_ROUTE = "/rlpipe/policy_step"


class LevanterServerAdapter(ServerAdapter):
    """Talks to the launcher of this module: `POST /rlpipe/load_policy`, `GET /rlpipe/policy_step`."""

    name = "levanter"
    needs_hf = False

    def load(self, step: int, policy_dir: str, hf_dir: str, timeout_s: float) -> None:
        """Ask the launcher to reload from committed policy `step`; returns when it serves it."""
        out = self._post(LOAD_ROUTE, {"step": int(step)}, timeout_s)
        if not isinstance(out, dict) or out.get("step") != step:
            raise ServerLoadError(f"{self.root_url}{LOAD_ROUTE} answered {out} for step {step}")

    def served_step(self) -> int | None:
        """The step `GET /rlpipe/policy_step` reports."""
        try:
            r = self.client.get(f"{self.root_url}{STEP_ROUTE}", timeout=30.0)
        except httpx.HTTPError:
            return None
        if r.status_code != 200:
            return None
        step = r.json().get("step")
        return None if step is None else int(step)


def _engine_config(spec: Any, max_seqs: int, page_size: int) -> Any:
    import jax.numpy as jnp
    from levanter.inference.engine import InferenceEngineConfig

    dtype = jnp.float32 if spec.compute_dtype in ("float32", "fp32") else jnp.dtype(spec.compute_dtype)
    return InferenceEngineConfig(
        max_seq_len=spec.max_seq_len,
        page_size=page_size,
        max_pages=max_seqs * (spec.max_seq_len // page_size + 1) + 8,
        max_seqs=max_seqs,
        compute_dtype=dtype,
        enable_logprobs=True,
        max_prefill_size=max_seqs * spec.max_seq_len,
        max_seqs_in_prefill=max_seqs,
    )


def serve(run_root: str, spec: Any, host: str, port: int, step: int | None, max_seqs: int, page_size: int) -> None:
    """Serve policy `step` (None: the newest committed) of `run_root` until killed; reload on request."""
    from fastapi import HTTPException
    from levanter.inference.openai import InferenceServer, InferenceServerConfig

    from pipeline.environments.tokenizer import load_tokenizer
    from pipeline.store.poll import poll_until
    from pipeline.store.run_state import latest_policy_step
    from pipeline.store.storage import RunStore
    from policy.policy_format import policy_metadata, read_policy

    store = RunStore(run_root)
    tokenizer = load_tokenizer(spec.tokenizer)
    if step is None:
        step, _ = poll_until(lambda: latest_policy_step(store), timeout_s=3600.0, what=f"a policy in {run_root}")
    assert step is not None  # poll_until returns only a found value
    vocab = policy_metadata(store, step).vocab_size
    state = {"step": int(step)}
    lock = threading.Lock()
    config = InferenceServerConfig(service=_engine_config(spec, max_seqs, page_size), host=host, port=port)
    srv = InferenceServer.create(config, read_policy(store, step, spec, vocab), tokenizer)

    @srv.app.middleware("http")
    async def policy_step_header(request: Any, call_next: Any) -> Any:
        response = await call_next(request)
        response.headers["X-Policy-Step"] = str(state["step"])
        return response

    @srv.app.post(LOAD_ROUTE)
    def load_route(body: dict[str, Any]) -> dict[str, Any]:  # sync: FastAPI runs it in a worker thread
        new = int(body["step"])
        with lock:
            if new != state["step"]:
                try:
                    model = read_policy(store, new, spec, policy_metadata(store, new).vocab_size)
                except Exception as e:  # a missing or corrupt policy: refuse, keep serving the old one
                    raise HTTPException(status_code=409, detail=f"policy {new}: {e}") from e
                srv.reload(lambda _old: model)
                state["step"] = new
                logger.info("serving policy %d", new)
        return {"step": state["step"]}

    @srv.app.get(STEP_ROUTE)
    def step_route() -> dict[str, Any]:
        return {"step": state["step"]}

    @srv.app.get("/v1/models")
    def models_route() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": f"policy@step-{state['step']:08d}", "object": "model"}]}

    logger.info("levanter server: policy %d of %s on %s:%d", step, run_root, host, port)
    srv.serve()


def main(argv: list[str] | None = None) -> int:
    """`python -m policy.inference.adapters.levanter_server ...` (see the module docstring)."""
    from pipeline.config import ModelSpec

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run_root", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model_json", default="{}", help="ModelSpec fields as JSON")
    p.add_argument("--step", type=int, default=None)
    p.add_argument("--max_seqs", type=int, default=16)
    p.add_argument("--page_size", type=int, default=16)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spec = ModelSpec(**json.loads(a.model_json))
    serve(a.run_root, spec, a.host, a.port, a.step, a.max_seqs, a.page_size)
    return 0


if __name__ == "__main__":
    # The server never uses PyTorch, but transformers (which levanter imports) loads it eagerly whenever it is
    # installed: about 4 s of CPU at every server start. USE_TORCH=1 keeps it.
    os.environ.setdefault("USE_TORCH", "0")
    raise SystemExit(main())
