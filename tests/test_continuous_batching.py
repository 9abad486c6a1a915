"""Continuous batching and shared group prefixes in the dense sampler (policy/inference/continuous.py), CPU float32.

What is checked, on a tiny levanter Llama with 4 slots (so slots refill within one call):
- continuous and static batching return the same samples: greedy tokens identical, sampled (T = 1) tokens identical
  with logprobs within 1e-4, and both within 1e-4 of the learner's teacher-forced logprobs;
- rows with mixed budgets and stop tokens: each ends where the static path ends it (budget or stop token, included);
- the n samples of a prompt prefill once (prefill work 1/n) with logprobs within 1e-5 of separate prefills;
- after a warm-up, other prompts, budgets, seeds, temperatures, stop tokens and new weights compile nothing;
- the decode loop's variants agree with the static sampler: the head-major cache with the no-controls fast sampling
  (the default), the slot-major cache with the truncation machinery (a `LEGACY_DECODE` dense sampler), and top-k
  sampling; distinct prompts that start together prefill as one batch;
- decode programs of several steps with refills at host checks, attention length buckets and the drain on fewer
  slots: the static sampler's samples, no implicit device-to-host transfer (jax's transfer guard) and one explicit
  one per decode program (bounded by steps / check interval + refills + buckets, and far below one per token).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipeline.config import DenseInferenceConfig, ModelSpec
from pipeline.environments.base import Completion
from pipeline.environments.tokenizer import load_tokenizer
from policy.inference import GenerationRequest, make_backend
from policy.inference.base import SamplingControls
from policy.inference.continuous import ContinuousSampler, SeqRequest
from policy.inference.dense import DenseBackend
from policy.inference.dense_sampler import LEGACY_DECODE, DecodeOptions, DenseSampler, bucket
from policy.inference.local import SampleRow
from policy.model import build_model, teacher_forced_logprobs

VOCAB = 512
MAX_SEQ_LEN = 64
PROMPTS = [[1, 40, 41, 42, 43], [1, 7], [1, 2, 3, 4, 5, 6, 7, 8]]
SPEC = ModelSpec(hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=MAX_SEQ_LEN)


class CompileCounter:
    """Counts XLA backend compiles while active (jax.monitoring events)."""

    def __init__(self) -> None:
        self.count = 0
        self.active = False
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration_secs: float, **kwargs: str | int) -> None:
        if self.active and event == "/jax/core/compile/backend_compile_duration":
            self.count += 1

    def __enter__(self) -> CompileCounter:
        self.count, self.active = 0, True
        return self

    def __exit__(self, *exc: object) -> None:
        self.active = False


_COUNTER = CompileCounter()


@pytest.fixture(scope="module")
def model() -> Any:
    return build_model(SPEC, VOCAB, key=jax.random.PRNGKey(0))


@pytest.fixture(scope="module")
def dense(model: Any) -> Iterator[DenseBackend]:
    tok = load_tokenizer("builtin:tiny")
    b = make_backend(DenseInferenceConfig(max_seqs=4), model, tok, MAX_SEQ_LEN, fast_compile=True)
    assert isinstance(b, DenseBackend)
    yield b
    b.shutdown()


def _tokens(out: list[Any]) -> list[list[int]]:
    return [c.tokens for c in out]


def _gen(
    dense: DenseBackend, rows: list[SampleRow], *, continuous: bool, temperature: float, seed: int, stops: list[int]
) -> list[Completion]:
    """`dense.generate_rows` with every row's completion present."""
    out = dense.generate_rows(rows, temperature=temperature, seed=seed, stops=stops, continuous=continuous)
    assert all(c is not None for c in out)
    return [c for c in out if c is not None]


def _teacher_forced(model: Any, rows: list[SampleRow], out: list[Any], temperature: float) -> list[np.ndarray]:
    seqs = [list(r.prompt) + list(c.tokens) for r, c in zip(rows, out, strict=True)]
    width = max(len(s) for s in seqs)
    lp = np.asarray(
        teacher_forced_logprobs(model, jnp.asarray([s + [0] * (width - len(s)) for s in seqs]), temperature=temperature)
    )
    return [lp[i, len(r.prompt) : len(s)] for i, (r, s) in enumerate(zip(rows, seqs, strict=True))]


