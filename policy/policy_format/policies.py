"""Policies on a run root: `policies/step-S/` written once by the learner, read by every sampler and evaluator.

policies/step-S/weights-<attempt>.safetensors    the weights (`POLICY_WEIGHTS`), float32 or `model.publish_dtype`
policies/step-S/adapters-<attempt>.safetensors   LoRA adapters (`policy.policy_format.adapters`), LoRA runs only
policies/step-S/COMMITTED                        written last, create-if-absent (`policy.policy_format.committed`)
policies/LATEST                                  a hint: the newest step written; listing is the truth
"""

from __future__ import annotations

import logging
from typing import Any

import jax
import jax.numpy as jnp
from levanter.models.lm_model import LmHeadModel

import policy.policy_format.adapters as adapters
from pipeline.config import ModelSpec
from pipeline.store import layout
from policy import lora
from policy import model as M
from policy.policy_format.committed import (
    POLICY_WEIGHTS,
    CheckpointError,
    read_blob,
    read_marker,
    tree_from_safetensors,
    tree_to_safetensors,
    write_committed,
)
from schemas.records import CommitMarker, LatestPointer, RecordError

logger = logging.getLogger(__name__)


class PolicyNotFoundError(FileNotFoundError):
    """The requested policy step has no commit marker."""


def write_policy(
    store: Any,
    step: int,
    model: LmHeadModel,
    extra: dict[str, Any] | None = None,
    dtype: str | None = None,
    spec: ModelSpec | None = None,
) -> bool:
    """Commit `model` as policy `step`: weights file, then COMMITTED (last), then the LATEST hint.

    `extra` goes into the marker (the learner records `batch_slot`, `tokenizer`, `seq_len`). With `dtype`,
    floating weights are written in that dtype (the marker records it as `dtype`; `read_policy` reads it).
    With `spec.lora`, `model` is the loraized model and the policy holds what `spec.lora.publish` says
    (`policy.policy_format.adapters.policy_blobs`), always in float32: `dtype` does not apply to LoRA policies.
    Returns False (and writes nothing new) if policy `step` was already committed: a committed policy
    is never replaced. LATEST only moves forward.
    """
    folder = layout.policy_dir(step)
    if store.exists(layout.policy_marker(step)):
        logger.info("policy %d already committed", step)
        return False
    lora_spec = spec.lora if spec is not None else None
    if dtype is not None and dtype not in ("float32", "fp32") and lora_spec is None:
        model = M.cast_params(model, dtype)
        extra = {**(extra or {}), "dtype": str(jnp.dtype(dtype))}
    meta = {"step": step, "vocab_size": int(model.Vocab.size), "kind": "policy", **(extra or {})}
    if spec is not None and lora_spec is not None:
        blobs, lora_meta = adapters.policy_blobs(model, spec, step)
        meta.update(lora_meta)
    else:
        blobs = {POLICY_WEIGHTS: tree_to_safetensors(model)}
    created = write_committed(store, folder, blobs, meta)
    _advance_latest(store, step)
    return created


def _advance_latest(store: Any, step: int) -> None:
    try:
        current = LatestPointer.from_json(store.get(layout.POLICY_LATEST), path=layout.POLICY_LATEST).step
    except (FileNotFoundError, RecordError):
        current = -1
    if step > current:
        store.put_unique(layout.POLICY_LATEST, LatestPointer(step=step).to_json())


def read_policy(store: Any, step: int, spec: ModelSpec, vocab_size: int) -> LmHeadModel:
    """Load committed policy `step`, verifying size and sha256 against its marker.

    A policy published as LoRA adapters comes back merged into its base policy's weights, so the result is always
    a plain model of `spec`'s shape. Raises PolicyNotFoundError when the marker is missing, CheckpointError when
    the files do not match it or the weights do not fit `spec`/`vocab_size` (the message names the file and
    tensor).
    """
    folder = layout.policy_dir(step)
    if not store.exists(layout.policy_marker(step)):
        raise PolicyNotFoundError(f"{layout.policy_marker(step)}: policy {step} is not committed")
    record = read_marker(store, folder)
    if record.vocab_size != vocab_size:
        raise CheckpointError(f"{folder}: committed with vocab_size={record.vocab_size}, expected {vocab_size}")
    if POLICY_WEIGHTS not in record.files:  # published as adapters: merged into its base policy's weights
        base_step = record.extra.get("base_policy")
        if not isinstance(base_step, int) or base_step >= step:
            raise CheckpointError(f"{folder}: base_policy={base_step!r} is not an earlier policy")
        base = read_policy(store, base_step, spec, vocab_size)
        return lora.merge(adapters.read_adapters(store, folder, record, base))  # type: ignore[no-any-return]
    data = read_blob(store, folder, record, POLICY_WEIGHTS)
    template = M.model_template(spec, vocab_size)
    stored = record.extra.get("dtype")
    if isinstance(stored, str):  # published in the sampler's dtype (e.g. bfloat16): loaded as stored
        dt = jnp.dtype(stored)
        template = jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(x.shape, dt) if jnp.issubdtype(x.dtype, jnp.floating) else x, template
        )
    return tree_from_safetensors(template, data, source=folder)


def read_policy_adapters(store: Any, step: int, base: LmHeadModel) -> Any:
    """The loraized `base` with the adapters of committed policy `step` (for a PEFT export; not merged).

    Raises CheckpointError when the policy holds no adapters."""
    return adapters.read_adapters(store, layout.policy_dir(step), policy_metadata(store, step), base)


def policy_metadata(store: Any, step: int) -> CommitMarker:
    """The COMMITTED marker of policy `step` (batch slot, tokenizer, seq_len, files)."""
    return read_marker(store, layout.policy_dir(step))
