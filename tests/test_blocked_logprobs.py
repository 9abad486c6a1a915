"""Logprobs and entropies computed in vocabulary blocks equal the full-logits computation (values and gradients).

Tiny llama (vocabulary 53, a block size of 8 that does not divide it), packed segments, per-token temperatures;
float32 on CPU; tolerance 1e-5 absolute on logprobs / entropies and 1e-5 relative on the gradient."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.config import ModelSpec

jax = pytest.importorskip("jax")
import equinox as eqx  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from policy import model as M  # noqa: E402

B, S, V = 3, 12, 53


@pytest.fixture(scope="module")
def case() -> tuple[object, dict[str, jax.Array]]:
    spec = ModelSpec(hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=S)
    model = M.build_model(spec, V, jax.random.PRNGKey(3))
    rng = np.random.default_rng(0)
    seg = np.zeros((B, S), np.int32)
    seg[:, 6:] = 1
    seg[0, 10:] = -1
    pos = np.where(seg == 1, np.arange(S) - 6, np.arange(S)).astype(np.int32)
    batch = {
        "tokens": jnp.asarray(rng.integers(0, V, (B, S)), jnp.int32),
        "segment_ids": jnp.asarray(seg),
        "position_ids": jnp.asarray(pos),
        "temperature": jnp.asarray(np.where(seg == 1, 0.7, 1.3), jnp.float32),
    }
    return model, batch


def _full(model: object, b: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    logits = M.forward_logits(model, b["tokens"], b["segment_ids"], b["position_ids"])  # type: ignore[arg-type]
    return M.shifted_logprobs_and_entropy(logits, b["tokens"], b["segment_ids"], b["temperature"])


def _blocked(model: object, b: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    return M.blocked_logprobs_and_entropy(
        model,  # type: ignore[arg-type]
        b["tokens"],
        b["segment_ids"],
        b["position_ids"],
        b["temperature"],
        8,
    )


def test_blocked_values_equal_full_logits(case: tuple[object, dict[str, jax.Array]]) -> None:
    model, b = case
    lp_full, ent_full = jax.jit(_full)(model, b)
    lp_blk, ent_blk = jax.jit(_blocked)(model, b)
    np.testing.assert_allclose(np.asarray(lp_blk), np.asarray(lp_full), atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(ent_blk), np.asarray(ent_full), atol=1e-5, rtol=0)
    assert float(jnp.abs(lp_full).sum()) > 1.0  # non-trivial logprobs


def test_blocked_gradient_equals_full_logits(case: tuple[object, dict[str, jax.Array]]) -> None:
    model, b = case
    weights = jnp.asarray(np.random.default_rng(1).normal(size=(B, S)), jnp.float32)

    def objective(fn: object) -> object:
        return lambda m: jnp.sum(fn(m, b)[0] * weights)  # type: ignore[operator]

    g_full = eqx.filter_jit(eqx.filter_grad(objective(_full)))(model)
    g_blk = eqx.filter_jit(eqx.filter_grad(objective(_blocked)))(model)
    for x, y in zip(jax.tree_util.tree_leaves(g_full), jax.tree_util.tree_leaves(g_blk), strict=True):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        assert np.linalg.norm(x - y) <= 1e-5 * max(np.linalg.norm(x), 1e-12)
