"""Learner throughput (tokens/s of full optimizer steps) for the tiny and a ~50M-parameter model.

Runs the real jitted learner step (`policy.learner.make_train_step`, RLOO loss, AdamW) on synthetic fixed-shape
batches; the first step (compilation) is excluded. Prints a table naming the machine.

    JAX_PLATFORMS=cpu python bench/bench_learner.py [--sizes tiny,50m] [--steps 5]
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from bench.common import machine_name
from pipeline.config import ModelSpec, OptimizerSpec, RLOOLossConfig
from policy import learner
from policy import model as M
from policy.losses import Batch, loss_module_from_config

VOCAB = 512  # builtin:tiny
SIZES: dict[str, tuple[ModelSpec, int, int]] = {
    # name: (spec, batch_size, seq_len)
    "tiny": (ModelSpec(max_seq_len=128), 8, 128),
    "50m": (
        ModelSpec(hidden_dim=576, intermediate_dim=2304, num_layers=9, num_heads=9, num_kv_heads=9, max_seq_len=256),
        4,
        256,
    ),
}


def synthetic_batch(B: int, S: int, seed: int = 0) -> Batch:
    rng = np.random.default_rng(seed)
    mask = np.zeros((B, S), np.float32)
    mask[:, S // 4 :] = 1
    return Batch(
        tokens=jnp.asarray(rng.integers(4, VOCAB, (B, S)), jnp.int32),
        segment_ids=jnp.zeros((B, S), jnp.int32),
        position_ids=jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S)),
        loss_mask=jnp.asarray(mask),
        advantages=jnp.asarray(rng.choice([-1.0, 1.0], (B, 1)) * mask, jnp.float32),
        generator_logprobs=jnp.asarray(-rng.uniform(4, 8, (B, S)), jnp.float32),
        temperature=jnp.ones((B, S), jnp.float32),
        truncated=jnp.zeros((B, S), bool),
        seq_index=jnp.asarray(np.arange(B)[:, None] * S + np.zeros((B, S), int), jnp.int32),
    )


def bench(name: str, steps: int) -> dict[str, object]:
    spec, B, S = SIZES[name]
    model = M.build_model(spec, VOCAB)
    optimizer = learner.build_optimizer(OptimizerSpec(), 1000)

    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))
    step = learner.make_train_step(loss_module_from_config(RLOOLossConfig()), optimizer, spec.compute_dtype)
    batch = synthetic_batch(B, S)
    t0 = time.perf_counter()
    model, opt_state, metrics = step(model, opt_state, None, batch)
    jax.block_until_ready(metrics)
    compile_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(steps):
        model, opt_state, metrics = step(model, opt_state, None, batch)
    jax.block_until_ready(metrics)
    dt = (time.perf_counter() - t0) / steps
    return {
        "model": name,
        "params": M.count_params(model),
        "batch": f"{B}x{S}",
        "step_s": dt,
        "tokens_per_s": B * S / dt,
        "first_step_s": compile_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--sizes", default="tiny,50m")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--json", default=None, help="also write the rows to this file")
    args = ap.parse_args()
    rows = [bench(n, args.steps) for n in args.sizes.split(",")]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine_name(), "rows": rows}, f, indent=2)
    print(f"learner throughput on {machine_name()} (jax {jax.__version__}, {jax.devices()[0].platform})")
    print(f"{'model':<6} {'params':>12} {'batch':>8} {'step s':>9} {'tokens/s':>10} {'first step s':>13}")
    for r in rows:
        print(
            f"{r['model']:<6} {r['params']:>12,} {r['batch']:>8} {r['step_s']:>9.3f} {r['tokens_per_s']:>10.0f} "
            f"{r['first_step_s']:>13.1f}"
        )


if __name__ == "__main__":
    main()
