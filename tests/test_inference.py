"""Inference backends (policy/inference/: dense, levanter_engine, dense_sampler) on a tiny levanter model, CPU float32.

What is checked, for the dense sampler and levanter's InferenceEngine alike:
- logprobs of the generated tokens equal teacher-forced logprobs of the same model (levanter forward
  on prompt + response, log_softmax(logits / T)) within 1e-4, at T = 1, T = 0.7 and greedy;
- greedy dense tokens equal greedy engine tokens;
- stop tokens end a completion and are included ("stop"); max_tokens gives "length"; n per prompt;
- every sample comes back non-empty or a GenerationError names it;
- the dense sampler traces once per shape: not again on a second call, nor after update_model.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipeline.config import DenseInferenceConfig, LevanterInferenceConfig, ModelSpec
from pipeline.environments.tokenizer import load_tokenizer
from policy.inference import (
    BackendContext,
    GenerationError,
    GenerationRequest,
    InferenceBackend,
    PromptTooLongError,
    make_backend,
)
from policy.inference.dense import DenseBackend
from policy.inference.levanter_engine import LevanterEngineBackend
from policy.model import build_model, teacher_forced_logprobs

VOCAB = 512
MAX_SEQ_LEN = 64
PROMPTS = [[1, 40, 41, 42, 43], [1, 7], [1, 2, 3, 4, 5, 6, 7, 8]]
SPEC = ModelSpec(hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=MAX_SEQ_LEN)
TF_LEN = 32


class CompileCounter:
    """Counts XLA backend compiles while active (jax.monitoring events)."""

    def __init__(self) -> None:
        self.count = 0
        self.active = False
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, name: str, _duration: float, **_kw: object) -> None:
        if self.active and name == "/jax/core/compile/backend_compile_duration":
            self.count += 1

    def __enter__(self) -> CompileCounter:
        self.count, self.active = 0, True
        return self

    def __exit__(self, *exc: object) -> None:
        self.active = False


_COUNTER = CompileCounter()


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer("builtin:tiny")


@pytest.fixture(scope="module")
def model() -> Any:
    return build_model(SPEC, VOCAB, key=jax.random.PRNGKey(0))


@pytest.fixture(scope="module")
def dense(model, tokenizer) -> Iterator[DenseBackend]:
    # static batches (the default on an accelerator); continuous batching gives the same samples
    # (tests/test_continuous_batching.py) and is what the jobs of this suite use on CPU
    config = DenseInferenceConfig(max_seqs=8, continuous_batching=False)
    b = make_backend(config, model, tokenizer, MAX_SEQ_LEN, fast_compile=True)
    assert isinstance(b, DenseBackend)
    yield b
    b.shutdown()


@pytest.fixture(scope="module")
def engine(model, tokenizer) -> Iterator[LevanterEngineBackend]:
    b = make_backend(LevanterInferenceConfig(max_seqs=8, page_size=8), model, tokenizer, MAX_SEQ_LEN)
    assert isinstance(b, LevanterEngineBackend)
    yield b
    b.shutdown()


def tf_logprobs(model, prompts, completions, temperature: float) -> list[np.ndarray]:
    """Teacher-forced logprobs of each completion's tokens (levanter forward on prompt + response)."""
    rows, spans = [], []
    for p, comps in zip(prompts, completions, strict=True):
        for c in comps:
            seq = list(p) + list(c.tokens)
            assert len(seq) <= TF_LEN
            rows.append(seq + [0] * (TF_LEN - len(seq)))
            spans.append((len(p), len(seq)))
    lp = np.asarray(teacher_forced_logprobs(model, jnp.asarray(rows, jnp.int32), temperature=temperature))
    return [lp[i, a:b] for i, (a, b) in enumerate(spans)]


def assert_logprobs_match(model, prompts, out, temperature: float, atol: float = 1e-4) -> None:
    expected = tf_logprobs(model, prompts, out, temperature if temperature > 0 else 1.0)
    got = [np.asarray(c.logprobs) for comps in out for c in comps]
    for e, g in zip(expected, got, strict=True):
        np.testing.assert_allclose(g, e, atol=atol, rtol=0)


def check_shape(out, prompts, n: int, max_tokens: int) -> None:
    assert len(out) == len(prompts)
    for comps in out:
        assert len(comps) == n
        for c in comps:
            assert 1 <= len(c.tokens) <= max_tokens
            assert len(c.logprobs) == len(c.tokens)
            assert c.finish_reason in ("stop", "length")
            assert all(0 <= t < VOCAB for t in c.tokens)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
@pytest.mark.parametrize("backend", ["dense", "engine"])
def test_logprobs_equal_teacher_forced(request, model, backend: str, temperature: float) -> None:
    b: InferenceBackend = request.getfixturevalue(backend)
    out = b.generate(GenerationRequest(PROMPTS, n=2, temperature=temperature, max_tokens=12, stop_tokens=[], seed=3))
    check_shape(out, PROMPTS, 2, 12)
    assert all(len(c.tokens) == 12 and c.finish_reason == "length" for comps in out for c in comps)
    assert_logprobs_match(model, PROMPTS, out, temperature)


