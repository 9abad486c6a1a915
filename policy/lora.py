"""LoRA for the learner and for policy readers, through levanter's `levanter.lora`.

Contracts:
  - `loraize(model, spec)` wraps the `model.lora.target_modules` linear layers of a levanter Llama / Qwen3 model
    with adapters A [r, in], B [out, r] (output `(alpha / r) · B A x` added to the layer's). A is drawn from a key
    fixed by `model.seed`; B is zero, so the loraized model computes exactly what the base model computes.
  - `split(model)` -> (adapters, base) and `combine(adapters, base)` are inverse: the learner differentiates and
    optimizes only the adapters; the base weights pass through every step untouched (bitwise).
  - `merge(model)` folds every adapter into its layer: a plain model of the base's structure, `W + (alpha/r)·BA`.
  - A policy published with `model.lora.publish: adapters` holds the blob `adapters` (the adapter tensors only) and
    in its COMMITTED marker `lora` (r, alpha, target_modules) and `base_policy` (the policy step whose weights
    are the base: 0); `load_adapter_policy` returns the merged model, so every reader sees a plain policy.
  - `save_peft(model, spec, out, base)` writes a PEFT adapter folder (`adapter_config.json`,
    `adapter_model.safetensors`, tensor names `base_model.model.<HF module>.lora_{A,B}.weight`).
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import equinox as eqx
import fsspec
import haliax as hax
import jax
from levanter import lora as llora

from pipeline.config import LoraSpec, ModelSpec
from pipeline.store import layout
from policy import checkpoints as ckpt

ADAPTERS_BLOB = "adapters"
"""The blob of a policy or checkpoint that holds the adapter tensors."""
KEY_SALT = 0x10A
"""Folded into `PRNGKey(model.seed)` for the adapters' A matrices (independent of the base weights' draw)."""
PEFT_PREFIX = "base_model.model"


def levanter_config(spec: LoraSpec) -> llora.LoraConfig:
    """levanter's `LoraConfig` for `spec` (no dropout: the train step is deterministic)."""
    return llora.LoraConfig(target_modules=list(spec.target_modules), r=spec.r, alpha=float(spec.alpha), dropout=0.0)


def adapter_key(seed: int) -> jax.Array:
    """The key the adapters of a model seeded `seed` are drawn from."""
    return jax.random.fold_in(jax.random.PRNGKey(seed), KEY_SALT)


def _zero_b(node: Any) -> Any:
    if isinstance(node, llora.LowRankLinear):
        weight = node.lora_B.weight
        return eqx.tree_at(lambda n: n.lora_B.weight, node, hax.zeros_like(weight))
    return node


@eqx.filter_jit
def _loraized(model: Any, spec: LoraSpec, key: jax.Array) -> Any:
    out = llora.loraize(model, levanter_config(spec), key=key)
    return jax.tree_util.tree_map(_zero_b, out, is_leaf=llora.is_lora_param)


def loraize(model: Any, spec: LoraSpec, seed: int) -> Any:
    """`model` with adapters on `spec.target_modules` (A seeded by `seed`, B = 0); ValueError if none matched."""
    out = _loraized(model, spec, adapter_key(seed))
    if not any(llora.is_lora_param(x) for x in jax.tree_util.tree_leaves(out, is_leaf=llora.is_lora_param)):
        raise ValueError(f"model.lora.target_modules={list(spec.target_modules)}: no linear layer matched")
    return out


def loraize_template(template: Any, spec: LoraSpec) -> Any:
    """The loraized structure of `template` (a model of ShapeDtypeStruct leaves), nothing computed."""
    return eqx.filter_eval_shape(lambda m: llora.loraize(m, levanter_config(spec), key=adapter_key(0)), template)


def is_loraized(model: Any) -> bool:
    """True when `model` holds adapter layers."""
    return any(llora.is_lora_param(x) for x in jax.tree_util.tree_leaves(model, is_leaf=llora.is_lora_param))


def split(model: Any) -> tuple[Any, Any]:
    """(adapters, base): two trees of `model`'s structure, each None where the other holds a value."""
    base, adapters = llora.partition_lora_params(model)
    return adapters, base


def combine(adapters: Any, base: Any) -> Any:
    """The model `split` took apart."""
    return llora.combine_lora_params(base, adapters)


def adapter_arrays(model: Any) -> Any:
    """The adapter tree of `model` with array leaves only (what the optimizer sees and policies store)."""
    return eqx.filter(split(model)[0], eqx.is_array)


def count_adapter_params(model: Any) -> int:
    """Scalar parameters in the adapters of `model`."""
    return int(sum(x.size for x in jax.tree_util.tree_leaves(adapter_arrays(model))))


def _merge_layer(node: Any) -> Any:
    if not isinstance(node, llora.LoraLinear):
        return node
    weight = node.wrapped.weight
    delta = node.lora.merge().rearrange(weight.axes).astype(weight.dtype)
    return eqx.tree_at(lambda n: n.weight, node.wrapped, weight + delta)


@eqx.filter_jit
def merge(model: Any) -> Any:
    """`model` with every adapter folded into its layer's weight, `W + (alpha/r)·BA` in W's axis order and dtype:
    a plain model of the base's structure (with B = 0, bitwise the base)."""
    return jax.tree_util.tree_map(_merge_layer, model, is_leaf=lambda n: isinstance(n, llora.LoraLinear))


def adapter_metadata(spec: ModelSpec) -> dict[str, Any]:
    """What a policy marker records of the adapters (`lora`) and where their base weights are (`base_policy`)."""
    assert spec.lora is not None
    lora = {"r": spec.lora.r, "alpha": float(spec.lora.alpha), "target_modules": list(spec.lora.target_modules)}
    return {"lora": lora, "base_policy": 0, "base_hf_checkpoint": spec.hf_checkpoint}


