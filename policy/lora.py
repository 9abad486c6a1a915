"""LoRA for the learner and for policy readers, through levanter's `levanter.lora`.

Contracts:
  - `loraize(model, spec)` wraps the `model.lora.target_modules` linear layers of a levanter Llama / Qwen3 model
    with adapters A [r, in], B [out, r] (output `(alpha / r) · B A x` added to the layer's). A is drawn from a key
    fixed by `model.seed`; B is zero, so the loraized model computes exactly what the base model computes.
  - `split(model)` -> (adapters, base) and `combine(adapters, base)` are inverse: the learner differentiates and
    optimizes only the adapters; the base weights pass through every step untouched (bitwise).
  - `merge(model)` folds every adapter into its layer: a plain model of the base's structure, `W + (alpha/r)·BA`.
  - How adapters are stored in policies and exported as PEFT folders: `policy.policy_format.adapters`.
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import haliax as hax
import jax
from levanter import lora as llora

from pipeline.config import LoraSpec

KEY_SALT = 0x10A
"""Folded into `PRNGKey(model.seed)` for the adapters' A matrices (independent of the base weights' draw)."""


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
