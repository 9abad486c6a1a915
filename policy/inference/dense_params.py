"""A levanter Llama / Qwen2 / Qwen3 / Mistral LM head model as the dense sampler sees it: its static structure
(`DenseArch`, part of the compile key) and its weights as plain arrays (`extract_params`), read once per model.

Raises `UnsupportedModelError` naming a feature the dense sampler does not implement.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp


class UnsupportedModelError(ValueError):
    """The model has a feature the dense sampler does not implement (named in the message)."""


@dataclasses.dataclass(frozen=True)
class DenseArch:
    """The static structure of a model as the dense sampler sees it (part of the compile key)."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_dim: int
    vocab_size: int
    norm_eps: float
    qk_norm: bool
    hybrid_norm: bool
    input_embedding_norm: bool
    tied_embeddings: bool
    attn_scale: float
    compute_dtype: str


# ---------------------------------------------------------------------------------------------
# levanter model -> plain arrays
# ---------------------------------------------------------------------------------------------


def _arr(x: Any, order: tuple[str, ...], dtype: Any) -> jax.Array | None:
    """A NamedArray's data in the given axis order (an optional leading 'layer' axis kept) and dtype."""
    if x is None:
        return None
    names = tuple(a.name for a in x.axes)
    stack = [n for n in ("layer", "layers") if n in names]  # the scanned-layers axis (Mistral/Gemma: "layers")
    full = tuple(stack[:1]) + order
    if set(names) != set(full):
        raise UnsupportedModelError(f"unexpected weight axes {names}, expected {full}")
    return x.rearrange(full).array.astype(dtype)


def _norm_params(norm: Any, axis: str, dtype: Any) -> dict[str, Any] | None:
    if norm is None:
        return None
    return {"w": _arr(norm.weight, (axis,), dtype), "b": _arr(norm.bias, (axis,), dtype)}


def _layer_modules(model: Any) -> tuple[Any, bool]:
    """(the decoder layer module(s), stacked?) for scanned (Stacked) or unscanned (BlockSeq) layers."""
    layers = model.transformer.layers
    if hasattr(layers, "stacked"):
        return layers.stacked, True
    if hasattr(layers, "blocks"):
        return list(layers.blocks), False
    raise UnsupportedModelError(f"unknown layer container {type(layers).__name__}")


def dense_arch(model: Any, compute_dtype: str) -> DenseArch:
    """The `DenseArch` of a levanter Llama/Qwen3 LM head model; raises UnsupportedModelError otherwise."""
    cfg = model.config
    if not hasattr(cfg, "attention_config"):
        raise UnsupportedModelError(f"{type(model).__name__}: no attention_config (not a Llama-family model)")
    if type(cfg).__name__.startswith("Gemma"):  # scaled embeddings, (1 + w) norms: not what the sampler computes
        raise UnsupportedModelError(
            f"{type(model).__name__}: Gemma is not supported by the dense sampler "
            "(use inference type levanter or server)"
        )
    acfg = cfg.attention_config()
    if acfg.logits_soft_cap is not None:
        raise UnsupportedModelError(f"logits_soft_cap={acfg.logits_soft_cap} is not supported")
    if getattr(cfg, "use_sliding_window", False):
        raise UnsupportedModelError("sliding-window attention is not supported")
    layer, _ = _layer_modules(model)
    first = layer if not isinstance(layer, list) else layer[0]
    if first.self_attn.rot_embs is None:
        raise UnsupportedModelError("a model without rotary embeddings is not supported")
    head_dim = acfg.head_size
    return DenseArch(
        num_layers=cfg.num_layers,
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=head_dim,
        hidden_dim=cfg.hidden_dim,
        vocab_size=model.Vocab.size,
        norm_eps=float(cfg.layer_norm_epsilon),
        qk_norm=acfg.qk_norm is not None,
        hybrid_norm=bool(getattr(cfg, "hybrid_norm", False)),
        input_embedding_norm=bool(getattr(cfg, "input_embedding_norm", False)),
        tied_embeddings=model.lm_head is None,
        attn_scale=float(acfg.scaling_factor) if acfg.scaling_factor is not None else 1.0 / math.sqrt(head_dim),
        compute_dtype=str(jnp.dtype(compute_dtype)),
    )