def policy_blobs(model: Any, spec: ModelSpec, step: int) -> tuple[dict[str, bytes], dict[str, Any]]:
    """(blobs, marker metadata) of policy `step` of the loraized `model` as `spec.lora.publish` says.

    `merged` (and policy 0 in either mode, the base of later ones): `weights` in the normal policy format, plus
    `adapters` so a PEFT folder can be exported. `adapters`: only `adapters`, with `lora` and `base_policy`."""
    from policy.model import POLICY_WEIGHTS

    assert spec.lora is not None
    adapters = ckpt.tree_to_safetensors(adapter_arrays(model))
    if spec.lora.publish == "adapters" and step > 0:
        return {ADAPTERS_BLOB: adapters}, adapter_metadata(spec)
    lora = adapter_metadata(spec)["lora"]
    return {POLICY_WEIGHTS: ckpt.tree_to_safetensors(merge(model)), ADAPTERS_BLOB: adapters}, {"lora": lora}


def marker_lora(extra: dict[str, Any]) -> LoraSpec | None:
    """The adapters' shape recorded in a marker's extra fields (None: the policy has no adapters blob)."""
    lora = extra.get("lora")
    if not isinstance(lora, dict):
        return None
    return LoraSpec(r=int(lora["r"]), alpha=float(lora["alpha"]), target_modules=tuple(lora["target_modules"]))


def read_adapters(store: Any, folder: str, record: Any, base: Any) -> Any:
    """The loraized `base` (a plain model) with the adapters of the committed `folder` (verified by the marker).

    Raises CheckpointError when the marker has no adapters or their tensors do not fit."""
    lora = marker_lora(record.extra)
    if lora is None or ADAPTERS_BLOB not in record.files:
        raise ckpt.CheckpointError(f"{folder}: no adapters recorded in its marker")
    structure = eqx.filter_eval_shape(lambda m: llora.loraize(m, levanter_config(lora), key=adapter_key(0)), base)
    adapter_shapes, base_shapes = split(structure)
    shapes, statics = eqx.partition(adapter_shapes, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    loaded = ckpt.tree_from_safetensors(shapes, ckpt.read_blob(store, folder, record, ADAPTERS_BLOB), source=folder)
    return combine(eqx.combine(loaded, statics), fill(base_shapes, base))


def fill(shapes: Any, model: Any) -> Any:
    """`shapes` (the base part of a loraized structure, ShapeDtypeStruct leaves) with the arrays of the plain
    `model` it was built from: wrapping a layer keeps its weights' order among the leaves."""
    slots, treedef = jax.tree_util.tree_flatten(shapes)
    arrays = jax.tree_util.tree_leaves(model)
    if len(slots) != len(arrays) or any(
        tuple(s.shape) != tuple(a.shape) or s.dtype != a.dtype for s, a in zip(slots, arrays, strict=True)
    ):
        raise ValueError("the model does not fit the loraized structure")
    return jax.tree_util.tree_unflatten(treedef, arrays)


def load_adapter_policy(store: Any, step: int, record: Any, spec: ModelSpec, vocab_size: int) -> Any:
    """Policy `step` published as adapters: its base policy's weights with the adapters merged in."""
    from policy.model import load_policy

    base_step = record.extra.get("base_policy")
    if not isinstance(base_step, int) or base_step >= step:
        raise ckpt.CheckpointError(f"{layout.policy_dir(step)}: base_policy={base_step!r} is not an earlier policy")
    base = load_policy(store, base_step, spec, vocab_size)
    return merge(read_adapters(store, layout.policy_dir(step), record, base))


def save_peft(model: Any, lora: LoraSpec, out: str, base_model_name_or_path: str | None) -> None:
    """Write a PEFT adapter folder for the adapters of the loraized `model` to `out` (local or an fsspec URL)."""
    if "://" not in out or out.startswith("file://"):
        local = out.removeprefix("file://")
        llora.save_peft_pretrained(model, levanter_config(lora), base_model_name_or_path, local, prefix=PEFT_PREFIX)
        return
    with tempfile.TemporaryDirectory() as tmp:
        llora.save_peft_pretrained(model, levanter_config(lora), base_model_name_or_path, tmp, prefix=PEFT_PREFIX)
        fs, base = fsspec.core.url_to_fs(out)
        for name in sorted(os.listdir(tmp)):
            fs.put_file(os.path.join(tmp, name), f"{base.rstrip('/')}/{name}")


# ---------------------------------------------------------------------------------------------
# what the optimizer sees: the adapters of a loraized model, every parameter of a plain one
# ---------------------------------------------------------------------------------------------


def split_trainable(model: Any) -> tuple[Any, Any]:
    """(trainable, frozen): (adapters, base) of a loraized model; (model, None) of a plain one."""
    if is_loraized(model):
        return split(model)
    return model, None


def join_trainable(trainable: Any, frozen: Any) -> Any:
    """The model `split_trainable` took apart."""
    return trainable if frozen is None else combine(trainable, frozen)


def trainable_params(model: Any) -> Any:
    """The array (or ShapeDtypeStruct) leaves the optimizer updates: the adapters of a loraized model, every
    parameter of a plain one (the tree `optimizer.init` is given and the train step updates)."""
    trainable, _ = split_trainable(model)
    return eqx.filter(trainable, lambda x: eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct))


def on_trainable(loss_fn: Any) -> Any:
    """`loss_fn(model, reference, batch)` as a function `(trainable, frozen, reference, batch)`, so that
    differentiating its first argument gives gradients of the trainable parameters only."""

    def loss(trainable: Any, frozen: Any, reference: Any, batch: Any) -> Any:
        return loss_fn(join_trainable(trainable, frozen), reference, batch)

    return loss