def _rows(prompts: list[list[int]], n: int, budgets: list[int]) -> list[SampleRow]:
    rows = [SampleRow(i, j, p, 0, i * n + j) for i, p in enumerate(prompts) for j in range(n)]
    return [
        SampleRow(r.prompt_index, r.sample_index, r.prompt, budgets[k % len(budgets)], r.sample_id)
        for k, r in enumerate(rows)
    ]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_continuous_equals_static_and_teacher_forced(dense: DenseBackend, model: Any, temperature: float) -> None:
    request = GenerationRequest(PROMPTS, n=3, temperature=temperature, max_tokens=12, stop_tokens=[], seed=3)
    dense.continuous_batching = False
    static = dense.generate(request)
    dense.continuous_batching = True
    try:
        cont = dense.generate(request)  # 9 sequences through 4 slots: slots refill
    finally:
        dense.continuous_batching = False
    assert [[c.tokens for c in g] for g in cont] == [[c.tokens for c in g] for g in static]
    assert all(len(c.tokens) == 12 and c.finish_reason == "length" for g in cont for c in g)
    rows = _rows(PROMPTS, 3, [12])
    flat_c, flat_s = [c for g in cont for c in g], [c for g in static for c in g]
    expected = _teacher_forced(model, rows, flat_c, temperature if temperature > 0 else 1.0)
    for c, s, e in zip(flat_c, flat_s, expected, strict=True):
        np.testing.assert_allclose(c.logprobs, s.logprobs, atol=1e-4, rtol=0)
        np.testing.assert_allclose(c.logprobs, e, atol=1e-4, rtol=0)


def test_slot_refill_with_mixed_budgets_and_stop_tokens(dense: DenseBackend) -> None:
    budgets = [1, 9, 3, 14, 2, 7, 12, 5, 4]
    rows = _rows(PROMPTS, 3, budgets)
    free = _gen(dense, rows, temperature=0.0, seed=0, stops=[], continuous=True)
    assert [len(c.tokens) for c in free] == budgets and all(c.finish_reason == "length" for c in free)
    assert _tokens(free) == _tokens(_gen(dense, rows, temperature=0.0, seed=0, stops=[], continuous=False))
    # a stop token taken from inside a long completion: it ends that row (included) and any other row containing it
    long = free[3].tokens
    stop = next(t for i, t in enumerate(long[2:], 2) if t not in long[:i])
    for temperature in (0.0, 1.0):
        cont = _gen(dense, rows, continuous=True, temperature=temperature, seed=5, stops=[stop, 511])
        static = _gen(dense, rows, continuous=False, temperature=temperature, seed=5, stops=[stop, 511])
        assert _tokens(cont) == _tokens(static)
        assert [c.finish_reason for c in cont] == [c.finish_reason for c in static]
        for c, b in zip(cont, budgets, strict=True):
            assert 1 <= len(c.tokens) <= b and stop not in c.tokens[:-1] and 511 not in c.tokens[:-1]
            assert c.finish_reason == ("stop" if c.tokens[-1] in (stop, 511) else "length")
            assert c.finish_reason == "stop" or len(c.tokens) == b
    greedy = _gen(dense, rows, temperature=0.0, seed=5, stops=[stop, 511], continuous=True)
    assert greedy[3].tokens == long[: long.index(stop) + 1] and greedy[3].finish_reason == "stop"


def test_shared_prefix_prefills_once_with_equal_logprobs(dense: DenseBackend) -> None:
    sampler = dense.continuous_sampler()
    n = 4
    prompt = [1, 9, 8, 7, 6, 5, 4, 3, 2, 10, 11]  # bucket 16
    reqs = [SeqRequest(prompt, 10, j, 7) for j in range(n)] + [SeqRequest([1, 2, 3], 6, n, 7)]
    kw: dict[str, Any] = dict(slots=4, stop_tokens=[], temperature=1.0)
    p0 = sampler.prefill_tokens
    shared = sampler.run(reqs, **kw)
    p1 = sampler.prefill_tokens
    separate = sampler.run(reqs, share_prefixes=False, **kw)
    p2 = sampler.prefill_tokens
    assert p1 - p0 == 16 + 8  # one prefill per distinct prompt
    assert p2 - p1 == n * 16 + 8  # one per request
    for a, b in zip(shared, separate, strict=True):
        assert a.tokens.tolist() == b.tokens.tolist()
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=0)
    assert len({tuple(r.tokens.tolist()) for r in shared[:n]}) > 1  # the samples differ (own PRNG streams)


def test_no_recompilation_after_warm_up(dense: DenseBackend, model: Any) -> None:
    rows = _rows(PROMPTS, 3, [12, 3, 7])
    dense.generate_rows(rows, temperature=1.0, seed=1, stops=[], continuous=True)  # warm-up
    traces = dense.trace_count
    other = _rows([[1, 3, 5, 7, 9, 11], [1, 4], [1, 30, 31]], 2, [16, 1, 9, 2])  # same buckets
    with _COUNTER as c:
        dense.generate_rows(other, temperature=0.7, seed=2, stops=[5, 6], continuous=True)
        dense.generate_rows(rows, temperature=0.0, seed=3, stops=[9], continuous=True)
    assert c.count == 0 and dense.trace_count == traces
    first = dense.generate_rows(rows, temperature=1.0, seed=1, stops=[], continuous=True)
    dense.update_model(build_model(SPEC, VOCAB, key=jax.random.PRNGKey(1)))
    try:
        with _COUNTER as c:
            swapped = dense.generate_rows(rows, temperature=1.0, seed=1, stops=[], continuous=True)
        assert c.count == 0 and dense.trace_count == traces
        assert _tokens(swapped) != _tokens(first)
    finally:
        dense.update_model(model)


