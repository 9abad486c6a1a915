"""The dense backend compiles, while a rollout worker is idle, the prompt buckets its lessons' prompts will use.

The cats task has 15 prompts of <= 8 tokens and one of 9: each rollout worker compiled the 16-token prompt bucket when
it first drew that prompt, in the middle of the run (~2 s per worker at the TRL-comparison setting, on the learner's
critical path). `DenseBackend.warm_up` (called by the worker while pacing pauses it) compiles that shape beforehand,
and only shapes likely to run (each warm-up costs a trace and a compile, and most test jobs are short):
- the ledger proposes, for each (batch, token, stop) family a real call used, the expected prompt buckets (the
  worker's start-check draws: `expect_prompt_lengths`) not yet run there, each only when at least
  `WARM_UP_MIN_CHANCE` likely among the prompts left to draw; never a neighbouring bucket no expected prompt falls
  in (not even one another family ran), never a prompt too long to sample, nothing without an expectation;
- the rollout worker's start check (`check_lessons`) returns the lengths of the prompts it drew, and the manager
  `policy_runtime` builds hands them to its dense backend (cats: buckets 8 and 16);
- on a tiny levanter model (CPU float32), with static batches and with continuous batching: after a call of short
  prompts, with the 9-token prompt expected, one warm-up compiles the 16-token bucket (static: its one program;
  continuous: its prefill and insert, the decode programs being shared since a call's cache is sized for the
  largest expected bucket) and leaves `prefill_tokens` as it was, the next finds nothing; a later call with the
  9-token prompt traces nothing, and a call's tokens are the same as before the warm-up; a continuous call's cache
  is not sized for an expected bucket that would more than double it.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import pytest

from pipeline.config import (
    CurriculumConfig,
    DenseInferenceConfig,
    EnvConfig,
    LessonConfig,
    ModelSpec,
    RolloutStepConfig,
)
from pipeline.environments.base import encode_prompt
from pipeline.environments.cats import CatsEnv
from pipeline.environments.start_checks import PROMPT_PROBE, check_lessons
from pipeline.environments.tokenizer import load_tokenizer
from policy.inference import make_backend
from policy.inference.base import NO_CONTROLS
from policy.inference.dense import DenseBackend, _Shape, _ShapeLedger
from policy.inference.local import SampleRow
from policy.model import build_model
from policy.rollout_manager import policy_runtime

VOCAB = 512
MAX_SEQ_LEN = 64
SPEC = ModelSpec(hidden_dim=32, intermediate_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=MAX_SEQ_LEN)
SHORT = [[1, 40, 41, 42, 43], [1, 7], [1, 2, 3, 4, 5, 6, 7, 8], [1, 5, 6]]  # prompt bucket 8
LONG = [1, 9, 8, 7, 6, 5, 4, 3, 2]  # 9 tokens (the cats task's longest prompt): bucket 16
CATS = "pipeline.environments.cats.CatsEnv"


def _shape(p: int, b: int = 16) -> _Shape:
    return _Shape(b, p, 16, (2,), 1.0, NO_CONTROLS)


def _pending(ledger: _ShapeLedger, sampler: object) -> list[tuple[int, int]]:
    return [(s.batch_bucket, s.prompt_bucket) for s in iter(lambda: ledger.next_pending(sampler), None)]


def test_ledger_proposes_the_expected_buckets_likely_to_be_drawn_only() -> None:
    sampler = object()
    ledger = _ShapeLedger()
    ledger.expect([8, 16])  # the lessons' prompts fall in buckets 8 and 16: never 32, never 4
    assert _pending(ledger, sampler) == []  # nothing ran yet
    ledger.used(sampler, _shape(8))
    ledger.used(sampler, _shape(8))  # the same family again: adds nothing
    assert _pending(ledger, sampler) == [(16, 16)]  # its one expected bucket not yet run; 8 ran
    ledger.used(sampler, _shape(32, b=4))  # a prompt of a bucket not expected (e.g. an eval prompt) ran
    assert _pending(ledger, sampler) == [(4, 8), (4, 16)]  # never 32 in another family
    assert _pending(ledger, sampler) == []  # each shape proposed once
    ledger.used(object(), _shape(8))  # a new sampler (new model structure): a new ledger, the expectation stays
    assert _pending(ledger, ledger._sampler) == [(16, 16)]
    rare = _ShapeLedger()  # 2 of 16 drawn prompts in bucket 16: warmed only while enough prompts are left to draw
    rare.expect([8] * 14 + [16] * 2)
    rare.used(sampler, _shape(8))
    assert rare.next_pending(sampler, draws_left=12) is None  # 1 - (7/8)^12 = 0.80 < WARM_UP_MIN_CHANCE
    assert rare.next_pending(sampler, draws_left=0) is None
    assert rare.next_pending(sampler, draws_left=18) == _shape(16)  # 1 - (7/8)^18 = 0.91
    assert rare.next_pending(sampler, draws_left=None) is None  # proposed once
    for expected in ([], [8]):  # no expectation, or every prompt in the bucket that ran: nothing to warm
        quiet = _ShapeLedger()
        quiet.expect(expected)
        quiet.used(sampler, _shape(8))
        assert _pending(quiet, sampler) == []


@pytest.fixture(scope="module")
def model() -> Any:
    return build_model(SPEC, VOCAB, key=jax.random.PRNGKey(0))


def _rows(prompts: list[list[int]], n: int = 4) -> list[SampleRow]:
    return [SampleRow(i, j, p, 12, i * n + j) for i, p in enumerate(prompts) for j in range(n)]


@pytest.mark.parametrize("continuous", [False, True], ids=["static", "continuous"])
def test_warm_up_compiles_the_longer_prompt_bucket_before_a_call_needs_it(model: Any, continuous: bool) -> None:
    tokenizer = load_tokenizer("builtin:tiny")
    # `steps.rollout`'s wiring: `check_lessons` returns the token counts of the prompts it drew (cats: its 9-token
    # prompt among them), and the manager `policy_runtime` builds hands them to its dense backend as bucket counts
    config = RolloutStepConfig(
        model=SPEC,
        curriculum=CurriculumConfig(lessons={"cats": LessonConfig("cats", env=EnvConfig(CATS))}),
        inference=DenseInferenceConfig(max_seqs=16),
    )
    lengths = check_lessons(config, tokenizer)
    env = CatsEnv()
    drawn = env.examples(PROMPT_PROBE, np.random.default_rng(config.seed), "train")
    assert lengths == [len(encode_prompt(tokenizer, e.prompt, add_bos=env.add_bos, chat=False)) for e in drawn]
    manager = policy_runtime(config, tokenizer, lengths).build_manager(model)
    expected = manager._backend._shapes._expected
    manager.shutdown()
    assert expected == {8: sum(n <= 8 for n in lengths), 16: sum(n > 8 for n in lengths)} and expected[16] > 0
    sampling = DenseInferenceConfig(max_seqs=16, continuous_batching=continuous)
    dense = make_backend(sampling, model, tokenizer, MAX_SEQ_LEN, fast_compile=True)
    assert isinstance(dense, DenseBackend) and dense.continuous_batching is continuous
    warm_traces = 2 if continuous else 1  # continuous: the bucket's prefill and insert; static: its one program
    try:
        dense.expect_prompt_lengths([MAX_SEQ_LEN, MAX_SEQ_LEN + 5])  # no room for a new token: never sampled
        dense.expect_prompt_lengths([len(p) for p in [*SHORT, LONG]])
        assert dense._shapes._expected == {8: len(SHORT), 16: 1}
        assert dense.warm_up() is False  # nothing used yet: nothing to warm
        rows = _rows(SHORT)
        before = dense.generate_rows(rows, temperature=1.0, seed=3, stops=[2])
        traces, prefill = dense.trace_count, dense.prefill_tokens
        assert dense.warm_up(draws_left=4) is False  # 4 more prompts: bucket 16 (1 in 5) likely never drawn
        assert dense.warm_up() is True
        assert dense.trace_count == traces + warm_traces and dense.prefill_tokens == prefill
        assert dense.warm_up() is False  # exactly one shape warmed: the 16-token bucket, not 32 or 4
        mixed = _rows([*SHORT[:3], LONG])  # 16 rows, one prompt of 9 tokens: one 16 x 16 batch
        dense.generate_rows(mixed, temperature=1.0, seed=4, stops=[2])
        assert dense.trace_count == traces + warm_traces  # warmed: no compile inside the call
        after = dense.generate_rows(rows, temperature=1.0, seed=3, stops=[2])
        assert [c.tokens if c else None for c in after] == [c.tokens if c else None for c in before]
        # continuous calls size their cache for the largest expected bucket (16: what made the sharing above),
        # unless that more than doubles it: a 40-token prompt expected (bucket 64) leaves short calls at their own
        assert dense._cache_prompt_bucket(rows) == 16
        dense.expect_prompt_lengths([40])
        assert dense._cache_prompt_bucket(rows) == 0  # 64 + 16 > 2 x (8 + 16)
        assert dense._cache_prompt_bucket(_rows([[1] * 20])) == 64  # bucket 32: 64 + 16 <= 2 x (32 + 16)
    finally:
        dense.shutdown()
