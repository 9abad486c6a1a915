"""LoRA adapters on disk: the `adapters` blob of a policy and its marker fields, and PEFT adapter folders.

Contracts:
  - A policy of a loraized model published with `model.lora.publish: merged` (and policy 0 in either mode, the base
    of later ones) holds `weights` (the merged model, the normal policy format) and `adapters` (the adapter tensors
    only), and in its COMMITTED marker `lora` (r, alpha, target_modules).
  - One published with `model.lora.publish: adapters` holds only `adapters`, and in its marker `lora`,
    `base_policy` (the policy step whose weights are the base: 0) and `base_hf_checkpoint`.
  - `read_adapters` puts the stored adapters onto a plain base model: the loraized model (`policy.lora.merge` of it
    is the policy).
  - `export_peft(model, spec, out, base)` writes a PEFT adapter folder (`adapter_config.json`,
    `adapter_model.safetensors`, tensor names `base_model.model.<HF module>.lora_{A,B}.weight`).
"""

from __future__ import annotations

import os
import tempfile
from typing import TYPE_CHECKING, Any

import equinox as eqx
import fsspec
import jax
from levanter import lora as llora

from pipeline.config import LoraSpec, ModelSpec
from pipeline.store.urls import is_local, split_location
from policy import lora
from policy.policy_format.committed import (
    ADAPTERS_BLOB,
    POLICY_WEIGHTS,
    CheckpointError,
    read_blob,
    tree_from_safetensors,
    tree_to_safetensors,
)

if TYPE_CHECKING:
    from pipeline.store.storage import RunStore

PEFT_PREFIX = "base_model.model"


def adapter_metadata(spec: ModelSpec) -> dict[str, Any]:
    """What a policy marker records of the adapters (`lora`) and where their base weights are (`base_policy`)."""
    assert spec.lora is not None
    shape = {"r": spec.lora.r, "alpha": float(spec.lora.alpha), "target_modules": list(spec.lora.target_modules)}
    return {"lora": shape, "base_policy": 0, "base_hf_checkpoint": spec.hf_checkpoint}


def policy_blobs(model: Any, spec: ModelSpec, step: int) -> tuple[dict[str, bytes], dict[str, Any]]:
    """(blobs, marker metadata) of policy `step` of the loraized `model` as `spec.lora.publish` says.

    `merged` (and policy 0 in either mode, the base of later ones): `weights` in the normal policy format, plus
    `adapters` so a PEFT folder can be exported. `adapters`: only `adapters`, with `lora` and `base_policy`."""
    assert spec.lora is not None
    adapters = tree_to_safetensors(lora.adapter_arrays(model))
    if spec.lora.publish == "adapters" and step > 0:
        return {ADAPTERS_BLOB: adapters}, adapter_metadata(spec)
    shape = adapter_metadata(spec)["lora"]
    return {POLICY_WEIGHTS: tree_to_safetensors(lora.merge(model)), ADAPTERS_BLOB: adapters}, {"lora": shape}


def marker_lora(extra: dict[str, Any]) -> LoraSpec | None:
    """The adapters' shape recorded in a marker's extra fields (None: the policy has no adapters blob)."""
    shape = extra.get("lora")
    if not isinstance(shape, dict):
        return None
    return LoraSpec(r=int(shape["r"]), alpha=float(shape["alpha"]), target_modules=tuple(shape["target_modules"]))


def read_adapters(store: RunStore, folder: str, record: Any, base: Any) -> Any:
    """The loraized `base` (a plain model) with the adapters of the committed `folder` (verified by the marker).

    Raises CheckpointError when the marker has no adapters or their tensors do not fit."""
    spec = marker_lora(record.extra)
    if spec is None or ADAPTERS_BLOB not in record.files:
        raise CheckpointError(f"{folder}: no adapters recorded in its marker")
    structure = lora.loraize_template(base, spec)
    adapter_shapes, base_shapes = lora.split(structure)
    shapes, statics = eqx.partition(adapter_shapes, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    loaded = tree_from_safetensors(shapes, read_blob(store, folder, record, ADAPTERS_BLOB), source=folder)
    return lora.combine(eqx.combine(loaded, statics), _fill(base_shapes, base))


def _fill(shapes: Any, model: Any) -> Any:
    """`shapes` (the base part of a loraized structure, ShapeDtypeStruct leaves) with the arrays of the plain
    `model` it was built from: wrapping a layer keeps its weights' order among the leaves."""
    slots, treedef = jax.tree_util.tree_flatten(shapes)
    arrays = jax.tree_util.tree_leaves(model)
    if len(slots) != len(arrays) or any(
        tuple(s.shape) != tuple(a.shape) or s.dtype != a.dtype for s, a in zip(slots, arrays, strict=True)
    ):
        raise ValueError("the model does not fit the loraized structure")
    return jax.tree_util.tree_unflatten(treedef, arrays)


def export_peft(model: Any, spec: LoraSpec, out: str, base_model_name_or_path: str | None) -> None:
    """Write a PEFT adapter folder for the adapters of the loraized `model` to `out` (local or an fsspec URL)."""
    config = lora.levanter_config(spec)
    if is_local(out):
        local = split_location(out)[1]
        llora.save_peft_pretrained(model, config, base_model_name_or_path, local, prefix=PEFT_PREFIX)
        return
    with tempfile.TemporaryDirectory() as tmp:
        llora.save_peft_pretrained(model, config, base_model_name_or_path, tmp, prefix=PEFT_PREFIX)
        fs, root = fsspec.core.url_to_fs(out)
        for name in sorted(os.listdir(tmp)):
            fs.put_file(os.path.join(tmp, name), f"{root.rstrip('/')}/{name}")
