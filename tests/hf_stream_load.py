"""Build the learner's initial state from `model.hf_checkpoint` URLs on the learner's mesh; save what landed where.

`python tests/hf_stream_load.py OUT_DIR FAMILY=VOCAB=URL [FAMILY=VOCAB=URL ...]` (VOCAB: the model vocabulary)
Set XLA_FLAGS=--xla_force_host_platform_device_count=N before starting (the device count is fixed at JAX start);
the mesh is the default learner mesh (FSDP over every device). With HF_STREAM_MAX_FILE_BYTES set, this process can
write no file larger than that while the models load (RLIMIT_FSIZE: a larger write fails with EFBIG), so a weights
file copied to local disk fails the run. Writes OUT_DIR/FAMILY.npz (the parameters, in tree order) and
OUT_DIR/FAMILY.json (per parameter: its axis names, partition spec, device count, whether fully replicated, and the
shape of one device's shard).
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
import tempfile

import numpy as np


def main(argv: list[str]) -> None:
    out, triples = argv[0], [a.split("=", 2) for a in argv[1:]]
    import haliax as hax
    import jax

    from pipeline.config import LearnerStepConfig, ModelSpec, TrainParams
    from pipeline.store.storage import RunStore
    from policy import learner as L
    from policy import mesh as mesh_lib
    from policy import model as M

    limit = os.environ.get("HF_STREAM_MAX_FILE_BYTES")
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    if limit:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an oversized write raises OSError(EFBIG) instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (int(limit), hard))
    states = {}
    for family, vocab, url in triples:
        config = LearnerStepConfig(
            model=ModelSpec(family=family, hf_checkpoint=url, max_seq_len=16),
            train=TrainParams(batch_size=4, seq_len=16, replay_buffer_capacity=4, num_train_steps=1),
        )
        lm = mesh_lib.build_mesh(config.mesh)
        store = RunStore(tempfile.mkdtemp(prefix="root-"))  # no checkpoint: the initial state is the HF model
        states[family] = L.resume_or_init(store, config, int(vocab), L.build_optimizer(config.optimizer, 1), lm)
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    for family, state in states.items():
        placed = []
        for x in jax.tree_util.tree_leaves(state.model, is_leaf=lambda x: isinstance(x, hax.NamedArray)):
            if not isinstance(x, hax.NamedArray):
                continue
            sharding = x.array.sharding
            placed.append(
                {
                    "axes": [a.name for a in x.axes],
                    "spec": [str(p) for p in sharding.spec],
                    "devices": len(sharding.device_set),
                    "replicated": bool(sharding.is_fully_replicated),
                    "shard_shape": list(sharding.shard_shape(x.array.shape)),
                }
            )
        with open(os.path.join(out, f"{family}.json"), "w") as f:
            json.dump(placed, f)
        np.savez(os.path.join(out, f"{family}.npz"), *M.numpy_params(mesh_lib.to_host(state.model)))


if __name__ == "__main__":
    main(sys.argv[1:])
