"""Learner checkpoints on a run root: `checkpoints/step-S/`, model + optimizer state, mesh-independent.

    checkpoints/step-S/shard-<attempt>-p<i>.safetensors   learner process i's blocks (`policy.policy_format.sharded`)
                                                         of `model`, `opt_state` and, under critic PPO, `value_head`
    checkpoints/step-S/COMMITTED                         written last by process 0: the batch slot consumed, the
                                                         checkpoint resumed from and the slots trained since
    checkpoints/step-S/COLLECTED                         a tombstone: the data files were garbage-collected

Checkpoints of the older whole-pytree format (`model-<attempt>.safetensors`, `opt_state-<attempt>.safetensors`,
`policy.policy_format.committed`) still load.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import equinox as eqx

import policy.policy_format.sharded as sharded
from pipeline.config import LearnerStepConfig, ModelSpec
from pipeline.store import layout, run_state
from policy import lora
from policy import mesh as mesh_lib
from policy import model as M
from policy import value_head as VH
from policy.policy_format.committed import (
    MODEL_BLOB,
    OPT_BLOB,
    CheckpointError,
    read_blob,
    read_marker,
    tree_from_safetensors,
)

if TYPE_CHECKING:
    from pipeline.store.storage import RunStore

logger = logging.getLogger(__name__)


@dataclass
class LearnerState:
    """What a full checkpoint holds: `step` batches consumed (slots 1..step), model, optimizer state."""

    step: int
    model: Any
    opt_state: Any
    parent: int | None
    """The checkpoint this process resumed from (None: initialised)."""


def committed_checkpoints(store: RunStore) -> list[int]:
    """Committed, not garbage-collected checkpoint steps, ascending."""
    return [
        s
        for s in run_state.committed_steps(store, layout.CHECKPOINTS)
        if not store.exists(layout.join(layout.checkpoint_dir(s), "COLLECTED"))
    ]


def write_checkpoint(store: RunStore, state: LearnerState, config: LearnerStepConfig, lineage_start: int) -> bool:
    """Commit `checkpoints/step-S` sharded: model + optimizer state, then COMMITTED recording the slots consumed.
    Every learner process must call it (it contains collectives); True on the process that committed."""
    meta = {
        "kind": "checkpoint",
        "step": state.step,
        "batch_slot": state.step,
        "parent": state.parent,
        "slots": [lineage_start, state.step],
        "tokenizer": config.model.tokenizer,
        "seq_len": config.train.seq_len,
        "vocab_size": int(state.model.Vocab.size),
        "loss": type(config.loss).__name__,
    }
    # the policy under `model` whatever the loss (the same tensors as without a critic); a value head beside it
    trees = {MODEL_BLOB: VH.policy_of(state.model), OPT_BLOB: state.opt_state}
    head = VH.value_head_of(state.model)
    if head is not None:
        trees[VH.VALUE_BLOB] = head
    return sharded.save_sharded(store, layout.checkpoint_dir(state.step), trees, meta)


def read_checkpoint(
    store: RunStore,
    step: int,
    spec: ModelSpec,
    vocab_size: int,
    optimizer: Any,
    lm: mesh_lib.LearnerMesh | None = None,
    value_head: bool = False,
) -> LearnerState:
    """Restore checkpoint `step` (each file verified against its marker) into templates built from the config:
    a sharded one onto mesh `lm` whatever mesh wrote it; else (or the older whole-pytree format) on the host.
    With `value_head` (critic PPO) the model comes back as a `policy.value_head.PolicyWithValue` with the
    checkpoint's value head. Raises `CheckpointError` naming the file or tensor that does not verify or fit (a
    value head missing, or present when not asked for)."""
    folder = layout.checkpoint_dir(step)
    record = read_marker(store, folder)
    template = M.model_template(spec, vocab_size)
    if spec.lora is not None:
        template = lora.loraize_template(template, spec.lora)
    head_template = VH.value_head_template(VH.embed_size(template)) if value_head else None
    full_template = template if head_template is None else VH.PolicyWithValue(template, head_template)
    opt_template = eqx.filter_eval_shape(optimizer.init, lora.trainable_params(full_template))
    if record.format == sharded.FORMAT:
        has_head = any(name.startswith(VH.VALUE_BLOB + "/") for name in record.tensors or {})
        if has_head != value_head:  # a critic PPO checkpoint read by another loss, or the other way round
            why = (
                "holds a value head (loss.type ppo_critic) but this learner's loss has none"
                if has_head
                else "holds no value head but loss.type ppo_critic needs one"
            )
            raise CheckpointError(f"{folder}: {why}")
        templates = {MODEL_BLOB: template, OPT_BLOB: opt_template}
        if head_template is not None:
            templates[VH.VALUE_BLOB] = head_template
        trees = sharded.load_sharded(store, folder, record, templates, lm)
        model = trees[MODEL_BLOB] if head_template is None else VH.attach(trees[MODEL_BLOB], trees[VH.VALUE_BLOB])
        return LearnerState(step=step, model=model, opt_state=trees[OPT_BLOB], parent=step)
    if value_head:
        raise CheckpointError(f"{folder}: a checkpoint of the older whole-pytree format holds no value head")
    model = tree_from_safetensors(template, read_blob(store, folder, record, MODEL_BLOB), source=folder)
    opt_state = tree_from_safetensors(opt_template, read_blob(store, folder, record, OPT_BLOB), source=folder)
    return LearnerState(step=step, model=model, opt_state=opt_state, parent=step)


def collect_old_checkpoints(store: RunStore, keep: int) -> None:
    """Garbage-collect all but the newest `keep` checkpoints: tombstone first, then delete their data files.

    The COMMITTED markers stay (commit objects are never deleted), so the lineage remains auditable. Only the
    writer process (process 0) collects.
    """
    if not mesh_lib.is_writer():
        return
    steps = committed_checkpoints(store)
    for s in steps[: max(len(steps) - keep, 0)]:
        folder = layout.checkpoint_dir(s)
        store.put_json_if_absent(layout.join(folder, "COLLECTED"), {"step": s})
        for rel in store.list(folder):
            if rel.endswith(".safetensors"):
                store.delete(rel)
        logger.info("garbage-collected checkpoint %d", s)
