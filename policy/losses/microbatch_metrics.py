"""How a batch slot's metrics combine from its microbatches' (gradient accumulation,
`policy.sharding.microbatch`): counts summed, maxima maximised, every mean weighted by its own denominator, so each
metric equals the unsplit slot's for any microbatch size."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

Array = jax.Array

_SUMMED = frozenset({"loss_tokens", "loss_sequences", "kept_tokens", "kept_sequences", "clamped_count"})
"""Counts: summed over microbatches."""
_MAXED = frozenset({"mismatch_abs_logp_max"})
"""Maxima: the largest over microbatches."""
_LOSS_MEANS = frozenset({"loss", "pg_loss", "kl"})
"""Means with the loss's aggregation denominator."""
_SEQUENCE_MEANS = frozenset(
    {"mismatch_seq_abs_logp_mean", "mismatch_seq_abs_logp_max", "mismatch_seq_abs_log_ratio", "mis_masked_seq_fraction"}
)
"""Means over sequences with loss tokens."""
POLICY_MEANS = frozenset(
    {"ratio_mean", "clip_fraction", "dual_clip_fraction", "tis_weight_mean", "is_weight_mean", "clamped_fraction"}
)
"""The policy term's means: over the tokens it kept (over sequences for GSPO)."""


def normaliser(name: str, *, kept: bool, sequences: bool) -> str:
    """How metric `name` of an RL loss module's microbatches combines into the slot's: "sum" (a count), "max", or
    the name of the count metric that is its mean's denominator (each microbatch's value weighted by its own count).

    `loss`, `pg_loss` and `kl` are means over the loss's own denominator (kept tokens or sequences: `kept` with
    masked IS, `sequences` with sequence aggregation); the policy term's token metrics over the tokens it kept; the
    rest over all loss tokens or sequences."""
    if name in _SUMMED:
        return "sum"
    if name in _MAXED:
        return "max"
    if name in _LOSS_MEANS:
        if sequences:
            return "kept_sequences" if kept else "loss_sequences"
        return "kept_tokens" if kept else "loss_tokens"
    if name in _SEQUENCE_MEANS:
        return "loss_sequences"
    if name in POLICY_MEANS:
        return "kept_tokens" if kept else "loss_tokens"
    return "loss_tokens"


def metric_normaliser(module: Any, name: str) -> str:
    """`module.metric_normaliser(name)`; for a module without one (SFT: token means only), "sum" for the counts
    and "loss_tokens" for the rest."""
    fn = getattr(module, "metric_normaliser", None)
    if fn is not None:
        return str(fn(name))
    return "sum" if name in _SUMMED else "loss_tokens"


def loss_weight(module: Any, metrics: dict[str, Array]) -> Array:
    """The denominator of the loss of one microbatch, read from its metrics (the count named by
    `metric_normaliser(module, "loss")`): the microbatch's share of the slot's loss is this over the sum."""
    return metrics[metric_normaliser(module, "loss")]


def combine_microbatch_metrics(module: Any, pieces: list[dict[str, Array]]) -> dict[str, Array]:
    """The slot's metrics from its microbatches': counts summed, maxima maximised, every mean weighted by its own
    denominator (`metric_normaliser`), so each metric equals the unsplit slot's for any microbatch size."""
    out: dict[str, Array] = {}
    for name in pieces[0]:
        kind = metric_normaliser(module, name)
        values = [m[name] for m in pieces]
        if kind == "sum":
            out[name] = sum(values[1:], values[0])
        elif kind == "max":
            out[name] = jnp.max(jnp.stack(values))
        else:
            weights = [m[kind] for m in pieces]
            total = sum(weights[1:], weights[0])
            out[name] = sum((v * w for v, w in zip(values, weights, strict=True)), jnp.zeros(())) / jnp.maximum(
                total, 1.0
            )
    return out