def test_greedy_dense_equals_engine(dense, engine) -> None:
    a = dense.generate(GenerationRequest(PROMPTS, n=2, temperature=0.0, max_tokens=12, stop_tokens=[], seed=0))
    b = engine.generate(GenerationRequest(PROMPTS, n=2, temperature=0.0, max_tokens=12, stop_tokens=[], seed=1))
    assert [c.tokens for comps in a for c in comps] == [c.tokens for comps in b for c in comps]


@pytest.mark.parametrize("backend", ["dense", "engine"])
def test_stop_token_ends_and_is_included(request, model, backend: str) -> None:
    b: InferenceBackend = request.getfixturevalue(backend)
    free = b.generate(GenerationRequest(PROMPTS, n=2, temperature=0.0, max_tokens=12, stop_tokens=[], seed=0))
    # stop at the 4th greedy token of prompt 0 (pick one that did not occur earlier in that completion)
    toks = free[0][0].tokens
    k = next(i for i in range(3, 12) if toks[i] not in toks[:i])
    stop = toks[k]
    out = b.generate(GenerationRequest(PROMPTS, n=2, temperature=0.0, max_tokens=12, stop_tokens=[stop, 511], seed=0))
    c = out[0][0]
    assert c.tokens == toks[: k + 1] and c.finish_reason == "stop"
    for comps, ref in zip(out, free, strict=True):
        r = ref[0].tokens
        cut = r.index(stop) + 1 if stop in r else len(r)
        assert comps[0].tokens == r[:cut]
        assert comps[0].finish_reason == ("stop" if stop in r else "length")
    assert_logprobs_match(model, PROMPTS, out, 0.0)


@pytest.mark.parametrize("backend", ["dense", "engine"])
def test_max_tokens_and_n(request, backend: str) -> None:
    b: InferenceBackend = request.getfixturevalue(backend)
    out = b.generate(GenerationRequest(PROMPTS[:2], n=3, temperature=1.0, max_tokens=5, stop_tokens=[], seed=11))
    check_shape(out, PROMPTS[:2], 3, 5)
    assert all(len(c.tokens) == 5 and c.finish_reason == "length" for comps in out for c in comps)
    # different samples of one prompt use different PRNG streams
    assert len({tuple(c.tokens) for c in out[0]}) > 1
    # same seed: same samples
    again = b.generate(GenerationRequest(PROMPTS[:2], n=3, temperature=1.0, max_tokens=5, stop_tokens=[], seed=11))
    assert [[c.tokens for c in comps] for comps in again] == [[c.tokens for c in comps] for comps in out]


@pytest.mark.parametrize("backend", ["dense", "engine"])
def test_budget_cut_at_max_seq_len_and_too_long_prompts(request, backend: str) -> None:
    b: InferenceBackend = request.getfixturevalue(backend)
    long_prompt = [1] + [5] * (MAX_SEQ_LEN - 4)  # room for 3 tokens
    out = b.generate(GenerationRequest([long_prompt], n=1, temperature=1.0, max_tokens=12, stop_tokens=[], seed=0))
    assert len(out[0][0].tokens) == 3 and out[0][0].finish_reason == "length"
    with pytest.raises(PromptTooLongError, match="prompt 1 has 64 tokens"):
        b.generate(
            GenerationRequest([[1, 2], [1] * MAX_SEQ_LEN], n=1, temperature=1.0, max_tokens=4, stop_tokens=[], seed=0)
        )
    with pytest.raises(ValueError, match="prompt 0 is empty"):
        b.generate(GenerationRequest([[]], n=1, temperature=1.0, max_tokens=4, stop_tokens=[], seed=0))
    with pytest.raises(ValueError, match="outside"):
        b.generate(GenerationRequest([[1, VOCAB]], n=1, temperature=1.0, max_tokens=4, stop_tokens=[], seed=0))


def test_dense_compiles_once_per_shape_and_not_on_update_model(dense, model) -> None:
    kwargs = dict(n=2, temperature=1.0, max_tokens=12, stop_tokens=[], seed=5)
    first = dense.generate(GenerationRequest(PROMPTS, **kwargs))
    traces = dense.trace_count
    with _COUNTER as c:
        again = dense.generate(GenerationRequest(PROMPTS, **kwargs))
        # other runtime values, same shape buckets: no compile either
        dense.generate(GenerationRequest(PROMPTS[:2], n=3, temperature=0.3, max_tokens=10, stop_tokens=[2], seed=6))
    assert dense.trace_count == traces and c.count == 0
    assert [[x.tokens for x in g] for g in again] == [[x.tokens for x in g] for g in first]

    other = build_model(SPEC, VOCAB, key=jax.random.PRNGKey(1))
    dense.update_model(other)
    try:
        with _COUNTER as c:
            swapped = dense.generate(GenerationRequest(PROMPTS, **kwargs))
        assert dense.trace_count == traces and c.count == 0
        assert [[x.tokens for x in g] for g in swapped] != [[x.tokens for x in g] for g in first]
        assert_logprobs_match(other, PROMPTS, swapped, 1.0)
    finally:
        dense.update_model(model)