def _static(
    sampler: DenseSampler,
    prompts: list[list[int]],
    budgets: list[int],
    *,
    batch_size: int,
    temperature: float,
    seed: int,
    controls: SamplingControls = SamplingControls(),
) -> Any:
    """The static sampler's samples of row i = prompts[i] with budget budgets[i] and sample id i, no stop token."""
    return sampler.generate(
        prompts,
        list(range(len(prompts))),
        batch_size=batch_size,
        max_tokens=budgets,
        max_new_bucket=bucket(max(budgets), minimum=16),
        stop_tokens=[],
        temperature=temperature,
        seed=seed,
        controls=controls,
    )


def _assert_static_samples(out: list[Any], static: Any, budgets: list[int]) -> None:
    """Continuous results `out` have the static sampler's tokens, its logprobs within 1e-4."""
    for i, r in enumerate(out):
        assert r.tokens.tolist() == static.tokens[i, : budgets[i]].tolist()
        np.testing.assert_allclose(r.logprobs, static.logprobs[i, : budgets[i]], atol=1e-4, rtol=0)


def test_decode_variants_match_static_and_prompts_prefill_as_a_batch(model: Any) -> None:
    fast = DenseSampler(model, "float32", fast_compile=True)
    legacy = DenseSampler(model, "float32", fast_compile=True, decode=LEGACY_DECODE)
    prompts = PROMPTS
    budgets = [12, 5, 9]
    reqs = [SeqRequest(p, b, i, 4) for i, (p, b) in enumerate(zip(prompts, budgets, strict=True))]
    for controls in (SamplingControls(), SamplingControls(top_k=5)):
        static = _static(fast, prompts, budgets, batch_size=4, temperature=1.0, seed=4, controls=controls)
        for dense in (fast, legacy):
            cont = ContinuousSampler(dense)
            out = cont.run(reqs, slots=4, stop_tokens=[], temperature=1.0, controls=controls)
            assert cont.head_major == (dense is fast)
            assert cont.prefill_tokens == 4 * 8  # the 3 prompts in one [4, 8] prefill (one at a time: 3 * 8)
            _assert_static_samples(out, static, budgets)


def test_few_host_transfers_and_length_buckets_sample_what_static_samples(model: Any) -> None:
    """Decode programs of many steps, refilled at host checks, over length buckets, the drain on fewer slots: no
    implicit device-to-host transfer at all (jax's transfer guard), one explicit one per decode program, far fewer
    than one per token; the tokens of the static sampler (greedy and T = 1), its logprobs within 1e-4."""
    dense = DenseSampler(model, "float32", fast_compile=True, decode=DecodeOptions(length_bucket=8))
    budgets = [30, 3, 9, 14, 2, 25, 12, 5, 4]  # token bucket 32: a cache of 8 + 32 slots, attention buckets 16, 40
    prompts = [PROMPTS[k % 3] for k in range(len(budgets))]
    reqs = [SeqRequest(p, b, k, 6) for k, (p, b) in enumerate(zip(prompts, budgets, strict=True))]
    cont = ContinuousSampler(dense, check_steps=8, refill_slots=2, min_drain_slots=1)
    lengths: list[int] = []
    slots: list[int] = []
    decode = cont._decode

    def recorded(params: Any, state: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        lengths.append(kwargs["length"])
        slots.append(state["pos"].shape[0])
        return decode(params, state, *args, **kwargs)

    cont._decode = recorded
    for temperature in (0.0, 1.0):
        static = _static(dense, prompts, budgets, batch_size=16, temperature=temperature, seed=6)
        h0, d0 = cont.host_syncs, cont.decode_steps
        with jax.transfer_guard_device_to_host("disallow"):
            out = cont.run(reqs, slots=4, stop_tokens=[], temperature=temperature)
        syncs, steps = cont.host_syncs - h0, cont.decode_steps - d0
        _assert_static_samples(out, static, budgets)
        # each decode program returns after 8 steps, 2 finished sequences (while requests wait), a bucket's end or
        # the last sequence's end
        assert syncs <= -(-steps // 8) + -(-len(reqs) // 2) + 2 and syncs <= sum(budgets) / 8
    assert set(lengths) == {16, 40}
    assert set(slots) == {4, 2, 1}  # the drain moved the last sequences into fewer slots
    # the counter counts: a check every step is one transfer per step
    cont.check_steps = 1
    h0, d0 = cont.host_syncs, cont.decode_steps
    cont.run(reqs, slots=4, stop_tokens=[], temperature=1.0)
    assert cont.host_syncs - h0 == cont.decode_steps - d0
