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

Address and identity (`pipeline.process.ports`): the launcher binds its port itself (`--port 0`: one the kernel
picks) and, once it accepts connections, writes the bound `host:port` atomically to the file named by
`--announce_file` or `RLPIPE_SERVER_ANNOUNCE` (the worker waits for it and talks to that address only). With
`RLPIPE_SERVER_TOKEN` set (the worker sets a fresh secret at every start), every request, on every route
(`/health` included), must carry `Authorization: Bearer <secret>`; any other gets 401 (compared in constant time).
A non-loopback `--host` needs that secret. At most `--max_connections` connections are served at once (503 beyond
them); a connection silent for `--read_timeout_s` (one that never sends a request included) is closed.

Run (what `inference.command` starts; placeholders are filled by the worker):
    python -m policy.inference.adapters.levanter_server --run_root {run_root} --host {host} --port {port} \
        --model_json '{model_json}' [--step {step}] [--max_seqs 16] [--page_size 16]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import threading
from typing import Any

from pipeline.process.ports import ServerIdentity, bind_listener, is_loopback
from policy.inference.adapters.base import ServerAdapter, ServerLoadError

logger = logging.getLogger(__name__)

LOAD_ROUTE = "/rlpipe/load_policy"
STEP_ROUTE = "/rlpipe/policy_step"


class LevanterServerAdapter(ServerAdapter):
    """Talks to the launcher of this module: `POST /rlpipe/load_policy`, `GET /rlpipe/policy_step`."""

    name = "levanter"
    needs_hf = False
    announces = True
    identity_route = STEP_ROUTE

    def load(self, step: int, policy_dir: str, hf_dir: str, timeout_s: float) -> None:
        """Ask the launcher to reload from committed policy `step`; returns when it serves it."""
        out = self._post(LOAD_ROUTE, {"step": int(step)}, timeout_s)
        if not isinstance(out, dict) or out.get("step") != step:
            raise ServerLoadError(f"{self.root_url}{LOAD_ROUTE} answered {out} for step {step}")

    def served_step(self) -> int | None:
        """The step `GET /rlpipe/policy_step` reports."""
        step = self._get_info(STEP_ROUTE).get("step")
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


def serve(
    run_root: str,
    spec: Any,
    host: str,
    port: int,
    step: int | None,
    max_seqs: int,
    page_size: int,
    identity: ServerIdentity | None = None,
    max_connections: int = 64,
    read_timeout_s: float = 5.0,
) -> None:
    """Serve policy `step` (None: the newest committed) of `run_root` until killed; reload on request. `identity`:
    the secret every request must carry and the file to announce the bound address in (see the module
    docstring)."""
    from fastapi import HTTPException
    from fastapi.responses import JSONResponse
    from levanter.inference.openai import InferenceServer, InferenceServerConfig

    from pipeline.environments.tokenizer import load_tokenizer
    from pipeline.store.poll import poll_until
    from pipeline.store.run_state import latest_policy_step
    from pipeline.store.storage import RunStore
    from policy.policy_format import policy_metadata, read_policy

    identity = identity or ServerIdentity(None, None)
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

    @srv.app.middleware("http")  # added last: the outermost, so it runs before every route
    async def require_secret(request: Any, call_next: Any) -> Any:
        if not identity.check(request.headers):
            error = {"message": "a valid 'Authorization: Bearer <token>' header is required",
                     "type": "authentication_error", "param": "authorization", "code": 401}  # fmt: skip
            return JSONResponse({"error": error}, status_code=401, headers={"WWW-Authenticate": "Bearer"})
        return await call_next(request)

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

    sock = bind_listener(host, port)
    logger.info("levanter server: policy %d of %s on %s:%d", step, run_root, *sock.getsockname()[:2])
    try:
        run_uvicorn(srv.app, sock, identity, max_connections=max_connections, read_timeout_s=read_timeout_s)
    finally:
        srv.shutdown()


def run_uvicorn(
    app: Any, sock: socket.socket, identity: ServerIdentity, *, max_connections: int, read_timeout_s: float
) -> None:
    """Serve `app` with uvicorn on `sock` (bound and listening) until a signal stops it; announce the address once
    connections are accepted. At most `max_connections` connections or requests at once (uvicorn's
    `limit_concurrency`: 503 beyond); a connection silent for `read_timeout_s`, from its start or between
    requests, is closed."""
    import uvicorn
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class SilentConnectionTimeout(H11Protocol):
        """uvicorn's HTTP/1.1 protocol, whose idle timer (`timeout_keep_alive`) also runs from the connection's
        start: a connection that never sends a request is closed like an idle keep-alive one."""

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler
            )

    class AnnouncingServer(uvicorn.Server):
        async def startup(self, sockets: list[socket.socket] | None = None) -> None:
            await super().startup(sockets=sockets)
            if self.started:
                where = identity.announce(sock)
                if where is not None:
                    logger.info("announced %s in %s", where.address, identity.announce_file)

    config = uvicorn.Config(
        app,
        http=SilentConnectionTimeout,
        limit_concurrency=max_connections,
        timeout_keep_alive=max(1, round(read_timeout_s)),
        log_level="info",
    )
    AnnouncingServer(config).run(sockets=[sock])


def main(argv: list[str] | None = None) -> int:
    """`python -m policy.inference.adapters.levanter_server ...` (see the module docstring)."""
    from pipeline.config import ConfigError, ModelSpec
    from pipeline.process.ports import ANNOUNCE_ENV, TOKEN_ENV

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run_root", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0: a port the kernel picks (announced)")
    p.add_argument("--announce_file", default=None, help=f"file to announce host:port in (default ${ANNOUNCE_ENV})")
    p.add_argument("--model_json", default="{}", help="ModelSpec fields as JSON")
    p.add_argument("--step", type=int, default=None)
    p.add_argument("--max_seqs", type=int, default=16)
    p.add_argument("--page_size", type=int, default=16)
    p.add_argument("--max_connections", type=int, default=64, help="connections served at once (503 beyond)")
    p.add_argument("--read_timeout_s", type=float, default=5.0, help="a connection silent this long is closed")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    identity = ServerIdentity.from_env()
    if a.announce_file:
        identity = ServerIdentity(identity.token, a.announce_file)
    if not is_loopback(a.host) and identity.token is None:
        raise ConfigError("host", a.host, f"is not loopback: set {TOKEN_ENV} (the secret every request must carry)")
    spec = ModelSpec(**json.loads(a.model_json))
    serve(a.run_root, spec, a.host, a.port, a.step, a.max_seqs, a.page_size, identity,
          a.max_connections, a.read_timeout_s)  # fmt: skip
    return 0


if __name__ == "__main__":
    # The server never uses PyTorch, but transformers (which levanter imports) loads it eagerly whenever it is
    # installed: about 4 s of CPU at every server start. USE_TORCH=1 keeps it.
    os.environ.setdefault("USE_TORCH", "0")
    raise SystemExit(main())