def test_engine_update_model_uses_new_weights_without_compiling(engine, model) -> None:
    kwargs = dict(n=1, temperature=0.0, max_tokens=12, stop_tokens=[], seed=0)
    first = engine.generate(GenerationRequest(PROMPTS, **kwargs))
    other = build_model(SPEC, VOCAB, key=jax.random.PRNGKey(1))
    engine.update_model(other)
    try:
        with _COUNTER as c:
            swapped = engine.generate(GenerationRequest(PROMPTS, **kwargs))
        assert c.count == 0
        assert [g[0].tokens for g in swapped] != [g[0].tokens for g in first]
        assert_logprobs_match(other, PROMPTS, swapped, 0.0)
    finally:
        engine.update_model(model)


def test_engine_missing_samples_are_retried_then_reported(engine, monkeypatch) -> None:
    calls: list[int] = []
    real = LevanterEngineBackend._run_chunk

    def flaky(self, rows, temperature, stops, seed):
        got = real(self, rows, temperature, stops, seed)
        calls.append(len(rows))
        if len(calls) == 1:
            got[1] = None  # the engine "silently" returned an empty output once
        return got

    monkeypatch.setattr(LevanterEngineBackend, "_run_chunk", flaky)
    out = engine.generate(GenerationRequest(PROMPTS, n=1, temperature=0.0, max_tokens=4, stop_tokens=[], seed=0))
    assert calls == [3, 1] and all(len(g) == 1 and g[0].tokens for g in out)

    def broken(self, rows, temperature, stops, seed):
        return [None if r.prompt_index == 2 else real(self, [r], temperature, stops, seed)[0] for r in rows]

    monkeypatch.setattr(LevanterEngineBackend, "_run_chunk", broken)
    with pytest.raises(GenerationError) as err:
        engine.generate(GenerationRequest(PROMPTS, n=2, temperature=0.0, max_tokens=4, stop_tokens=[], seed=0))
    assert err.value.missing == [(2, 0), (2, 1)]


def test_context_adapter_defaults_stop_to_eos(dense, tokenizer) -> None:
    ctx = BackendContext(tokenizer, dense)
    assert dense._resolve_stops(None) == [tokenizer.eos_token_id]
    out = ctx.generate(GenerationRequest(PROMPTS, n=2, temperature=1.0, max_tokens=12, stop_tokens=None, seed=0))
    for comps in out:
        c = comps[0]
        assert tokenizer.eos_token_id not in c.tokens[:-1]
        assert c.finish_reason == ("stop" if c.tokens[-1] == tokenizer.eos_token_id else "length")


def test_dense_qwen3_qk_norm_logprobs(tokenizer) -> None:
    spec = ModelSpec(
        family="qwen3",
        hidden_dim=32,
        intermediate_dim=64,
        num_layers=1,
        num_heads=4,
        num_kv_heads=1,
        max_seq_len=MAX_SEQ_LEN,
    )
    qwen = build_model(spec, VOCAB, key=jax.random.PRNGKey(2))
    assert qwen.transformer.layers.stacked.self_attn.q_norm is not None
    b = make_backend(DenseInferenceConfig(max_seqs=8), qwen, tokenizer, MAX_SEQ_LEN, fast_compile=True)
    out = b.generate(GenerationRequest(PROMPTS, n=2, temperature=1.0, max_tokens=12, stop_tokens=[], seed=3))
    assert_logprobs_match(qwen, PROMPTS, out, 1.0)


@pytest.mark.slow
def test_dense_bf16_close_to_float32_teacher_forced(model, tokenizer) -> None:
    b = make_backend(DenseInferenceConfig(max_seqs=8), model, tokenizer, MAX_SEQ_LEN, compute_dtype="bfloat16")
    out = b.generate(GenerationRequest(PROMPTS, n=2, temperature=1.0, max_tokens=12, stop_tokens=[], seed=3))
    assert_logprobs_match(model, PROMPTS, out, 1.0, atol=5e-2)


@pytest.mark.slow
def test_dense_samples_do_not_depend_on_chunking(dense, model, tokenizer) -> None:
    """6 samples in 3 chunks of 2 sequences equal the same samples in one chunk (the module's 8-slot sampler)."""
    kwargs = dict(n=2, temperature=1.0, max_tokens=6, stop_tokens=[], seed=9)
    small = make_backend(DenseInferenceConfig(max_seqs=2), model, tokenizer, MAX_SEQ_LEN)
    assert len(PROMPTS) * kwargs["n"] <= dense.max_seqs
    a, b = small.generate(GenerationRequest(PROMPTS, **kwargs)), dense.generate(GenerationRequest(PROMPTS, **kwargs))
    assert [[c.tokens for c in g] for g in a] == [[c.tokens for c in g] for g in b]
