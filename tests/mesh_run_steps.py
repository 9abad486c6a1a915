"""Run k learner steps on fixed synthetic batches on each mesh case of the command line; save the parameters.

`python tests/mesh_run_steps.py OUT_DIR CASE [CASE ...] [--distributed COORDINATOR NUM_PROCESSES PROCESS_ID]`
with CASE = `NAME:DATA:FSDP:MODEL:MICROBATCH[:save|resume]`; each case's parameters go to OUT_DIR/NAME.npz. The
cases run one after the other in this process, on the devices it has: set
XLA_FLAGS=--xla_force_host_platform_device_count=N before starting (the device count is fixed at JAX start), so one
process serves every mesh shape of one device count and pays JAX's start-up once.
With MESH_CKPT_ROOT set: a `save` case commits a learner checkpoint of step 2 under that run root (and trains on);
a `resume` case starts from that (sharded) checkpoint, restored onto its mesh, and trains slot 3; it waits for the
checkpoint when another process is still writing it.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import numpy as np

STEPS = 3
B, S, VOCAB = 32, 16, 48


def synthetic_rows(slot: int) -> dict[str, np.ndarray]:
    """Slot `slot`'s full batch arrays: two packed segments per row, varied loss tokens and advantages."""
    rng = np.random.default_rng(1000 + slot)
    seg = np.zeros((B, S), np.int32)
    cut = rng.integers(4, S - 4, size=B)
    for b in range(B):
        seg[b, cut[b] :] = 1
        seg[b, S - int(rng.integers(0, 3)) :] = -1  # some padding
    pos = np.zeros((B, S), np.int32)
    for b in range(B):
        for s in range(S):
            pos[b, s] = 0 if s == 0 or seg[b, s] != seg[b, s - 1] else pos[b, s - 1] + 1
    loss_mask = ((pos >= 2) & (seg >= 0) & (rng.random((B, S)) < 0.8)).astype(np.float32)
    adv = np.repeat(rng.normal(size=(B, 2)).astype(np.float32), S // 2, axis=1)
    rows = np.arange(B, dtype=np.int32)[:, None]
    return {
        "tokens": rng.integers(0, VOCAB, size=(B, S)).astype(np.int32),
        "segment_ids": seg,
        "position_ids": pos,
        "loss_mask": loss_mask,
        "advantages": adv * loss_mask,
        "generator_logprobs": (-rng.random((B, S)) * 4).astype(np.float32) * loss_mask,
        "temperature": np.ones((B, S), np.float32),
        "truncated": np.zeros((B, S), bool),
        "seq_index": np.where(seg >= 0, rows * S + seg, B * S).astype(np.int32),
    }


def run_case(out: str, data: int, fsdp: int, model_ways: int, micro: int, mode: str | None) -> None:
    """Train slots 1..STEPS (or 3 from checkpoint 2 with `mode == "resume"`) on this mesh; write the parameters."""
    import equinox as eqx
    import jax

    from pipeline.config import LearnerStepConfig, MeshConfig, ModelSpec, TrainParams
    from policy import learner as L
    from policy import mesh as mesh_lib
    from policy import model as M
    from policy import policy_format as pf
    from policy.losses import Batch

    config = LearnerStepConfig(
        model=ModelSpec(hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=S),
        train=TrainParams(batch_size=B, seq_len=S, num_train_steps=10, microbatch_size=micro or None),
        mesh=MeshConfig(data=data, fsdp=fsdp, model=model_ways),
    )
    lm = mesh_lib.build_mesh(config.mesh)
    model = M.build_model(config.model, VOCAB, jax.random.PRNGKey(0))
    optimizer = L.build_optimizer(config.optimizer, config.train.num_train_steps)
    state = L.LearnerState(0, model, optimizer.init(eqx.filter(model, eqx.is_array)), None)
    ckpt_root = os.environ.get("MESH_CKPT_ROOT") if mode else None
    store = None
    if ckpt_root:
        from pipeline.store.storage import RunStore

        store = RunStore(ckpt_root)
        if mode == "resume":  # restored straight onto this run's mesh, whatever mesh saved it
            _wait_for_checkpoint(store, 2)
            state = pf.read_checkpoint(store, 2, config.model, VOCAB, optimizer, lm)
    state = L.shard_state(state, lm)
    if lm.mesh.shape["data"] * lm.mesh.shape["model"] > 1:  # FSDP or tensor parallel: parameters really split
        leaves = [x for x in jax.tree_util.tree_leaves(state.model) if isinstance(x, jax.Array)]
        assert any(not x.sharding.is_fully_replicated for x in leaves), "parameters are not sharded"
    step = L.mesh_train_step(config, lm)
    start, stop = mesh_lib.process_rows(B)
    for slot in range(state.step + 1, STEPS + 1):
        local = {k: v[start:stop] for k, v in synthetic_rows(slot).items()}
        batch = Batch(**mesh_lib.global_batch(local, lm, B))
        m, o, metrics = step(state.model, state.opt_state, None, batch)
        state = L.LearnerState(slot, m, o, None)
        print(out, "slot", slot, "loss", float(metrics["loss"]), flush=True)
        if store is not None and mode == "save" and slot == 2:
            pf.write_checkpoint(store, state, config, 1)
    if lm.mesh.shape["data"] * lm.mesh.shape["model"] > 1:
        leaves = [x for x in jax.tree_util.tree_leaves(state.model) if isinstance(x, jax.Array)]
        assert any(not x.sharding.is_fully_replicated for x in leaves), "trained parameters are not sharded"
    params = M.numpy_params(mesh_lib.to_host(state.model))
    if mesh_lib.is_writer():
        np.savez(out, *params)


def _wait_for_checkpoint(store: Any, step: int, timeout_s: float = 600.0) -> None:
    """Until checkpoint `step` is committed under `store` (by another process of the test)."""
    from policy import policy_format as pf

    deadline = time.monotonic() + timeout_s
    while step not in pf.committed_checkpoints(store):
        assert time.monotonic() < deadline, f"checkpoint {step} was never committed"
        time.sleep(0.2)


def main(argv: list[str]) -> None:
    if "--distributed" in argv:
        i = argv.index("--distributed")
        argv, (coordinator, num_processes, pid) = argv[:i], argv[i + 1 : i + 4]
        from pipeline.config import DistributedConfig
        from policy import mesh as mesh_lib

        mesh_lib.initialize_distributed(
            DistributedConfig(coordinator_address=coordinator, num_processes=int(num_processes), process_id=int(pid))
        )
    out_dir = argv[0]
    for case in argv[1:]:
        name, *fields = case.split(":")
        data, fsdp, model_ways, micro = (int(x) for x in fields[:4])
        mode = fields[4] if len(fields) > 4 else None
        run_case(os.path.join(out_dir, f"{name}.npz"), data, fsdp, model_ways, micro, mode)


if __name__ == "__main__":
    main(sys.argv[1:])
