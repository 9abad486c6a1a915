"""The serve step: one committed policy of a run root over rlpipe's own generate endpoint, standalone.

Reads   run.json (the model and tokenizer), policies/step-N (verified against its commit marker)
Serves  `pipeline.environments.endpoint.GenerateEndpoint` over the in-process dense sampler:
        `POST /v1/completions`, `POST /v1/chat/completions`, `POST /inference/v1/generate` (vLLM's token route),
        `GET /v1/models`, `GET /health`; every response carries `policy_step` = N

What it is for: a judge or a reward endpoint that is a policy of a run (an LLM-judge scorer's `base_url` is
`http://HOST:PORT/v1`), a quick look at a policy with any OpenAI client, or any program that speaks vLLM's token
route. It starts in seconds (the dense sampler compiles per request shape on first use; no engine to build).

It waits (up to `--wait_s`) for the run root's run.json and for the policy (`--policy_step N`, or the newest
committed one when not given), so it can be started beside a job before the learner published policy 0 (it loads
JAX and the model only once the policy is there: a serve waiting beside a job costs no more than a Python). It serves
until SIGTERM or SIGINT. Loopback by default; a non-loopback `--host` needs a bearer token (`--token`, or the
environment variable named by `--token_env`, default RLPIPE_ENDPOINT_TOKEN) that every request must carry
(compared in constant time; 401 otherwise).

`--port 0` binds a port the kernel picks (no port is chosen first and bound later, when another program may have
taken it): the address is logged, and with `--announce_file PATH` (or `RLPIPE_SERVER_ANNOUNCE`) written to PATH
as `{"host", "port", "pid"}` atomically once requests are accepted (`pipeline.process.ports`), for the program
that started it to read. `--reuse_port true` binds `--port` with SO_REUSEPORT: for a port the program that starts
serve holds with `pipeline.process.ports.reserve_port` (nobody else can take it, even between two runs of serve).
Load is bounded as in `pipeline.environments.endpoint`: requests beyond the sampler's queue,
and connections beyond the server's threads, get 503; a connection silent for a minute is closed.

Its flags are `pipeline.config.ServeConfig`'s (docs/reference/configuration.md), parsed and checked
(`validate_serve`) by the shared runner `steps.cli.run_program`; `--config_path F` reads them from a YAML file.

Run
    python -m steps.serve --run_root runs/demo --policy_step 0 --port 8000
    python -m steps.serve --run_root runs/demo --port 0 --announce_file /tmp/serve.json
    make serve RUN=runs/demo ARGS="--policy_step 0 --port 8000"

Exit codes: 0 stopped by a signal, 2 bad arguments (or no run.json / no such policy within --wait_s).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from typing import Any

from pipeline.config import ConfigError, ServeConfig, validate_serve
from pipeline.environments.endpoint import GenerateEndpoint
from pipeline.process.ports import ANNOUNCE_ENV
from pipeline.store import layout
from pipeline.store.storage import RunStore

logger = logging.getLogger("rlpipe.serve")


def _wait_for(what: str, found: Any, args: ServeConfig) -> Any:
    """`found()` once it is not None, polling up to `args.wait_s`; ConfigError naming `what` after that."""
    from pipeline.store.poll import poll_until

    try:
        value, _ = poll_until(found, timeout_s=args.wait_s, what=what, interval_s=0.2)
    except TimeoutError as e:
        raise ConfigError("run_root", args.run_root, f"no {what} after {args.wait_s:g} s") from e
    return value


def wait_for_policy(args: ServeConfig) -> int:
    """The policy step to serve once run.json and that policy are committed (`--policy_step`, else the newest),
    waiting up to `args.wait_s`; imports nothing of the JAX side, so a serve started beside a job waits light."""
    from pipeline.store.run_state import latest_policy_step

    store = RunStore(args.run_root)
    if not store.exists(layout.RUN_CONFIG) or (
        args.policy_step is not None and not store.exists(layout.policy_marker(args.policy_step))
    ):
        logger.info("waiting up to %g s for %s's run.json and policy", args.wait_s, args.run_root)
    _wait_for(layout.RUN_CONFIG, lambda: True if store.exists(layout.RUN_CONFIG) else None, args)
    if args.policy_step is None:
        return int(_wait_for("committed policy", lambda: latest_policy_step(store), args))
    want = args.policy_step
    _wait_for(f"policy {want}", lambda: True if store.exists(layout.policy_marker(want)) else None, args)
    return want


def load_endpoint(args: ServeConfig) -> GenerateEndpoint:
    """The endpoint over the dense sampler of the committed policy `args` names, not yet started (waits for it
    first: JAX and the model are loaded only once the policy is there)."""
    step = wait_for_policy(args)
    from pipeline.config import DenseInferenceConfig
    from pipeline.environments.tokenizer import load_tokenizer
    from policy.inference import BackendContext, make_backend
    from policy.policy_format import policy_metadata, read_policy
    from steps.export import recorded_model

    store = RunStore(args.run_root)
    spec = recorded_model(store)
    tokenizer = load_tokenizer(spec.tokenizer)
    model = read_policy(store, step, spec, policy_metadata(store, step).vocab_size)
    inference = DenseInferenceConfig(max_seqs=args.max_seqs)
    backend = make_backend(inference, model, tokenizer, spec.max_seq_len, compute_dtype=spec.compute_dtype)
    ctx = BackendContext(tokenizer, backend)
    ctx.policy_step, ctx.max_seq_len = step, spec.max_seq_len
    return GenerateEndpoint(
        ctx,
        max_seq_len=spec.max_seq_len,
        host=args.host,
        port=args.port,
        token=args.bearer_token(),
        model_name=args.model_name,
        policy_step=lambda: step,
        reuse_port=args.reuse_port,
    )


def main(args: ServeConfig) -> int:
    """Serve until SIGTERM or SIGINT; 0."""
    validate_serve(args)
    endpoint = load_endpoint(args)  # until it is loaded, SIGTERM / SIGINT end the process as usual
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    endpoint.start()
    step = endpoint.current_policy_step()
    logger.info("serving policy %d of %s on %s/v1 (model %r)", step, args.run_root, endpoint.base_url, args.model_name)
    announce_file = args.announce_file or os.environ.get(ANNOUNCE_ENV)
    if announce_file:
        endpoint.announce(announce_file)
    try:
        stop.wait()
    finally:
        endpoint.close()
    logger.info("serve stopped (%d requests served)", endpoint.requests_served)
    return 0


def cli(argv: list[str] | None = None) -> int:
    """`python -m steps.serve --run_root R [--policy_step N] [--port P] …` (`ServeConfig`'s flags, or
    `--config_path F`); returns the exit code."""
    from steps.cli import run_program

    return run_program(ServeConfig, main, argv, validate=validate_serve)


if __name__ == "__main__":
    sys.exit(cli())
