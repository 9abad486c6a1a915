"""The dense sampler sized from config: `inference.max_seq_len` (validated against the model's) caps prompt +
completion and so the KV cache; `inference.compute_dtype` picks its dtype (bfloat16 runs; auto is float32 on CPU)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import pytest

from pipeline.config import ConfigError, DenseInferenceConfig, ModelSpec
from pipeline.config.validate import check_inference_fits_model
from pipeline.environments.tokenizer import load_tokenizer
from policy.inference import GenerationRequest, PromptTooLongError, make_backend
from policy.inference.dense import DenseBackend
from policy.model import build_model

SPEC = ModelSpec(hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=64)


@pytest.fixture(scope="module")
def model() -> Any:
    return build_model(SPEC, 512, key=jax.random.PRNGKey(0))


def test_config_fields_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"inference\.max_seq_len=1"):
        DenseInferenceConfig(max_seq_len=1)
    with pytest.raises(ConfigError, match=r"inference\.compute_dtype='int8'"):
        DenseInferenceConfig(compute_dtype="int8")
    check_inference_fits_model(DenseInferenceConfig(max_seq_len=64), SPEC)
    with pytest.raises(ConfigError, match=r"inference\.max_seq_len=65: exceeds model\.max_seq_len=64"):
        check_inference_fits_model(DenseInferenceConfig(max_seq_len=65), SPEC)


def test_max_seq_len_and_dtype_from_config(model: Any) -> None:
    tok = load_tokenizer("builtin:tiny")  # a longer max_seq_len is refused at program start (test above)
    auto = make_backend(
        DenseInferenceConfig(compute_dtype="auto"), model, tok, SPEC.max_seq_len, compute_dtype="bfloat16"
    )
    assert isinstance(auto, DenseBackend) and auto.compute_dtype == "float32" and auto.max_seq_len == 64  # CPU
    b = make_backend(DenseInferenceConfig(max_seqs=4, max_seq_len=24, compute_dtype="bfloat16"), model, tok, 64,
                     fast_compile=True)  # fmt: skip
    assert isinstance(b, DenseBackend) and (b.max_seq_len, b.compute_dtype) == (24, "bfloat16")
    try:
        with pytest.raises(PromptTooLongError):
            b.generate(GenerationRequest([[1] * 24], n=1, temperature=1.0, max_tokens=4, stop_tokens=[], seed=0))
        out = b.generate(GenerationRequest([[1] * 20, [1] * 17], n=2, temperature=1.0, max_tokens=16, stop_tokens=[],
                                           seed=0))  # fmt: skip
        assert [len(c.tokens) for c in out[0]] == [4, 4] and [len(c.tokens) for c in out[1]] == [7, 7]
        assert all(c.finish_reason == "length" for cs in out for c in cs)
        assert all(np.isfinite(c.logprobs).all() and max(c.logprobs) <= 0 for cs in out for c in cs)
        # layers × (K, V) × batch × (prompt bucket + token bucket) × kv heads × head dim × 2 bytes (bfloat16)
        assert b.kv_cache_bytes(4, 32, 16) == 2 * 2 * 4 * 48 * 2 * 8 * 2
    finally:
        b.shutdown()
