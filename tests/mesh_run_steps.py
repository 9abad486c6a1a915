"""Run k learner steps on fixed synthetic batches on the mesh of the command line; save the parameters.

`python -m tests/mesh_run_steps.py OUT.npz DATA FSDP MODEL MICROBATCH [COORDINATOR NUM_PROCESSES PROCESS_ID]`
Set XLA_FLAGS=--xla_force_host_platform_device_count=N before starting (the device count is fixed at JAX start).
With MESH_CKPT_ROOT set: MESH_CKPT_MODE=save commits a learner checkpoint of step 2 under that run root (and
trains on); MESH_CKPT_MODE=resume starts from that (sharded) checkpoint, restored onto this mesh, and trains slot 3.
"""

from __future__ import annotations

import os
import sys

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


def main(argv: list[str]) -> None:
    out, data, fsdp, model_ways, micro = argv[0], int(argv[1]), int(argv[2]), int(argv[3]), int(argv[4])
    import jax

    from pipeline.config import DistributedConfig, LearnerStepConfig, MeshConfig, ModelSpec, TrainParams
    from policy import learner as L
    from policy import mesh as mesh_lib
    from policy import model as M

    if len(argv) > 5:
        mesh_lib.initialize_distributed(
            DistributedConfig(coordinator_address=argv[5], num_processes=int(argv[6]), process_id=int(argv[7]))
        )
    config = LearnerStepConfig(
        model=ModelSpec(hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=S),
        train=TrainParams(batch_size=B, seq_len=S, num_train_steps=10, microbatch_size=micro or None),
        mesh=MeshConfig(data=data, fsdp=fsdp, model=model_ways),
    )
    lm = mesh_lib.build_mesh(config.mesh)
    model = M.build_model(config.model, VOCAB, jax.random.PRNGKey(0))
    optimizer = L.build_optimizer(config.optimizer, config.train.num_train_steps)
    import equinox as eqx

    state = L.LearnerState(0, model, optimizer.init(eqx.filter(model, eqx.is_array)), None)
    ckpt_root, mode = os.environ.get("MESH_CKPT_ROOT"), os.environ.get("MESH_CKPT_MODE")
    store = None
    if ckpt_root:
        from pipeline.storage import RunStore

        store = RunStore(ckpt_root)
        if mode == "resume":  # restored straight onto this run's mesh, whatever mesh saved it
            state = L.load_checkpoint(store, 2, config.model, VOCAB, optimizer, lm)
    state = L.shard_state(state, lm)
    if lm.mesh.shape["data"] * lm.mesh.shape["model"] > 1:  # FSDP or tensor parallel: parameters really split
        leaves = [x for x in jax.tree_util.tree_leaves(state.model) if isinstance(x, jax.Array)]
        assert any(not x.sharding.is_fully_replicated for x in leaves), "parameters are not sharded"
    step = L.mesh_train_step(config, lm)
    start, stop = mesh_lib.process_rows(B)
    for slot in range(state.step + 1, STEPS + 1):
        local = {k: v[start:stop] for k, v in synthetic_rows(slot).items()}
        batch = mesh_lib.global_batch(local, lm, B)
        m, o, metrics = step(state.model, state.opt_state, None, batch)
        state = L.LearnerState(slot, m, o, None)
        print("slot", slot, "loss", float(metrics["loss"]), flush=True)
        if store is not None and mode == "save" and slot == 2:
            L.save_checkpoint(store, state, config, 1)
    if lm.mesh.shape["data"] * lm.mesh.shape["model"] > 1:
        leaves = [x for x in jax.tree_util.tree_leaves(state.model) if isinstance(x, jax.Array)]
        assert any(not x.sharding.is_fully_replicated for x in leaves), "trained parameters are not sharded"
    params = M.numpy_params(mesh_lib.to_host(state.model))
    if mesh_lib.is_writer():
        np.savez(out, *params)


if __name__ == "__main__":
    main(sys.argv[1:])
