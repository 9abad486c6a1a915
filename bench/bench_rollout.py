"""Rollout generation throughput (generated tokens/s) of the inference backends on this machine.

For the tiny model (`ModelSpec()` defaults) and a ~50M-parameter Llama (the same shape as
bench_learner's "50m"), random weights, the builtin tiny vocabulary: `--prompts` prompts of random words,
`--prompt-len` tokens, `n` samples each, `--max-tokens` new tokens each (no stop token, so every sample
is full length), temperature 1. The first call (compilation) is timed separately; the figure is the
median over `--repeats` further calls. Backends: `dense` (policy.inference.dense_sampler), `levanter`
(levanter's InferenceEngine wrapped by policy.inference.levanter_engine, the peer) and `server` (levanter's
InferenceServer as a child process over loopback HTTP, through policy.inference.server: HTTP, text prompts
verified by round trip, and the server's own batching included). Prints one table naming the machine.

    JAX_PLATFORMS=cpu python -m bench.bench_rollout [--sizes tiny,50m] [--backends dense,levanter]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax
import numpy as np

from bench.common import machine_name
from pipeline.config import InferenceConfig, ModelSpec
from pipeline.environments.tokenizer import load_tokenizer
from policy.inference import GenerationRequest, make_backend
from policy.model import build_model, count_params

VOCAB = 512  # builtin:tiny
SIZES: dict[str, ModelSpec] = {
    "tiny": ModelSpec(max_seq_len=256),
    "50m": ModelSpec(hidden_dim=576, intermediate_dim=2304, num_layers=9, num_heads=9, num_kv_heads=9, max_seq_len=256),
}


WORDS = ["give", "me", "moar", "cats", "the", "a", "cat", "dog", "sat", "on", "mat", "please", "more"]


def _text_prompt(tok: Any, rng: np.random.Generator, length: int) -> list[int]:
    """BOS + `length - 1` ids of random words that survive decode/encode (text-only servers need that)."""
    while True:
        ids = tok.encode(" ".join(rng.choice(WORDS, size=length * 2)))[: length - 1]
        if tok(tok.decode(ids), add_special_tokens=False)["input_ids"] == ids:
            return [tok.bos_token_id, *ids]


def _server_backend(spec: ModelSpec, model: Any, tok: Any, *, max_seqs: int) -> Any:
    """The `server` backend with levanter's InferenceServer started as a child process (loopback HTTP), serving
    `model` committed as policy 0 of a scratch run root."""
    import dataclasses
    import sys
    import tempfile

    from pipeline.config import ServerInferenceConfig
    from pipeline.store.storage import RunStore
    from policy.policy_format import write_policy

    root = tempfile.mkdtemp(prefix="bench_server_")
    write_policy(RunStore(root), 0, model)
    command = (
        f"{sys.executable} -m policy.inference.adapters.levanter_server --run_root {{run_root}} --host {{host}} "
        f"--port {{port}} --model_json {{model_json}} --step {{step}} --max_seqs {max_seqs}"
    )
    config = ServerInferenceConfig(command=command, port=0, max_seqs=max_seqs, startup_timeout_s=600)
    be = make_backend(config, None, tok, spec.max_seq_len)
    be.attach(root, json.dumps(dataclasses.asdict(spec)), os.path.join(root, "server.log"))  # type: ignore[attr-defined]
    be.load_policy(0)  # type: ignore[attr-defined]
    return be


def bench_one(
    size: str, backend: str, *, prompts: int, n: int, prompt_len: int, max_tokens: int, repeats: int
) -> dict[str, float | int | str]:
    """Time `repeats` generate calls (after a first, compiling one) of one backend on one model size."""
    spec = SIZES[size]
    tok = load_tokenizer(spec.tokenizer)
    model = build_model(spec, VOCAB)
    rng = np.random.default_rng(0)
    batch = [_text_prompt(tok, rng, prompt_len) for _ in range(prompts)]
    if backend == "server":
        be = _server_backend(spec, model, tok, max_seqs=prompts * n)
    else:
        config = InferenceConfig.get_choice_class(backend)(max_seqs=prompts * n)
        be = make_backend(config, model, tok, spec.max_seq_len)
    kwargs: dict[str, Any] = dict(n=n, temperature=1.0, max_tokens=max_tokens, stop_tokens=[])
    t0 = time.perf_counter()
    out = be.generate(GenerationRequest(batch, seed=0, **kwargs))
    first = time.perf_counter() - t0
    times, toks = [], 0
    for r in range(repeats):
        t0 = time.perf_counter()
        out = be.generate(GenerationRequest(batch, seed=r + 1, **kwargs))
        times.append(time.perf_counter() - t0)
        toks = sum(len(c.tokens) for g in out for c in g)
    be.shutdown()
    med = statistics.median(times)
    return {
        "size": size,
        "params": count_params(model),
        "backend": backend,
        "sequences": prompts * n,
        "tokens_per_call": toks,
        "first_call_s": first,
        "call_s": med,
        "tokens_per_s": toks / med,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="tiny,50m")
    ap.add_argument("--backends", default="dense,levanter,server")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    args = ap.parse_args()
    rows = []
    for size in args.sizes.split(","):
        for backend in args.backends.split(","):
            rows.append(
                bench_one(
                    size,
                    backend,
                    prompts=args.prompts,
                    n=args.n,
                    prompt_len=args.prompt_len,
                    max_tokens=args.max_tokens,
                    repeats=args.repeats,
                )
            )
    print(f"\nrollout generation, {machine_name()}, jax {jax.__version__} ({jax.default_backend()})")
    print(f"{args.prompts} prompts x n={args.n}, prompt {args.prompt_len} tokens, {args.max_tokens} new tokens, T=1")
    header = f"{'model':<6} {'params':>10} {'backend':<9} {'seqs':>5} {'tokens':>7} {'1st call s':>10} "
    header += f"{'call s':>8} {'tokens/s':>10}"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['size']:<6} {r['params']:>10,} {r['backend']:<9} {r['sequences']:>5} {r['tokens_per_call']:>7} "
            f"{r['first_call_s']:>10.1f} {r['call_s']:>8.2f} {r['tokens_per_s']:>10.0f}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine_name(), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
