"""Learner tokens/s on 1 vs 4 simulated CPU devices (FSDP over all of them): a check that the mesh path scales
correctly (same loss, same shapes), not a speed claim — simulated devices share the same CPU cores.

Each device count runs in its own process (the device count is fixed when JAX starts); the first step
(compilation) is excluded.

    JAX_PLATFORMS=cpu python -m bench.bench_learner_mesh [--devices 1,4] [--steps 5] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from bench.common import machine_name

B, S, VOCAB = 32, 128, 512


def child(steps: int) -> dict[str, float]:
    """Time `steps` optimizer steps of the tiny model on the mesh of every visible device."""
    import jax

    from bench.common import learner_on_mesh
    from pipeline.config import LearnerStepConfig, MeshConfig, ModelSpec, TrainParams

    config = LearnerStepConfig(
        model=ModelSpec(max_seq_len=S),
        train=TrainParams(batch_size=B, seq_len=S, num_train_steps=100),
        mesh=MeshConfig(fsdp=-1),
    )
    state, batch, step = learner_on_mesh(config, VOCAB, -6.0)
    m, o, metrics = step(state.model, state.opt_state, None, batch)
    jax.block_until_ready(m)
    t0 = time.perf_counter()
    for _ in range(steps):
        m, o, metrics = step(m, o, None, batch)
    jax.block_until_ready(m)
    dt = time.perf_counter() - t0
    return {"devices": jax.device_count(), "tokens_per_s": B * S * steps / dt, "last_loss": float(metrics["loss"])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", default="1,4")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.steps)))
        return
    rows = []
    for n in [int(x) for x in args.devices.split(",")]:
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={n}"}
        cmd = [sys.executable, "-m", "bench.bench_learner_mesh", "--child", "--steps", str(args.steps)]
        out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    print(f"learner on a mesh (tiny llama, batch {B} x {S}, FSDP over simulated CPU devices) on {machine_name()}")
    print("| devices | tokens/s | last loss |\n| --- | --- | --- |")
    for r in rows:
        print(f"| {r['devices']} | {r['tokens_per_s']:.0f} | {r['last_loss']:.6f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows}, f)


if __name__ == "__main__":
    main()