def _rows(x: jax.Array | None, out_dims: int) -> jax.Array | None:
    """`x` [..., *out, in] (the `out_dims` output axes before the input axis) as [..., prod(out), in]."""
    if x is None:
        return None
    lead = x.shape[: x.ndim - out_dims - 1]
    return x.reshape(*lead, -1, x.shape[-1])


def _flat(x: jax.Array | None, dims: int) -> jax.Array | None:
    """`x` with its last `dims` axes as one."""
    return None if x is None else x.reshape(*x.shape[: x.ndim - dims], -1)


def _one_layer_params(layer: Any, dtype: Any) -> dict[str, Any]:
    """One layer's weights as matrices [out, in] (a leading layer axis kept) and biases as vectors [out]: the
    layout a matrix product reads without a transposed copy on every backend (on CPU, XLA transposes a weight of
    several output axes into a new buffer at every use, inside the decode loop too)."""
    p = _one_layer_named(layer, dtype)
    p["wq"], p["wk"], p["wv"] = _rows(p["wq"], 3), _rows(p["wk"], 2), _rows(p["wv"], 2)
    p["bq"], p["bk"], p["bv"] = _flat(p["bq"], 3), _flat(p["bk"], 2), _flat(p["bv"], 2)
    p["wo"] = _flat(p["wo"], 2)  # [D, heads·h]: the attention output's heads and head dims are its input
    return p


def _one_layer_named(layer: Any, dtype: Any) -> dict[str, Any]:
    att = layer.self_attn
    mlp = layer.mlp
    p: dict[str, Any] = {
        "ln1": _norm_params(layer.input_layernorm, "embed", dtype),
        "ln2": _norm_params(layer.post_attention_layernorm, "embed", dtype),
        "post_attn_ln": _norm_params(getattr(layer, "post_attn_layernorm", None), "embed", dtype),
        "post_mlp_ln": _norm_params(getattr(layer, "post_mlp_layernorm", None), "embed", dtype),
        "q_norm": _norm_params(getattr(att, "q_norm", None), "head_size", dtype),
        "k_norm": _norm_params(getattr(att, "k_norm", None), "head_size", dtype),
        "wq": _arr(att.q_proj.weight, ("kv_head", "q_heads_per_group", "head_size", "embed"), dtype),
        "bq": _arr(att.q_proj.bias, ("kv_head", "q_heads_per_group", "head_size"), dtype),
        "wk": _arr(att.k_proj.weight, ("kv_head", "head_size", "embed"), dtype),
        "bk": _arr(att.k_proj.bias, ("kv_head", "head_size"), dtype),
        "wv": _arr(att.v_proj.weight, ("kv_head", "head_size", "embed"), dtype),
        "bv": _arr(att.v_proj.bias, ("kv_head", "head_size"), dtype),
        "wo": _arr(att.o_proj.weight, ("embed", "heads", "head_size"), dtype),
        "bo": _arr(att.o_proj.bias, ("embed",), dtype),
        "w_gate": _arr(mlp.gate_proj.weight, ("mlp", "embed"), dtype),
        "b_gate": _arr(mlp.gate_proj.bias, ("mlp",), dtype),
        "w_up": _arr(mlp.up_proj.weight, ("mlp", "embed"), dtype),
        "b_up": _arr(mlp.up_proj.bias, ("mlp",), dtype),
        "w_down": _arr(mlp.down_proj.weight, ("embed", "mlp"), dtype),
        "b_down": _arr(mlp.down_proj.bias, ("embed",), dtype),
    }
    return p


