"""The compute dtype of the in-process backends: float32 on CPU, bfloat16 on an accelerator."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp


def default_compute_dtype() -> str:
    """float32 on CPU, bfloat16 on an accelerator."""
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def cast_floating(model: Any, dtype: str) -> Any:
    """`model` with floating-point array leaves cast to `dtype` (the same object for float32 leaves)."""
    dt = jnp.dtype(dtype)

    def _cast(x: Any) -> Any:
        return x.astype(dt) if eqx.is_inexact_array(x) and x.dtype != dt else x

    return jax.tree_util.tree_map(_cast, model)
