"""The dense backend compiles the prompt bucket next to the first one it used while a rollout worker is idle.

The cats task has 15 prompts of <= 8 tokens and one of 9: each rollout worker compiled the 16-token prompt bucket when
it first drew that prompt, in the middle of the run (~2 s per worker at the TRL-comparison setting, on the learner's
critical path). `DenseBackend.warm_up` (called by the worker while pacing pauses it) compiles that shape beforehand:
- the ledger proposes the prompt buckets half and twice the first one used per (batch, token, stop) family, >= 8,
  twice only where a longer prompt still fits `max_seq_len`, never chaining from a warmed or later shape;
- on a tiny levanter model (CPU float32): after one call of short prompts, one warm-up traces once and leaves
  `prefill_tokens` as it was, the next finds nothing; a later call with the 9+-token prompt traces nothing, and a
  call's tokens are the same as before the warm-up.
"""

from __future__ import annotations

from typing import Any

import jax
import pytest

from pipeline.config import DenseInferenceConfig, ModelSpec
from pipeline.environments.tokenizer import load_tokenizer
from policy.inference import make_backend
from policy.inference.base import NO_CONTROLS
from policy.inference.dense import DenseBackend, _Shape, _ShapeLedger
from policy.inference.local import SampleRow
from policy.model import build_model

VOCAB = 512
MAX_SEQ_LEN = 64
SPEC = ModelSpec(hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=MAX_SEQ_LEN)
SHORT = [[1, 40, 41, 42, 43], [1, 7], [1, 2, 3, 4, 5, 6, 7, 8], [1, 5, 6]]  # prompt bucket 8
LONG = [1, 9, 8, 7, 6, 5, 4, 3, 2]  # 9 tokens (the cats task's longest prompt): bucket 16


def _shape(p: int, b: int = 16) -> _Shape:
    return _Shape(b, p, 16, (2,), 1.0, NO_CONTROLS)


def test_ledger_proposes_the_neighbours_of_the_first_shape_only() -> None:
    sampler = object()
    ledger = _ShapeLedger()
    ledger.used(sampler, _shape(16), MAX_SEQ_LEN)
    ledger.used(sampler, _shape(32), MAX_SEQ_LEN)  # same family, not the first: adds nothing
    # 16's neighbours are 8 and 32; 32 already ran
    assert [s.prompt_bucket for s in iter(lambda: ledger.next_pending(sampler), None)] == [8]
    ledger.used(sampler, _shape(8, b=4), MAX_SEQ_LEN)  # a new family: 16 only (4 < 8)
    assert ledger.next_pending(sampler) == _shape(16, b=4)
    assert ledger.next_pending(sampler) is None
    tight = _ShapeLedger()
    tight.used(sampler, _shape(32), 33)  # a 33-token prompt cannot fit 33 slots with a new token: no 64
    assert [s.prompt_bucket for s in iter(lambda: tight.next_pending(sampler), None)] == [16]
    tight.used(object(), _shape(8), MAX_SEQ_LEN)  # a new sampler (new model structure): a new ledger
    assert tight.next_pending(tight._sampler) == _shape(16)


@pytest.fixture(scope="module")
def model() -> Any:
    return build_model(SPEC, VOCAB, key=jax.random.PRNGKey(0))


def _rows(prompts: list[list[int]], n: int = 4) -> list[SampleRow]:
    return [SampleRow(i, j, p, 12, i * n + j) for i, p in enumerate(prompts) for j in range(n)]


def test_warm_up_compiles_the_longer_prompt_bucket_before_a_call_needs_it(model: Any) -> None:
    dense = make_backend(
        DenseInferenceConfig(max_seqs=16), model, load_tokenizer("builtin:tiny"), MAX_SEQ_LEN, fast_compile=True
    )
    assert isinstance(dense, DenseBackend)
    try:
        assert dense.warm_up() is False  # nothing used yet: nothing to warm
        rows = _rows(SHORT)
        before = dense.generate_rows(rows, temperature=1.0, seed=3, stops=[2])
        traces, prefill = dense.trace_count, dense.prefill_tokens
        assert dense.warm_up() is True
        assert dense.trace_count == traces + 1 and dense.prefill_tokens == prefill
        assert dense.warm_up() is False
        mixed = _rows([*SHORT[:3], LONG])  # 16 rows, one prompt of 9 tokens: one 16 x 16 batch
        dense.generate_rows(mixed, temperature=1.0, seed=4, stops=[2])
        assert dense.trace_count == traces + 1  # warmed: no compile inside the call
        after = dense.generate_rows(rows, temperature=1.0, seed=3, stops=[2])
        assert [c.tokens if c else None for c in after] == [c.tokens if c else None for c in before]
    finally:
        dense.shutdown()
