"""Policies on a run root: `policies/step-S/` written once by the learner, read by every sampler and evaluator.

Published by the learner (`prepare_policy` + `commit_policy`, full weights), every learner process writing its own
blocks (`policy.policy_format.sharded`, the sharded format of checkpoints):

policies/step-S/weights-<attempt>-p<i>-<k>.safetensors   learner process i's k-th file of blocks (parallel threads)
policies/step-S/manifest-<attempt>-p<i>.json             process i's files (size, crc32c) and blocks, written after
                                                         them; names the writer (process, host, pid)
policies/step-S/COMMITTED                                by process 0 once every process's manifest is there: every
                                                         file and each tensor's global shape, dtype and blocks

The single-writer format (`write_policy`: policy 0 written by hand, LoRA policies, which are adapters or are
gathered to process 0) still loads:

policies/step-S/weights-<attempt>.safetensors    the weights (`POLICY_WEIGHTS`), float32 or `model.publish_dtype`
policies/step-S/adapters-<attempt>.safetensors   LoRA adapters (`policy.policy_format.adapters`), LoRA runs only
policies/step-S/COMMITTED                        written last, create-if-absent (`policy.policy_format.committed`)
policies/LATEST                                  a hint: the newest step written; listing is the truth
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from levanter.models.lm_model import LmHeadModel

import policy.policy_format.adapters as adapters
import policy.policy_format.sharded as sharded
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

if TYPE_CHECKING:
    from pipeline.store.storage import RunStore

logger = logging.getLogger(__name__)


class PolicyNotFoundError(FileNotFoundError):
    """The requested policy step has no commit marker."""


def write_policy(
    store: RunStore,
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


@dataclasses.dataclass(frozen=True)
class PolicyPublish:
    """A policy ready to commit (`prepare_policy`): this process's part of it, written by `commit_policy`."""

    step: int
    sharded: sharded.ShardedPublish | None = None
    """Full weights published by every learner process (None: `single` below)."""
    single: tuple[LmHeadModel, dict[str, Any], str | None, ModelSpec | None] | None = None
    """(host model, extra, dtype, spec) that process 0 writes alone with `write_policy` (LoRA policies)."""


def prepare_policy(step: int, model: LmHeadModel, extra: dict[str, Any] | None, dtype: str | None) -> PolicyPublish:
    """Every learner process calls this for each policy in the same order (collectives: the attempt id, and the cast
    of sharded arrays to `dtype`); the arrays stay where they are (no gather). `commit_policy` then writes it."""
    extra = dict(extra or {})
    if dtype is not None and dtype not in ("float32", "fp32"):
        model = M.cast_params(model, dtype)
        extra["dtype"] = str(jnp.dtype(dtype))
    meta = {"step": step, "vocab_size": int(model.Vocab.size), "kind": "policy", **extra}
    job = sharded.prepare_publish(layout.policy_dir(step), {POLICY_WEIGHTS: model}, meta, POLICY_WEIGHTS)
    return PolicyPublish(step, sharded=job)


def single_writer_policy(
    step: int, model: LmHeadModel, extra: dict[str, Any] | None, dtype: str | None, spec: ModelSpec | None
) -> PolicyPublish:
    """A policy (host `model`, already gathered) that `commit_policy` writes with `write_policy` (call on process 0)."""
    return PolicyPublish(step, single=(model, dict(extra or {}), dtype, spec))


def commit_policy(store: RunStore, pub: PolicyPublish, wait_s: float | None = None) -> bool:
    """Write policy `pub.step` (from any thread; no collective): every learner process its own blocks on parallel
    threads, then process 0 the COMMITTED marker once every process's manifest is there (waiting at most `wait_s`,
    default `sharded.MANIFEST_WAIT_S`: else `sharded.PublishTimeoutError`), then the LATEST hint. True on the
    process that committed it; False elsewhere and when it was already committed (never replaced)."""
    if pub.single is not None:
        model, extra, dtype, spec = pub.single
        return write_policy(store, pub.step, model, extra, dtype=dtype, spec=spec)
    assert pub.sharded is not None
    created = sharded.commit_publish(store, pub.sharded, wait_s)
    if created:
        _advance_latest(store, pub.step)
    return created


def _advance_latest(store: RunStore, step: int) -> None:
    try:
        current = LatestPointer.from_json(store.get(layout.POLICY_LATEST), path=layout.POLICY_LATEST).step
    except (FileNotFoundError, RecordError):
        current = -1
    if step > current:
        store.put_unique(layout.POLICY_LATEST, LatestPointer(step=step).to_json())


def read_policy(store: RunStore, step: int, spec: ModelSpec, vocab_size: int) -> LmHeadModel:
    """Load committed policy `step`, verifying each file's size and checksum (crc32c or sha256) against its marker.

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
    if record.format == sharded.FORMAT:  # written by every learner process: files fetched in parallel, assembled
        template = _stored_dtype(M.model_template(spec, vocab_size), record)
        loaded = sharded.load_sharded(store, folder, record, {POLICY_WEIGHTS: template}, None)
        return loaded[POLICY_WEIGHTS]  # type: ignore[no-any-return]
    if POLICY_WEIGHTS not in record.files:  # published as adapters: merged into its base policy's weights
        base_step = record.extra.get("base_policy")
        if not isinstance(base_step, int) or base_step >= step:
            raise CheckpointError(f"{folder}: base_policy={base_step!r} is not an earlier policy")
        base = read_policy(store, base_step, spec, vocab_size)
        return lora.merge(adapters.read_adapters(store, folder, record, base))  # type: ignore[no-any-return]
    data = read_blob(store, folder, record, POLICY_WEIGHTS)
    template = _stored_dtype(M.model_template(spec, vocab_size), record)
    return tree_from_safetensors(template, data, source=folder)


def _stored_dtype(template: Any, record: CommitMarker) -> Any:
    """`template` with floating leaves in the dtype the policy was published in (e.g. bfloat16), if any."""
    stored = record.extra.get("dtype")
    if not isinstance(stored, str):
        return template
    dt = jnp.dtype(stored)
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, dt) if jnp.issubdtype(x.dtype, jnp.floating) else x, template
    )


def read_policy_adapters(store: RunStore, step: int, base: LmHeadModel) -> Any:
    """The loraized `base` with the adapters of committed policy `step` (for a PEFT export; not merged).

    Raises CheckpointError when the policy holds no adapters."""
    return adapters.read_adapters(store, layout.policy_dir(step), policy_metadata(store, step), base)


def policy_metadata(store: RunStore, step: int) -> CommitMarker:
    """The COMMITTED marker of policy `step` (batch slot, tokenizer, seq_len, files)."""
    return read_marker(store, layout.policy_dir(step))
