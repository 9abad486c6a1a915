"""top-p / top-k / min-p: the dense sampler's truncation rule against a numpy reference (which tokens may be
sampled), sampled tokens stay inside that support, recorded logprobs stay the untruncated teacher-forced ones,
and backends that cannot apply a control refuse it."""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipeline.config import DenseInferenceConfig, ModelSpec, SamplingParams
from pipeline.config.base import ConfigError
from pipeline.environments.tokenizer import load_tokenizer
from policy.inference import GenerationRequest, make_backend
from policy.inference.base import SamplingControls
from policy.inference.dense_sampler import truncate_logits
from policy.model import build_model, forward_logits, model_vocab_size

SPEC = ModelSpec(hidden_dim=32, intermediate_dim=64, num_layers=1, num_heads=2, num_kv_heads=2, max_seq_len=48)


def reference_support(z: np.ndarray, top_p: float, top_k: int, min_p: float) -> np.ndarray:
    """The tokens each rule allows, computed the slow obvious way (one row)."""
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    keep = np.ones_like(p, bool)
    if top_k > 0:
        keep &= p >= p[order[min(top_k, len(p)) - 1]]
    if top_p < 1:
        mass, nucleus = 0.0, []
        for i in order:
            if mass >= top_p:
                break
            nucleus.append(i)
            mass += p[i]
        keep &= p >= p[nucleus[-1]]
    keep &= p >= min_p * p.max()
    keep[order[0]] = True
    return keep


@pytest.mark.parametrize(
    "top_p,top_k,min_p", [(1.0, 0, 0.0), (1.0, 5, 0.0), (0.5, 0, 0.0), (0.9, 0, 0.0), (1.0, 0, 0.2), (0.8, 7, 0.05)]
)
def test_truncation_support_matches_the_rule(top_p: float, top_k: int, min_p: float) -> None:
    rng = np.random.default_rng(0)
    z = rng.normal(size=(6, 40)).astype(np.float32) * 2.0
    got = np.asarray(truncate_logits(jnp.asarray(z), jnp.float32(top_p), jnp.int32(top_k), jnp.float32(min_p)))
    for row in range(z.shape[0]):
        want = reference_support(z[row], top_p, top_k, min_p)
        np.testing.assert_array_equal(np.isfinite(got[row]), want)
        np.testing.assert_array_equal(got[row][want], z[row][want])
    if top_k:
        assert (np.isfinite(got).sum(axis=-1) <= top_k).all()


@pytest.fixture(scope="module")
def setup() -> Any:
    tokenizer = load_tokenizer("builtin:tiny")
    model = build_model(SPEC, model_vocab_size(tokenizer), key=jax.random.PRNGKey(1))
    backend = make_backend(DenseInferenceConfig(max_seqs=16), model, tokenizer, SPEC.max_seq_len, fast_compile=True)
    yield tokenizer, model, backend
    backend.shutdown()


def test_dense_samples_only_inside_the_support_and_records_untruncated_logprobs(setup: Any) -> None:
    tokenizer, model, backend = setup
    prompt = [tokenizer.bos_token_id, *tokenizer.encode("give me moar cats")]
    controls = SamplingControls(top_k=3)
    out = backend.generate(GenerationRequest([prompt], 16, 1.5, 1, [], 0, controls))
    # the next-token distribution; one jitted forward (not op by op: a program per operation)
    logits = np.asarray(eqx.filter_jit(forward_logits)(model, jnp.asarray([prompt])))[0, -1] / 1.5
    top3 = set(np.argsort(-logits)[:3].tolist())
    firsts = {c.tokens[0] for c in out[0]}
    assert firsts <= top3 and len(firsts) >= 2
    full = logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
    for c in out[0]:
        np.testing.assert_allclose(c.logprobs[0], full[c.tokens[0]], atol=1e-4)
    # without controls, 16 samples at T=1.5 leave the top 3
    free = backend.generate(GenerationRequest([prompt], 16, 1.5, 1, [], 0))
    assert {c.tokens[0] for c in free[0]} - top3


def test_controls_are_validated_where_configured() -> None:
    with pytest.raises(ValueError, match="top_p"):
        SamplingControls(top_p=0.0)
    with pytest.raises(ValueError, match="top_k"):
        SamplingControls(top_k=-1)
    with pytest.raises(ConfigError, match="min_p"):
        SamplingParams(min_p=1.5)
