"""What a run root holds of policies and checkpoints, and the one writer and reader of it (no pickle anywhere).

    policies/step-S/weights-<attempt>-p<i>-<k>.safetensors   learner process i's blocks of policy S (parallel
                                                      writers: `prepare_policy` + `commit_policy`)
    policies/step-S/manifest-<attempt>-p<i>.json      process i's files and blocks (process 0 commits after all)
    policies/step-S/weights-<attempt>.safetensors     policy S by one writer (`write_policy`; f32 or `publish_dtype`)
    policies/step-S/adapters-<attempt>.safetensors    its LoRA adapters (LoRA runs)
    policies/step-S/COMMITTED                         written last, create-if-absent: a `schemas.records.CommitMarker`
    policies/step-S/hf/…, hf/COMMITTED                its HF folder, for `server` backends (`publish_hf_if_needed`)
    policies/LATEST                                   a hint: the newest policy written (listing is the truth)
    checkpoints/step-S/shard-<attempt>-p<i>.safetensors   learner process i's blocks of model + optimizer state
    checkpoints/step-S/COMMITTED                      written last by learner process 0 (`write_checkpoint`)

API:

    write_policy(store, step, model, extra=None, dtype=None, spec=None) -> bool   # commit policies/step-S
    prepare_policy(step, model, extra, dtype) -> PolicyPublish     # every learner process, in step order
    commit_policy(store, pub, wait_s) -> bool                      # every process, any thread: its own blocks
    read_policy(store, step, spec, vocab_size) -> LmHeadModel     # verified; adapters merged into their base
    policy_metadata(store, step) -> CommitMarker                   # its COMMITTED marker
    read_policy_adapters(store, step, base) -> loraized model      # a LoRA policy's adapters on `base`
    write_checkpoint(store, state, config, lineage_start) -> bool  # every learner process calls it
    read_checkpoint(store, step, spec, vocab_size, optimizer, lm=None) -> LearnerState   # onto any mesh
    committed_checkpoints(store) / collect_old_checkpoints(store, keep)
    export_hf(model, out_dir, tokenizer, family) / export_peft(model, lora, out, base)   # folders outside a run

Modules: `committed` (pytrees as safetensors under a COMMITTED marker; the bytes verified on read), `sharded`
(checkpoints written by every learner process, read onto any mesh), `adapters` (LoRA blobs and marker fields,
PEFT folders), `policies`, `checkpoints`, `hf` (Hugging Face folders).
"""

from policy.policy_format.adapters import export_peft, marker_lora
from policy.policy_format.checkpoints import (
    LearnerState,
    collect_old_checkpoints,
    committed_checkpoints,
    read_checkpoint,
    write_checkpoint,
)
from policy.policy_format.committed import (
    ADAPTERS_BLOB,
    MODEL_BLOB,
    OPT_BLOB,
    POLICY_WEIGHTS,
    CheckpointError,
    DamagedCommitError,
    crc32c_hex,
    read_blob,
    read_marker,
    sha256_hex,
    st_load,
    tree_from_safetensors,
    tree_to_safetensors,
    write_committed,
)
from policy.policy_format.hf import export_hf, hf_marker_path, publish_hf_if_needed, read_hf_marker
from policy.policy_format.policies import (
    PolicyNotFoundError,
    PolicyPublish,
    commit_policy,
    policy_metadata,
    prepare_policy,
    read_policy,
    read_policy_adapters,
    single_writer_policy,
    write_policy,
)

__all__ = [
    "ADAPTERS_BLOB",
    "MODEL_BLOB",
    "OPT_BLOB",
    "POLICY_WEIGHTS",
    "CheckpointError",
    "DamagedCommitError",
    "LearnerState",
    "PolicyNotFoundError",
    "PolicyPublish",
    "collect_old_checkpoints",
    "commit_policy",
    "committed_checkpoints",
    "crc32c_hex",
    "export_hf",
    "export_peft",
    "hf_marker_path",
    "marker_lora",
    "policy_metadata",
    "prepare_policy",
    "publish_hf_if_needed",
    "read_blob",
    "read_checkpoint",
    "read_hf_marker",
    "read_marker",
    "read_policy",
    "read_policy_adapters",
    "sha256_hex",
    "single_writer_policy",
    "st_load",
    "tree_from_safetensors",
    "tree_to_safetensors",
    "write_checkpoint",
    "write_committed",
    "write_policy",
]