@eqx.filter_jit
def _unstacked_layer_params(layer: Any, dtype: str, n: int) -> list[dict[str, Any]]:
    """`_one_layer_params` of a stacked layer module, split into its `n` layers. Compiled as one program: done
    eagerly, every slice of every weight is a program of its own to compile (or fetch from the cache) at each
    process start."""
    whole = _one_layer_params(layer, jnp.dtype(dtype))
    return [jax.tree_util.tree_map(lambda a, i=i: a[i], whole) for i in range(n)]


def extract_params(model: Any, compute_dtype: str) -> dict[str, Any]:
    """Plain-array weights of a levanter Llama/Qwen3 model, cast to `compute_dtype`, one dict per layer.

    Layers are unstacked (one buffer per layer) so the unrolled decode step reads each layer's weights
    in place. The result depends only on the weights: two models with the same config give pytrees of
    identical structure, shapes and dtypes (so swapping them never recompiles).
    """
    dtype = jnp.dtype(compute_dtype)
    layer, stacked = _layer_modules(model)
    if stacked:
        layers = _unstacked_layer_params(layer, str(dtype), model.config.num_layers)
    else:
        layers = [_one_layer_params(b, dtype) for b in layer]
    emb = model.embeddings
    return {
        "embed": _arr(emb.token_embeddings.weight, ("vocab", "embed"), dtype),
        "embed_norm": _norm_params(getattr(emb, "norm", None), "embed", dtype),
        "lm_head": None if model.lm_head is None else _arr(model.lm_head.weight, ("vocab", "embed"), dtype),
        "final_norm": _norm_params(model.transformer.norm, "embed", dtype),
        "layers": layers,
    }


def _zeros_or(b: jax.Array | None, n: int, dtype: Any) -> jax.Array:
    return jnp.zeros((n,), dtype) if b is None else b


def _cat_bias(parts: list[jax.Array | None], sizes: list[int]) -> jax.Array | None:
    """Biases concatenated like their weights' rows (a missing one as zeros); None when all are missing."""
    if all(b is None for b in parts):
        return None
    dtype = next(b.dtype for b in parts if b is not None)
    return jnp.concatenate([_zeros_or(b, n, dtype) for b, n in zip(parts, sizes, strict=True)])


def _fuse_layer(lp: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in lp.items() if k not in _FUSED_AWAY}
    wq, wk, wv = lp["wq"], lp["wk"], lp["wv"]  # [K·G·h, D], [K·h, D], [K·h, D]
    out["w_qkv"] = jnp.concatenate([wq, wk, wv])  # rows: the query heads', then the keys', then the values'
    out["b_qkv"] = _cat_bias([lp["bq"], lp["bk"], lp["bv"]], [wq.shape[0], wk.shape[0], wv.shape[0]])
    out["w_gate_up"] = jnp.concatenate([lp["w_gate"], lp["w_up"]])  # [2·M, D]
    M = lp["w_gate"].shape[0]
    out["b_gate_up"] = _cat_bias([lp["b_gate"], lp["b_up"]], [M, M])
    return out


_FUSED_AWAY = ("wq", "wk", "wv", "bq", "bk", "bv", "w_gate", "w_up", "b_gate", "b_up")


@jax.jit
def fuse_projections(params: dict[str, Any]) -> dict[str, Any]:
    """`extract_params`' weights with each layer's query, key and value projections as one weight and its gate and
    up projections as one, so that a decode step reads them in one matrix product each instead of three and two:
    `w_qkv` [K·G·h + 2·K·h, D] (the query heads' rows, then the keys', then the values'), `w_gate_up` [2·M, D].
    Same values, one copy."""
    return {**params, "layers": [_fuse_layer(lp) for lp in params["layers"]]}


def rotary_module(model: Any) -> Any:
    """The model's own levanter rotary-embedding module (of its first layer)."""
    layer, _ = _layer_modules(model)
    first = layer if not isinstance(layer, list) else layer[0]
    return first.self_attn.rot_embs


def activation(model: Any) -> Callable[[jax.Array], jax.Array]:
    """The MLP activation function of the model (of its first layer)."""
    layer, _ = _layer_modules(model)
    first = layer if not isinstance(layer, list) else layer[0]
    return first.mlp.act
