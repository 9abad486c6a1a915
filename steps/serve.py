"""The serve step: one committed policy of a run root over rlpipe's own generate endpoint, standalone.

Reads   run.json (the model and tokenizer), policies/step-N (verified against its commit marker)
Serves  `pipeline.environments.endpoint.GenerateEndpoint` over the in-process dense sampler:
        `POST /v1/completions`, `POST /v1/chat/completions`, `POST /inference/v1/generate` (vLLM's token route),
        `GET /v1/models`, `GET /health`; every response carries `policy_step` = N

What it is for: a judge or a reward endpoint that is a policy of a run (an LLM-judge scorer's `base_url` is
`http://HOST:PORT/v1`), a quick look at a policy with any OpenAI client, or any program that speaks vLLM's token
route. It starts in seconds (the dense sampler compiles per request shape on first use; no engine to build).

It waits (up to `--wait_s`) for the run root's run.json and for the policy (`--policy_step N`, or the newest
committed one when not given), so it can be started beside a job before the learner published policy 0. It serves
until SIGTERM or SIGINT. Loopback by default; a non-loopback `--host` needs a bearer token (`--token`, or the
environment variable named by `--token_env`, default RLPIPE_ENDPOINT_TOKEN) that every request must carry
(compared in constant time; 401 otherwise).

`--port 0` binds a port the kernel picks (no port is chosen first and bound later, when another program may have
taken it): the address is logged, and with `--announce_file PATH` (or `RLPIPE_SERVER_ANNOUNCE`) written to PATH
as `{"host", "port", "pid"}` atomically once requests are accepted (`pipeline.process.ports`), for the program
that started it to read. `--reuse_port` binds `--port` with SO_REUSEPORT: for a port the program that starts
serve holds with `pipeline.process.ports.reserve_port` (nobody else can take it, even between two runs of serve).
Load is bounded as in `pipeline.environments.endpoint`: requests beyond the sampler's queue,
and connections beyond the server's threads, get 503; a connection silent for a minute is closed.

Run
    python -m steps.serve --run_root runs/demo --policy_step 0 --port 8000
    python -m steps.serve --run_root runs/demo --port 0 --announce_file /tmp/serve.json
    make serve RUN=runs/demo ARGS="--policy_step 0 --port 8000"

Exit codes: 0 stopped by a signal, 2 bad arguments (or no run.json / no such policy within --wait_s).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
import threading
from typing import Any

from pipeline.config import ConfigError
from pipeline.environments.endpoint import GenerateEndpoint
from pipeline.process.ports import ANNOUNCE_ENV, is_loopback
from pipeline.store import layout
from pipeline.store.storage import RunStore

logger = logging.getLogger("rlpipe.serve")

TOKEN_ENV = "RLPIPE_ENDPOINT_TOKEN"


@dataclasses.dataclass(frozen=True)
class ServeArgs:
    """What `python -m steps.serve` was asked to serve (see the module docstring)."""

    run_root: str
    policy_step: int | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    token: str | None = None
    model_name: str = "policy"
    max_seqs: int = 16
    wait_s: float = 3600.0
    announce_file: str | None = None
    reuse_port: bool = False


def parse_args(argv: list[str]) -> ServeArgs:
    """The command line as `ServeArgs`; ConfigError (exit 2, one line naming the flag) for a bad value."""
    p = argparse.ArgumentParser(prog="python -m steps.serve", description=__doc__.splitlines()[0])
    p.add_argument("--run_root", required=True, help="the run root whose committed policy is served")
    p.add_argument("--policy_step", type=int, default=None, help="the policy to serve (default: the newest)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0: a port the kernel picks (logged, and announced)")
    p.add_argument("--announce_file", default=os.environ.get(ANNOUNCE_ENV) or None,
                   help=f"write the bound host:port here once serving (default ${ANNOUNCE_ENV})")  # fmt: skip
    p.add_argument("--reuse_port", action="store_true", help="bind --port with SO_REUSEPORT (a port reserved for it)")
    p.add_argument("--token", default=None, help="bearer token every request must carry")
    p.add_argument("--token_env", default=TOKEN_ENV, help="environment variable holding the token")
    p.add_argument("--model_name", default="policy", help="the model id /v1/models lists")
    p.add_argument("--max_seqs", type=int, default=16, help="most sequences the dense sampler decodes at once")
    p.add_argument("--wait_s", type=float, default=3600.0, help="how long to wait for run.json and the policy")
    ns = p.parse_args(argv)
    token = ns.token or os.environ.get(ns.token_env) or None
    if ns.policy_step is not None and ns.policy_step < 0:
        raise ConfigError("policy_step", ns.policy_step, "must be >= 0")
    if not 0 <= ns.port < 65536:
        raise ConfigError("port", ns.port, "must be in [0, 65535]")
    if ns.max_seqs < 1:
        raise ConfigError("max_seqs", ns.max_seqs, "must be >= 1")
    if not is_loopback(ns.host) and not token:
        raise ConfigError("host", ns.host, f"is not loopback: give --token or set {ns.token_env}")
    return ServeArgs(ns.run_root, ns.policy_step, ns.host, ns.port, token, ns.model_name, ns.max_seqs, ns.wait_s,
                     ns.announce_file, ns.reuse_port)  # fmt: skip


def _wait_for(what: str, found: Any, args: ServeArgs) -> Any:
    """`found()` once it is not None, polling up to `args.wait_s`; ConfigError naming `what` after that."""
    from pipeline.store.poll import poll_until

    try:
        value, _ = poll_until(found, timeout_s=args.wait_s, what=what, interval_s=0.2)
    except TimeoutError as e:
        raise ConfigError("run_root", args.run_root, f"no {what} after {args.wait_s:g} s") from e
    return value


def load_endpoint(args: ServeArgs) -> GenerateEndpoint:
    """The endpoint over the dense sampler of the committed policy `args` names, not yet started (waits for it)."""
    from pipeline.config import DenseInferenceConfig
    from pipeline.environments.tokenizer import load_tokenizer
    from pipeline.store.run_state import latest_policy_step
    from policy.inference import BackendContext, make_backend
    from policy.policy_format import policy_metadata, read_policy
    from steps.export import recorded_model

    store = RunStore(args.run_root)
    _wait_for(layout.RUN_CONFIG, lambda: True if store.exists(layout.RUN_CONFIG) else None, args)
    spec = recorded_model(store)
    if args.policy_step is None:
        step = int(_wait_for("committed policy", lambda: latest_policy_step(store), args))
    else:
        want = args.policy_step
        _wait_for(f"policy {want}", lambda: True if store.exists(layout.policy_marker(want)) else None, args)
        step = want
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
        token=args.token,
        model_name=args.model_name,
        policy_step=lambda: step,
        reuse_port=args.reuse_port,
    )


def main(args: ServeArgs) -> int:
    """Serve until SIGTERM or SIGINT; 0."""
    endpoint = load_endpoint(args)  # until it is loaded, SIGTERM / SIGINT end the process as usual
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    endpoint.start()
    step = endpoint.current_policy_step()
    logger.info("serving policy %d of %s on %s/v1 (model %r)", step, args.run_root, endpoint.base_url, args.model_name)
    if args.announce_file:
        endpoint.announce(args.announce_file)
    try:
        stop.wait()
    finally:
        endpoint.close()
    logger.info("serve stopped (%d requests served)", endpoint.requests_served)
    return 0


def cli(argv: list[str] | None = None) -> int:
    """`python -m steps.serve --run_root R [--policy_step N] [--port P] …`; returns the exit code."""
    from steps.cli import run_command

    return run_command(parse_args, main, argv)


if __name__ == "__main__":
    sys.exit(cli())
