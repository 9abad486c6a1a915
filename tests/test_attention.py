"""The fused attention route (`model.attention_backend: cudnn`): same logprobs and gradients as levanter's own
attention on packed rows, segments kept apart, and actually taken (XLA's implementation of the same function
runs it on CPU; cuDNN's kernel on a GPU is measured by `make bench-gpu`)."""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipeline.config import ConfigError, ModelSpec

pytest.importorskip("jax")

from policy import learner as L
from policy import model as M
from policy.losses import Batch

VOCAB, B, S = 64, 3, 16


def packed_batch(seed: int = 0) -> Batch:
    """Rows holding two sequences (segments 0 and 1) and trailing padding (segment -1)."""
    rng = np.random.default_rng(seed)
    seg = np.full((B, S), -1, np.int32)
    pos = np.zeros((B, S), np.int32)
    for r, (a, b) in enumerate([(5, 7), (9, 4), (16, 0)]):
        seg[r, :a], pos[r, :a] = 0, np.arange(a)
        seg[r, a : a + b], pos[r, a : a + b] = 1, np.arange(b)
    zeros = jnp.zeros((B, S), jnp.float32)
    rows = np.arange(B, dtype=np.int32)[:, None]
    return Batch(
        tokens=jnp.asarray(rng.integers(0, VOCAB, (B, S)).astype(np.int32)),
        segment_ids=jnp.asarray(seg),
        position_ids=jnp.asarray(pos),
        loss_mask=zeros,
        advantages=zeros,
        generator_logprobs=zeros,
        temperature=jnp.ones((B, S), jnp.float32),
        truncated=jnp.zeros((B, S), bool),
        seq_index=jnp.asarray(np.where(seg >= 0, rows * S + seg, B * S).astype(np.int32)),
    )


@pytest.fixture(scope="module")
def model():
    return M.build_model(ModelSpec(num_heads=4, num_kv_heads=2, max_seq_len=S), VOCAB)


def test_fused_route_matches_levanter_attention_in_values_and_gradients(model) -> None:
    """Each route's logprobs and gradient as one jitted program each (as the learner runs them), not op by op
    (measured, the file on a cold cache: 165 programs compiled op by op, 28 jitted)."""
    batch = packed_batch()
    plain, fused = L.make_logprob_fn("float32"), L.make_logprob_fn("float32", attention="cudnn")
    valid = np.asarray(batch.segment_ids) >= 0
    lp0, ent0 = eqx.filter_jit(plain)(model, batch)
    lp1, ent1 = eqx.filter_jit(fused)(model, batch)
    np.testing.assert_allclose(np.asarray(lp1)[valid], np.asarray(lp0)[valid], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(ent1)[valid], np.asarray(ent0)[valid], rtol=1e-5, atol=1e-5)

    def total(fn):
        return lambda m: jnp.sum(jnp.where(valid, fn(m, batch)[0], 0.0))

    g0 = eqx.filter_jit(eqx.filter_grad(total(plain)))(model)
    g1 = eqx.filter_jit(eqx.filter_grad(total(fused)))(model)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1), strict=True):
        # float32 summation-order noise scales with the leaf's largest entries (up to ~45 here): absolute
        # tolerance 1e-6 of that scale (seen: 1.6e-5 on an entry of 0.025 in a leaf whose largest is 44)
        scale = float(np.abs(np.asarray(a)).max())
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=max(1e-5, 1e-6 * scale))


def test_fused_route_is_taken_and_keeps_segments_apart(model, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[str, tuple[int, ...] | None]] = []
    real = jax.nn.dot_product_attention

    def watched(q, k, v, bias=None, *a, implementation=None, **kw):  # JAX's function, observed, not replaced
        seen.append((implementation, None if bias is None else bias.shape))
        return real(q, k, v, bias, *a, implementation=implementation, **kw)

    monkeypatch.setattr(jax.nn, "dot_product_attention", watched)
    fused = L.make_logprob_fn("float32", attention="cudnn")
    batch = packed_batch()
    jax.make_jaxpr(lambda m: L.make_logprob_fn("float32")(m, batch))(model)
    assert seen == []  # levanter's own attention outside the fused route
    jax.make_jaxpr(lambda m: fused(m, batch))(model)
    assert seen == [("xla", (B, 1, S, S))]  # one scanned attention, XLA's implementation on CPU, segment bias
    # a different first sequence in row 0 leaves the second sequence's logprobs unchanged
    other = dataclasses.replace(batch, tokens=batch.tokens.at[0, :5].set((batch.tokens[0, :5] + 1) % VOCAB))
    second = slice(5, 12)
    run = eqx.filter_jit(fused)  # one program for both batches (same shapes), not op by op
    lp_other, lp_batch = np.asarray(run(model, other)[0]), np.asarray(run(model, batch)[0])
    np.testing.assert_allclose(lp_other[0, second], lp_batch[0, second], atol=1e-6)
    assert not np.allclose(lp_other[0, :5], lp_batch[0, :5])


def test_unknown_attention_backend_is_refused_naming_the_field() -> None:
    with pytest.raises(ConfigError, match=r"model\.attention_backend"):
        ModelSpec(attention_backend="flashy")
