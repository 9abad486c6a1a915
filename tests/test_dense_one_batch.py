"""The dense backend's static batches (`continuous_batching: false`) sample a call's rows as one device batch when
they fit one and the padding is cheap (continuous batching pads each prefill batch to its longest prompt anyway).

A call with prompts in two length buckets (8 and 16 tokens) and rows that fit `max_seqs` runs one sampling call (one
compiled shape: batch bucket x the longest prompt bucket), where it used to run one per prompt bucket. Checked on a
tiny levanter model, CPU float32:
- one trace for the mixed call, and a second call of the same shapes traces nothing;
- the tokens equal those of the per-bucket batches (each row keeps its PRNG stream, its sample id) and the logprobs
  agree with them to float rounding, and with the model's teacher-forced logprobs within the inference tests' 1e-4;
- a call whose padding would cost more than `MERGE_PADDING_RATIO` (many short prompts, one long) or whose rows do not
  fit one device batch is still split by prompt bucket.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pipeline.config import DenseInferenceConfig, ModelSpec
from pipeline.environments.tokenizer import load_tokenizer
from policy.inference import make_backend
from policy.inference.dense import DenseBackend
from policy.inference.local import SampleRow
from policy.model import build_model, teacher_forced_logprobs

VOCAB = 512
MAX_SEQ_LEN = 64
SPEC = ModelSpec(hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=MAX_SEQ_LEN)
SHORT = [[1, 40, 41, 42, 43], [1, 7], [1, 2, 3, 4, 5, 6, 7, 8]]  # prompt bucket 8
LONG = [[1, 9, 8, 7, 6, 5, 4, 3, 2, 10, 11]]  # 11 tokens: prompt bucket 16
TOKENS = 12


@pytest.fixture(scope="module")
def model() -> Any:
    return build_model(SPEC, VOCAB, key=jax.random.PRNGKey(0))


@pytest.fixture(scope="module")
def dense(model: Any) -> Iterator[DenseBackend]:
    config = DenseInferenceConfig(max_seqs=16, continuous_batching=False)  # static batches: what this file is about
    b = make_backend(config, model, load_tokenizer("builtin:tiny"), MAX_SEQ_LEN, fast_compile=True)
    assert isinstance(b, DenseBackend)
    yield b
    b.shutdown()


def _rows(prompts: list[list[int]], n: int) -> list[SampleRow]:
    return [
        SampleRow(i, j, p, TOKENS, i * n + j) for i, p in enumerate(prompts) for j in range(n)
    ]  # the cats bench's shape: every prompt n times, each sample its own PRNG id


def _per_bucket(dense: DenseBackend, rows: list[SampleRow], seed: int) -> list[tuple[list[int], np.ndarray]]:
    """The old grouping: one sampler call per prompt bucket (rows of one bucket together, in row order)."""
    assert dense.sampler is not None
    out: list[tuple[list[int], np.ndarray] | None] = [None] * len(rows)
    for short in (True, False):
        idx = [i for i, r in enumerate(rows) if (len(r.prompt) <= 8) == short]
        chunk = [rows[i] for i in idx]
        got = dense.sampler.generate(
            [r.prompt for r in chunk],
            [r.sample_id for r in chunk],
            batch_size=16 if len(chunk) > 8 else 8 if len(chunk) > 4 else 4,
            max_tokens=[r.max_tokens for r in chunk],
            max_new_bucket=16,
            stop_tokens=[],
            temperature=1.0,
            seed=seed,
        )
        for k, i in enumerate(idx):
            n = int(got.lengths[k])
            out[i] = (got.tokens[k, :n].tolist(), np.asarray(got.logprobs[k, :n]))
    assert all(o is not None for o in out)
    return out  # type: ignore[return-value]


def test_mixed_buckets_sample_as_one_batch_with_the_same_tokens(dense: DenseBackend, model: Any) -> None:
    rows = _rows(SHORT + LONG, 4)  # 16 rows: 12 in prompt bucket 8, 4 in bucket 16
    assert dense._chunks_by_prompt_bucket(rows) == [list(range(16))]
    traces = dense.trace_count
    got = dense.generate_rows(rows, temperature=1.0, seed=3, stops=[])
    assert dense.trace_count == traces + 1  # one program (16 x 16), not one per prompt bucket
    dense.generate_rows(rows, temperature=1.0, seed=4, stops=[])
    assert dense.trace_count == traces + 1
    ref = _per_bucket(dense, rows, seed=3)
    for c, (tokens, logprobs) in zip(got, ref, strict=True):
        assert c is not None and len(c.tokens) == TOKENS
        assert c.tokens == tokens
        np.testing.assert_allclose(c.logprobs, logprobs, atol=1e-5, rtol=0)
    # against the learner's view: teacher-forced logprobs of prompt + completion
    seqs = [r.prompt + list(c.tokens) for r, c in zip(rows, got, strict=True) if c is not None]
    padded = jnp.asarray([s + [0] * (32 - len(s)) for s in seqs], jnp.int32)
    tf = np.asarray(teacher_forced_logprobs(model, padded, temperature=1.0))
    for k, (r, c) in enumerate(zip(rows, got, strict=True)):
        assert c is not None
        np.testing.assert_allclose(c.logprobs, tf[k, len(r.prompt) : len(r.prompt) + TOKENS], atol=1e-4, rtol=0)
    assert len({tuple(c.tokens) for c in got if c is not None}) > 4  # the samples differ (own PRNG streams)


def test_costly_padding_or_too_many_rows_stay_split_by_bucket(dense: DenseBackend) -> None:
    many_short = _rows([[1, 2]], 15) + _rows([[1] * 40], 1)  # 15 rows of bucket 8, one of bucket 64
    chunks = dense._chunks_by_prompt_bucket(many_short)
    assert chunks == [list(range(15)), [15]]  # 16 x 64 = 1024 prompt positions > 2 x (16 x 8 + 1 x 64)
    too_many = _rows(SHORT + LONG, 5)  # 20 rows > max_seqs 16
    chunks = dense._chunks_by_prompt_bucket(too_many)
    assert sorted(i for c in chunks for i in c) == list(range(20)) and len(chunks) == 2
    assert all(len({len(too_many[i].prompt) > 8 for i in c}) == 1 for c in chunks)
