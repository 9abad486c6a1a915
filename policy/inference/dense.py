"""The `dense` backend: the fixed-shape jitted sampler of `policy.inference.dense_sampler`.

One jitted prefill + `while_loop` decode per batch with a dense KV cache, compiled once per (batch bucket, prompt
bucket, token bucket) shape. Rows are grouped by prompt-length bucket (a power of two >= 8 tokens) and each group
split into device batches of at most `max_seqs` rows, padded to a power of two: a prompt is padded only up to its
own bucket, never to a longer prompt's, except that a call whose rows fit one device batch is sampled as one batch
padded to its longest bucket when that padding is cheap (`MERGE_PADDING_RATIO`: one decode loop, not one per
bucket). `max_tokens` is padded to a power of two >= 16; the KV cache of a batch
holds `prompt bucket + token bucket` slots per row (so it follows `max_seqs`, `max_seq_len` and `max_tokens`).
New weights of the same structure (`update_model`) never recompile. `warm_up` compiles, when the caller is idle, the
prompt buckets the caller's prompts will likely use before it is done (`expect_prompt_lengths`) for each shape family a
real call used (a rollout worker calls it while pacing pauses it).

Sizing from config (`inference: {type: dense, max_seq_len, compute_dtype}`): `max_seq_len` (<= the model's;
None: the model's) caps prompt + completion, so a row's KV cache holds at most `prompt bucket + bucket(max_seq_len)`
slots; `compute_dtype` picks the sampler's dtype (weights, activations and KV cache): float32, bfloat16, float16 or
auto (float32 on CPU, bfloat16 on an accelerator); None: the dtype `make_backend` was given (`model.compute_dtype`),
or auto when none was. `kv_cache_bytes` says what a batch's cache costs.

`continuous_batching: true` (the default on CPU: `continuous_default`) serves a call through
`policy.inference.continuous` instead: `max_seqs` slots, a finished sequence's slot refilled from the call's queue
at the next host check (every few decode steps), and the n samples of a prompt sharing one prefill. Same samples
(same PRNG streams); faster when completion lengths vary (docs/benchmarks.md).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable
from typing import Any

from pipeline.config import DenseInferenceConfig
from pipeline.environments.base import Completion
from policy.inference.base import NO_CONTROLS, BackendBuild, GenerationRequest, SamplingControls
from policy.inference.continuous import ContinuousSampler, SeqRequest
from policy.inference.dense_sampler import DecodeOptions, DenseSampler, bucket
from policy.inference.dtypes import default_compute_dtype
from policy.inference.local import LocalBackend, SampleRow
from policy.inference.registry import register_backend

logger = logging.getLogger(__name__)


MERGE_PADDING_RATIO = 2.0
"""A call whose rows fit one device batch is sampled as one batch, all prompts padded to the longest one's bucket,
when that batch's prompt positions (batch bucket x prompt bucket) are at most this many times those of the
per-bucket batches; beyond it (a few long prompts among many short ones) the padding would cost more than the
extra decode loops it saves."""


def continuous_default(configured: bool | None) -> bool:
    """Whether the dense sampler batches continuously: `configured`, or when None (`inference.continuous_batching`
    unset) where continuous batching measured no slower than static batches on equal lengths: on CPU (0.99x, and
    2.65x on long-tailed lengths), not on an accelerator (0.92x on an H200 at equal lengths; docs/benchmarks.md)."""
    if configured is not None:
        return bool(configured)
    import jax

    return jax.default_backend() == "cpu"


@register_backend(DenseInferenceConfig)
class DenseBackend(LocalBackend):
    """The fixed-shape jitted sampler of `policy.inference.dense_sampler` (batches of at most `max_seqs` rows)."""

    name = "dense"

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        max_seq_len: int,
        *,
        max_seqs: int,
        compute_dtype: str,
        fast_compile: bool = False,
        continuous_batching: bool = False,
        partial_rollouts: bool = False,
        partial_rollouts_swap_steps: int = 8,
        decode: DecodeOptions | None = None,
    ):
        """`decode`: how the static sampler's decode loop computes (None: `DecodeOptions()`, the fast path;
        `dense_sampler.LEGACY_DECODE` reproduces the earlier loop for benchmarks)."""
        super().__init__(tokenizer, max_seq_len, model.Vocab.size)
        self.max_seqs = int(max_seqs)
        self.compute_dtype = compute_dtype
        self.fast_compile = fast_compile
        self.continuous_batching = bool(continuous_batching)
        self.partial_rollouts_swap_steps = int(partial_rollouts_swap_steps)
        self.partial_rollouts = bool(partial_rollouts)  # needs continuous_batching (pipeline.config refuses otherwise)
        self.decode = decode
        self.sampler: DenseSampler | None = DenseSampler(model, compute_dtype, fast_compile=fast_compile, decode=decode)
        self._continuous: ContinuousSampler | None = None
        self._shapes = _ShapeLedger()

    def expect_prompt_lengths(self, lengths: Iterable[int]) -> None:
        """The token counts of prompts later calls will likely sample, as drawn (e.g. a rollout worker's start-check
        draws of its lessons; a length drawn twice is twice as likely): `warm_up` compiles their prompt buckets, and
        no other unseen bucket. A prompt too long to leave room for one new token is never sampled, so its bucket is
        not expected."""
        self._shapes.expect(bucket(n, minimum=8) for n in lengths if 0 < n < self.max_seq_len)

    @classmethod
    def from_config(cls, config: Any, build: BackendBuild) -> DenseBackend:
        """A dense backend of `config.max_seqs` rows per batch, sequences of at most `config.max_seq_len` tokens
        (None: `build.max_seq_len`) in `config.compute_dtype` (see the module docstring)."""
        dtype = getattr(config, "compute_dtype", None) or build.compute_dtype or "auto"
        if dtype == "auto":
            dtype = default_compute_dtype()
        # a longer inference.max_seq_len is refused at program start (pipeline.config.validate)
        max_len = getattr(config, "max_seq_len", None) or build.max_seq_len
        logger.info("dense sampler: sequences of at most %d tokens in %s", max_len, dtype)
        return cls(
            build.model,
            build.tokenizer,
            max_len,
            max_seqs=config.max_seqs,
            compute_dtype=dtype,
            fast_compile=build.fast_compile,
            # partial rollouts switch policies between decode steps: continuous batching's, also where unset
            continuous_batching=continuous_default(getattr(config, "continuous_batching", False))
            or bool(getattr(config, "partial_rollouts", False)),
            partial_rollouts=bool(getattr(config, "partial_rollouts", False)),
            partial_rollouts_swap_steps=int(getattr(config, "partial_rollouts_swap_steps", 8)),
        )

    def kv_cache_bytes(self, batch_size: int, prompt_bucket: int, token_bucket: int) -> int:
        """Bytes of the KV cache of one device batch: layers × 2 (keys, values) × batch × (prompt bucket + token
        bucket) slots × kv heads × head dim × the compute dtype's size."""
        import jax.numpy as jnp

        if self.sampler is None:
            return 0
        a = self.sampler.arch
        slots = batch_size * (prompt_bucket + token_bucket)
        return int(a.num_layers * 2 * slots * a.num_kv_heads * a.head_dim * jnp.dtype(self.compute_dtype).itemsize)

    @property
    def trace_count(self) -> int:
        """How many times the sampler was traced (each new shape traces, and compiles, once)."""
        if self.sampler is None:
            return 0
        return self.sampler.trace_count + (0 if self._continuous is None else self._continuous.trace_count)

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens run through prefill so far by either path, padding included."""
        if self.sampler is None:
            return 0
        return self.sampler.prefill_tokens + (0 if self._continuous is None else self._continuous.prefill_tokens)

    def continuous_sampler(self) -> ContinuousSampler:
        """The continuous-batching sampler over the current dense sampler (built on first use)."""
        if self.sampler is None:
            raise RuntimeError("dense backend was shut down")
        if self._continuous is None or self._continuous.dense is not self.sampler:
            self._continuous = ContinuousSampler(
                self.sampler, partial=self.partial_rollouts, swap_check_steps=self.partial_rollouts_swap_steps
            )
        return self._continuous

    def stage_model(self, model: Any, step: int) -> None:
        """Partial rollouts: `model`'s weights (policy `step`) are swapped in between decode steps of the running
        call, or at the next call's start; never waits for a running call (`ContinuousSampler.stage_model`)."""
        self.continuous_sampler().stage_model(model, step)

    def update_model(self, model: Any) -> None:
        """Swap in `model`'s weights; a model of another structure gets a new sampler (and compiles)."""
        if self.sampler is not None and self.sampler.compatible(model):
            self.sampler.update_params(model)
        else:
            logger.info("dense: new model structure, building a new sampler")
            self.sampler = DenseSampler(model, self.compute_dtype, fast_compile=self.fast_compile, decode=self.decode)
        self.vocab_size = model.Vocab.size

    def shutdown(self) -> None:
        """Drop the sampler and its device buffers."""
        self.sampler = None
        self._continuous = None

    def _generate_rows(
        self, rows: list[SampleRow], request: GenerationRequest, stops: list[int]
    ) -> list[Completion | None]:
        return self.generate_rows(
            rows, temperature=request.temperature, seed=request.seed, stops=stops, controls=request.controls
        )

    def generate_rows(
        self,
        rows: list[SampleRow],
        *,
        temperature: float,
        seed: int,
        stops: list[int],
        controls: SamplingControls = NO_CONTROLS,
        continuous: bool | None = None,
    ) -> list[Completion | None]:
        """One completion per row (each row with its own prompt, budget and PRNG id): through continuous batching
        when `continuous` (None: the backend's `continuous_batching`), else static batches. Same samples either way."""
        if self.sampler is None:
            raise RuntimeError("dense backend was shut down")
        use_continuous = self.continuous_batching if continuous is None else continuous
        if use_continuous:
            return self._continuous_rows(rows, float(temperature), int(seed), stops, controls)
        return self._static_rows(rows, float(temperature), int(seed), stops, controls)

    def _continuous_rows(
        self, rows: list[SampleRow], temperature: float, seed: int, stops: list[int], controls: SamplingControls
    ) -> list[Completion | None]:
        out = self.continuous_sampler().run(
            [SeqRequest(r.prompt, r.max_tokens, r.sample_id, seed) for r in rows],
            slots=self.max_seqs,
            stop_tokens=stops,
            temperature=temperature,
            controls=controls,
            prompt_bucket=self._cache_prompt_bucket(rows),
        )
        done = [self._completion(o.tokens, o.logprobs, stops) if len(o.tokens) else None for o in out]
        for c, o in zip(done, out, strict=True):  # partial rollouts: the policy step of every token
            if c is not None and o.policy_steps is not None:
                c.policy_steps = [int(x) for x in o.policy_steps]
        return done

    def _cache_prompt_bucket(self, rows: list[SampleRow]) -> int:
        """The prompt part of a continuous call's KV cache: the largest expected prompt bucket, so that calls of
        every expected bucket share one cache length and so their decode programs (a new bucket then compiles
        only a prefill and an insert, which `warm_up` does beforehand); the call's own bucket instead (0) when
        that would more than double the cache (a rare long prompt among short ones)."""
        largest = self._shapes.largest_expected()
        own = bucket(max(len(r.prompt) for r in rows), minimum=8)
        tokens = bucket(max(r.max_tokens for r in rows), minimum=16)
        return largest if largest + tokens <= 2 * (own + tokens) else 0

    def _static_rows(
        self, rows: list[SampleRow], temperature: float, seed: int, stops: list[int], controls: SamplingControls
    ) -> list[Completion | None]:
        assert self.sampler is not None
        results: list[Completion | None] = [None] * len(rows)
        T = bucket(max(r.max_tokens for r in rows), minimum=16)
        for idx in self._chunks_by_prompt_bucket(rows):
            chunk = [rows[i] for i in idx]
            B = bucket(len(chunk), maximum=self.max_seqs)
            P = bucket(max(len(r.prompt) for r in chunk), minimum=8)
            self._shapes.used(self.sampler, _Shape(B, P, T, tuple(stops), temperature, controls))
            out = self.sampler.generate(
                [r.prompt for r in chunk],
                [r.sample_id for r in chunk],
                batch_size=B,
                max_tokens=[r.max_tokens for r in chunk],
                max_new_bucket=T,
                stop_tokens=stops,
                temperature=temperature,
                seed=seed,
                controls=controls,
            )
            for i, row_index in enumerate(idx):
                k = int(out.lengths[i])
                results[row_index] = self._completion(out.tokens[i, :k], out.logprobs[i, :k], stops) if k > 0 else None
        return results

    def warm_up(self, draws_left: float | None = None) -> bool:
        """Compile one sampler shape a later call is likely to need, before it is needed; True if it compiled one
        (seconds of work), False when none is left (cheap). Meant for idle time (a rollout worker paused by pacing).
        With continuous batching: the prefill and insert programs of an expected prompt bucket not yet run
        (`ContinuousSampler.warm_up`; a call's cache is sized for the largest expected bucket,
        `_cache_prompt_bucket`, so those are the only programs a new bucket needs), the buckets chosen as below.
        Static batches: the likely shapes are, for each (batch, token, stop) bucket family a real call used, the
        expected prompt buckets (`expect_prompt_lengths`; `_ShapeLedger`) not yet run, each only when `draws_left`
        (how many prompts the caller may still sample; None: no end in sight) makes it at least `WARM_UP_MIN_CHANCE`
        likely that one of them falls in it. So a prompt of another bucket than the first file's does not compile in
        the middle of a long run, on the learner's critical path (the cats task: 15 prompts of <= 8 tokens, one of
        9; each rollout worker compiled the 16-token bucket when it first drew that prompt, ~2 s per worker), while
        a bucket no expected prompt falls in, or one a short run will likely never draw, is not compiled for nothing
        (a warm-up costs a trace and a compile whether or not its bucket is drawn). The warm-up runs one row for one
        token and changes no state a caller sees: `prefill_tokens` is restored; `trace_count` counts its trace."""
        if self.continuous_batching:
            if self._continuous is None or self._continuous.dense is not self.sampler:
                return False  # no call ran on this sampler yet: nothing to replay
            t0 = time.monotonic()
            warmed = self._continuous.warm_up(self._shapes.likely_buckets(draws_left))
            if warmed:
                logger.info("dense sampler: warmed a continuous-batching prompt bucket in %.2fs", time.monotonic() - t0)
            return warmed
        shape = self._shapes.next_pending(self.sampler, draws_left)
        if shape is None or self.sampler is None:
            return False
        prefill = self.sampler.prefill_tokens
        t0 = time.monotonic()
        self.sampler.generate(
            [[self._pad_id()] * shape.prompt_bucket],
            [0],
            batch_size=shape.batch_bucket,
            max_tokens=[1],
            max_new_bucket=shape.token_bucket,
            stop_tokens=list(shape.stops),
            temperature=shape.temperature,
            seed=0,
            controls=shape.controls,
        )
        self.sampler.prefill_tokens = prefill
        logger.info(
            "dense sampler: warmed batch=%d prompt=%d new=%d in %.2fs",
            shape.batch_bucket,
            shape.prompt_bucket,
            shape.token_bucket,
            time.monotonic() - t0,
        )
        return True

    def _pad_id(self) -> int:
        """A token id every model of this vocabulary accepts (the tokenizer's pad id, else 0)."""
        pad = getattr(self.tokenizer, "pad_token_id", None)
        return int(pad) if isinstance(pad, int) and 0 <= pad < self.vocab_size else 0

    def _chunks_by_prompt_bucket(self, rows: list[SampleRow]) -> list[list[int]]:
        """Row indices in device batches of at most `max_seqs`. When every row fits one device batch and padding all
        prompts to the longest one's bucket costs at most `MERGE_PADDING_RATIO` times the prompt positions of the
        per-bucket batches, one batch in row order (one decode loop and one compiled shape per call instead of one per
        prompt bucket: on CPU each decode step reads all the weights once, whatever the batch); otherwise each batch
        holds prompts of one length bucket, so a short prompt is never padded to a long one's length beyond its own
        power-of-two bucket. Every row keeps its own PRNG stream (its sample id), so the sampled tokens do not depend
        on the grouping; logprobs agree to float rounding (the extra left padding is masked out of attention)."""
        by_bucket: dict[int, list[int]] = {}
        for i, r in enumerate(rows):
            by_bucket.setdefault(bucket(len(r.prompt), minimum=8), []).append(i)
        if len(by_bucket) > 1 and len(rows) <= self.max_seqs:
            merged = bucket(len(rows), maximum=self.max_seqs) * max(by_bucket)
            separate = sum(bucket(len(g), maximum=self.max_seqs) * p for p, g in by_bucket.items())
            if merged <= MERGE_PADDING_RATIO * separate:
                return [list(range(len(rows)))]
        return [
            group[k : k + self.max_seqs]
            for _, group in sorted(by_bucket.items())
            for k in range(0, len(group), self.max_seqs)
        ]


