"""A guarded optimizer update: a non-finite loss or gradient never reaches the parameters or optimizer state."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax


def guarded_update(
    optimizer: optax.GradientTransformation, model: Any, opt_state: Any, grads: Any, loss: jax.Array
) -> tuple[Any, Any, dict[str, jax.Array]]:
    """(model', opt_state', metrics) of one optimizer step, or the inputs unchanged when it is unsafe.

    The step is skipped (parameters and optimizer state returned as given, bit for bit) when `loss` or the
    global gradient norm is not finite; metrics are `grad_norm` (as computed, possibly NaN/inf) and
    `skipped_nonfinite` (1.0 skipped, 0.0 applied). Branch-free selection, so it runs inside a jitted step."""
    grad_norm = optax.tree.norm(grads)
    ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    # zeroed gradients keep the discarded branch finite (no NaN in optimizer statistics that a later select
    # could expose); the update computed from them is then thrown away by the select below.
    safe_grads = jax.tree.map(lambda g: jnp.where(ok, g, jnp.zeros_like(g)), grads)
    params = eqx.filter(model, eqx.is_array)
    updates, new_opt_state = optimizer.update(safe_grads, opt_state, params)
    new_model = eqx.apply_updates(model, updates)

    def select(new: Any, old: Any) -> Any:
        return jnp.where(ok, new, old) if eqx.is_array(new) else new

    model = jax.tree.map(select, new_model, model)
    opt_state = jax.tree.map(select, new_opt_state, opt_state)
    metrics = {"grad_norm": grad_norm, "skipped_nonfinite": jnp.where(ok, 0.0, 1.0)}
    return model, opt_state, metrics