@dataclasses.dataclass(frozen=True)
class _Shape:
    """What one static sampler call compiles for (its buckets), with the runtime arguments to replay it."""

    batch_bucket: int
    prompt_bucket: int
    token_bucket: int
    stops: tuple[int, ...]
    temperature: float
    controls: SamplingControls

    def family(self) -> tuple[Any, ...]:
        """Everything but the prompt bucket that selects the compiled program."""
        truncate = not self.controls.is_default
        return (self.batch_bucket, self.token_bucket, bucket(len(self.stops), minimum=4), truncate)

    def key(self) -> tuple[Any, ...]:
        return (*self.family(), self.prompt_bucket)


WARM_UP_MIN_CHANCE = 0.9
"""A prompt bucket is warmed only when a prompt of it is at least this likely among the prompts the caller may still
sample: a warm-up spends its compile whether or not the bucket is drawn, while not warming costs that compile (on
the critical path) only if it is, so a bucket that may well never be drawn before the run ends (a short run, a rare
prompt length) is left to compile when first drawn."""


class _ShapeLedger:
    """The static shapes one sampler has run, and the ones `DenseBackend.warm_up` should compile: for each shape
    family (batch, token and stop buckets) a real call used, every expected prompt bucket (`expect`) not yet run in
    that family and likely enough to be drawn (`next_pending`); families in the order of their first use, buckets
    ascending. With no expectation nothing is warmed. A new sampler (new model structure) starts
    a new ledger (the expectation stays)."""

    def __init__(self) -> None:
        self._sampler: Any = None
        self._seen: set[tuple[Any, ...]] = set()
        self._warm: dict[tuple[Any, ...], _Shape] = {}  # family -> its first real shape (runtime arguments to replay)
        self._expected: dict[int, int] = {}  # prompt bucket -> how many expected prompts fall in it

    def _follow(self, sampler: Any) -> None:
        if sampler is not self._sampler:
            self._sampler, self._seen, self._warm = sampler, set(), {}

    def expect(self, prompt_buckets: Iterable[int]) -> None:
        """The prompt buckets of prompts later calls will likely sample (one entry per prompt: their frequencies)."""
        for p in prompt_buckets:
            self._expected[int(p)] = self._expected.get(int(p), 0) + 1

    def used(self, sampler: Any, shape: _Shape) -> None:
        """A real call ran `shape` on `sampler`."""
        self._follow(sampler)
        self._seen.add(shape.key())
        self._warm.setdefault(shape.family(), shape)

    def largest_expected(self) -> int:
        """The largest expected prompt bucket (0 with no expectation)."""
        return max(self._expected, default=0)

    def likely_buckets(self, draws_left: float | None = None) -> list[int]:
        """The expected prompt buckets worth warming, ascending. `draws_left`: how many prompts may still be
        sampled (None: unbounded); a bucket whose share p of the expected prompts gives
        1 - (1 - p)^draws_left < `WARM_UP_MIN_CHANCE` is left out."""
        total = sum(self._expected.values())
        return sorted(
            b
            for b, n in self._expected.items()
            if draws_left is None or 1.0 - (1.0 - n / total) ** max(draws_left, 0.0) >= WARM_UP_MIN_CHANCE
        )

    def next_pending(self, sampler: Any, draws_left: float | None = None) -> _Shape | None:
        """The next static shape to warm (marked seen), or None: an expected bucket of `likely_buckets(draws_left)`
        not yet run in a family a real call used."""
        self._follow(sampler)
        buckets = self.likely_buckets(draws_left)
        for first in self._warm.values():
            for p in buckets:
                shape = dataclasses.replace(first, prompt_bucket=p)
                if shape.key() not in self._seen:
                    self._seen.add(shape.key())
                    return shape
        return None
