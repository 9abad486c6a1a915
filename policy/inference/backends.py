"""Inference backends: token ids + per-token logprobs from the policy, behind one interface.

Reads: an in-memory levanter LM (the policy) and sampling requests. Writes: nothing (returns
`Completion`s). Used by the rollout and evaluation steps through `make_backend` and
`BackendInferenceContext` (the environments' `InferenceContext`).

    backend = make_backend(InferenceConfig(backend="dense"), model, tokenizer, max_seq_len=256)
    ctx = BackendInferenceContext(tokenizer, backend)
    groups = ctx.generate([[1, 5, 7]], n=4, temperature=1.0, max_tokens=32, stop_tokens=None, seed=0)
    backend.update_model(new_model)   # new weights, same structure: no recompilation
    backend.shutdown()

Promises of every backend (`InferenceBackend.generate`):

- `generate(prompts, n=...)` returns, for each prompt in order, exactly `n` `Completion`s, each with
  at least one token, token ids as sampled (never re-tokenised text) and one logprob per token;
  a sample the backend failed to produce raises `GenerationError` naming it (never an empty
  or missing completion).
- logprob of token t = `log softmax(logits_t / T)[token_t]` (float32); at `T = 0` sampling is greedy
  and the logprob is that of the untempered distribution (T treated as 1), matching
  `policy.model.teacher_forced_logprobs`.
- A stop token ends a completion and is included in it (`finish_reason="stop"`); otherwise the
  completion has `max_tokens` tokens (`finish_reason="length"`). When `len(prompt) + max_tokens`
  exceeds `max_seq_len` the budget of that prompt is cut to `max_seq_len - len(prompt)` ("length").
  A prompt of length >= `max_seq_len` raises `PromptTooLongError` before anything is generated.
- `stop_tokens=None` means the tokenizer's EOS; `[]` means no stop token.
- Sample j of prompt i uses the PRNG stream `fold_in(PRNGKey(seed), i * n + j)`.

Backends:

- `dense` (default; `policy.inference.dense_sampler`): one jitted prefill + `while_loop` decode per batch
  with a dense KV cache, compiled once per (batch bucket, prompt bucket, token bucket) shape.
  Batches are split into `max_seqs` rows and padded to a power of two (at most `max_seqs`);
  prompts to a power of two >= 8 tokens, `max_tokens` to a power of two >= 16.
- `levanter`: levanter's `InferenceEngine`, worked around per the facts probed on 1.2.dev1644: one
  request per sample (`n_generations > 1` leaks KV pages), prefill sized to hold every admitted
  prompt, every output checked (missing ones retried once, then `GenerationError`), KV cache
  float32 on CPU, and a fresh engine (same config, so the compile cache is reused) instead of
  `engine.reset()` whenever the old one did not free every slot and page.
- `openai`: not here (an HTTP client lives with the rollout step).

Compute dtype: `make_backend(..., compute_dtype=None)` picks float32 on CPU and bfloat16 on GPU/TPU
(pass `ModelSpec.compute_dtype` to force one).
"""

from __future__ import annotations

import abc
import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from pipeline.config import InferenceConfig
from pipeline.environments.base import Completion
from policy.inference.dense_sampler import DenseSampler, bucket

logger = logging.getLogger(__name__)

FINISH_STOP = "stop"
FINISH_LENGTH = "length"


class GenerationError(RuntimeError):
    """Some requested samples did not come back; `missing` lists (prompt index, sample index)."""

    def __init__(self, message: str, missing: Sequence[tuple[int, int]] = ()):
        super().__init__(message)
        self.missing = list(missing)


class PromptTooLongError(ValueError):
    """A prompt leaves no room for a generated token within max_seq_len."""

    def __init__(self, prompt_index: int, length: int, max_seq_len: int):
        super().__init__(
            f"prompt {prompt_index} has {length} tokens; max_seq_len={max_seq_len} leaves no room to generate"
        )
        self.prompt_index = prompt_index
        self.length = length
        self.max_seq_len = max_seq_len


@dataclasses.dataclass
class GenerationStats:
    """Running totals of a backend (for rollout metrics)."""

    calls: int = 0
    completions: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0

    def tokens_per_second(self) -> float:
        """Generated tokens per second of wall time spent in `generate`."""
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0


@dataclasses.dataclass(frozen=True)
class _Row:
    """One sample to produce: prompt `prompt_index`, sample `sample_index`, its token budget and PRNG id."""

    prompt_index: int
    sample_index: int
    prompt: list[int]
    max_tokens: int
    sample_id: int


def default_compute_dtype() -> str:
    """float32 on CPU, bfloat16 on an accelerator."""
    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def cast_floating(model: Any, dtype: str) -> Any:
    """`model` with floating-point array leaves cast to `dtype` (the same object for float32 leaves)."""
    dt = jnp.dtype(dtype)

    def _cast(x: Any) -> Any:
        return x.astype(dt) if eqx.is_inexact_array(x) and x.dtype != dt else x

    return jax.tree_util.tree_map(_cast, model)


class InferenceBackend(abc.ABC):
    """Token-level sampling from the current policy (see the module docstring for the promises)."""

    name: str = "abstract"

    def __init__(self, tokenizer: Any, max_seq_len: int, vocab_size: int):
        self.tokenizer = tokenizer
        self.max_seq_len = int(max_seq_len)
        self.vocab_size = int(vocab_size)
        self.stats = GenerationStats()

    # -- public API ---------------------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        n: int,
        temperature: float,
        max_tokens: int,
        stop_tokens: Sequence[int] | None,
        seed: int,
    ) -> list[list[Completion]]:
        """`n` completions per prompt, in order (each non-empty, with per-token logprobs of logits/T)."""
        if n < 1:
            raise ValueError(f"n={n}: must be >= 1")
        if max_tokens < 1:
            raise ValueError(f"max_tokens={max_tokens}: must be >= 1")
        if temperature < 0:
            raise ValueError(f"temperature={temperature}: must be >= 0")
        stops = self._resolve_stops(stop_tokens)
        rows: list[_Row] = []
        for i, p in enumerate(prompts):
            prompt = [int(t) for t in p]
            if not prompt:
                raise ValueError(f"prompt {i} is empty")
            bad = [t for t in prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompt {i} has token ids outside [0, {self.vocab_size}): {bad[:5]}")
            if len(prompt) >= self.max_seq_len:
                raise PromptTooLongError(i, len(prompt), self.max_seq_len)
            budget = min(max_tokens, self.max_seq_len - len(prompt))
            rows.extend(_Row(i, j, prompt, budget, i * n + j) for j in range(n))
        if not rows:
            return []
        t0 = time.perf_counter()
        results = self._generate_rows(rows, temperature=float(temperature), stops=stops, seed=int(seed))
        elapsed = time.perf_counter() - t0
        out: list[list[Completion]] = [[] for _ in prompts]
        missing: list[tuple[int, int]] = []
        for row, comp in zip(rows, results, strict=True):
            if comp is None or not comp.tokens or len(comp.tokens) != len(comp.logprobs):
                missing.append((row.prompt_index, row.sample_index))
            else:
                out[row.prompt_index].append(comp)
        if missing:
            msg = f"{self.name}: {len(missing)} of {len(rows)} samples missing (prompt, sample): {missing[:10]}"
            raise GenerationError(msg, missing)
        n_tok = sum(len(c.tokens) for c in results if c is not None)
        self.stats.calls += 1
        self.stats.completions += len(rows)
        self.stats.prompt_tokens += sum(len(r.prompt) for r in rows)
        self.stats.generated_tokens += n_tok
        self.stats.seconds += elapsed
        logger.info(
            "%s: %d prompts x %d -> %d tokens in %.2fs (%.1f tok/s)",
            self.name,
            len(prompts),
            n,
            n_tok,
            elapsed,
            n_tok / max(elapsed, 1e-9),
        )
        return out

    @abc.abstractmethod
    def update_model(self, model: Any) -> None:
        """Sample from `model` from the next `generate` on (same structure: no recompilation)."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Release device buffers; the backend is unusable afterwards."""

    # -- helpers ----------------------------------------------------------------------------

    def _resolve_stops(self, stop_tokens: Sequence[int] | None) -> list[int]:
        if stop_tokens is None:
            eos = getattr(self.tokenizer, "eos_token_id", None)
            return [] if eos is None else [int(eos)]
        return sorted({int(t) for t in stop_tokens})

    @staticmethod
    def _completion(tokens: Sequence[int], logprobs: Sequence[float], stops: Sequence[int]) -> Completion:
        toks = [int(t) for t in tokens]
        reason = FINISH_STOP if toks and toks[-1] in set(stops) else FINISH_LENGTH
        return Completion(tokens=toks, logprobs=[float(x) for x in logprobs], finish_reason=reason)

    @abc.abstractmethod
    def _generate_rows(
        self, rows: list[_Row], *, temperature: float, stops: list[int], seed: int
    ) -> list[Completion | None]:
        """One completion per row (None: failed to produce it)."""


# ---------------------------------------------------------------------------------------------
# dense
# ---------------------------------------------------------------------------------------------


class DenseBackend(InferenceBackend):
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
    ):
        super().__init__(tokenizer, max_seq_len, model.Vocab.size)
        self.max_seqs = int(max_seqs)
        self.compute_dtype = compute_dtype
        self.fast_compile = fast_compile
        self.sampler: DenseSampler | None = DenseSampler(model, compute_dtype, fast_compile=fast_compile)

    @property
    def trace_count(self) -> int:
        """How many times the sampler was traced (each new shape traces, and compiles, once)."""
        return 0 if self.sampler is None else self.sampler.trace_count

    def update_model(self, model: Any) -> None:
        """Swap in `model`'s weights; a model of another structure gets a new sampler (and compiles)."""
        if self.sampler is not None and self.sampler.compatible(model):
            self.sampler.update_params(model)
        else:
            logger.info("dense: new model structure, building a new sampler")
            self.sampler = DenseSampler(model, self.compute_dtype, fast_compile=self.fast_compile)
        self.vocab_size = model.Vocab.size

    def shutdown(self) -> None:
        self.sampler = None

    def _generate_rows(
        self, rows: list[_Row], *, temperature: float, stops: list[int], seed: int
    ) -> list[Completion | None]:
        if self.sampler is None:
            raise RuntimeError("dense backend was shut down")
        results: list[Completion | None] = []
        T = bucket(max(r.max_tokens for r in rows), minimum=16)
        for start in range(0, len(rows), self.max_seqs):
            chunk = rows[start : start + self.max_seqs]
            B = bucket(len(chunk), maximum=self.max_seqs)
            out = self.sampler.generate(
                [r.prompt for r in chunk],
                [r.sample_id for r in chunk],
                batch_size=B,
                max_tokens=[r.max_tokens for r in chunk],
                max_new_bucket=T,
                stop_tokens=stops,
                temperature=temperature,
                seed=seed,
            )
            for i in range(len(chunk)):
                k = int(out.lengths[i])
                results.append(self._completion(out.tokens[i, :k], out.logprobs[i, :k], stops) if k > 0 else None)
        return results


# ---------------------------------------------------------------------------------------------
# levanter InferenceEngine
# ---------------------------------------------------------------------------------------------


class LevanterEngineBackend(InferenceBackend):
    """levanter's `InferenceEngine`, one request per sample, with every output checked."""

    name = "levanter"

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        max_seq_len: int,
        *,
        max_seqs: int,
        page_size: int,
        compute_dtype: str,
        max_stop_tokens: int = 16,
    ):
        super().__init__(tokenizer, max_seq_len, model.Vocab.size)
        self.max_seqs = int(max_seqs)
        self.page_size = int(page_size)
        if jax.default_backend() == "cpu" and jnp.dtype(compute_dtype) != jnp.float32:
            # the engine's KV cache must be float32 on CPU, and its attention needs model and cache dtypes equal
            logger.info("levanter: compute dtype %s -> float32 on CPU", compute_dtype)
            compute_dtype = "float32"
        self.compute_dtype = compute_dtype
        self.max_stop_tokens = int(max_stop_tokens)
        self._model = cast_floating(model, compute_dtype)
        self._engine: Any = None
        self.engines_built = 0

    def _engine_config(self) -> Any:
        from levanter.inference.engine import InferenceEngineConfig

        pages_per_seq = -(-self.max_seq_len // self.page_size)
        return InferenceEngineConfig(
            max_seq_len=self.max_seq_len,
            page_size=self.page_size,
            max_seqs=self.max_seqs,
            max_pages=self.max_seqs * pages_per_seq,
            # KV cache dtype = compute dtype (float32 on CPU, see __init__)
            compute_dtype=jnp.dtype(self.compute_dtype),
            enable_logprobs=True,
            max_stop_seqs=self.max_stop_tokens,
            max_stop_tokens=1,
            # size prefill so that every admitted prompt fits in one prefill (else outputs go missing)
            max_seqs_in_prefill=self.max_seqs,
            max_prefill_size=self.max_seqs * self.max_seq_len,
            max_queued_tokens=max(512, self.max_seqs),
            max_rounds=32,
        )

    def _get_engine(self) -> Any:
        from levanter.inference.engine import InferenceEngine

        if self._engine is None:
            self._engine = InferenceEngine.from_model_with_config(self._model, self.tokenizer, self._engine_config())
            self.engines_built += 1
        return self._engine

    def _engine_is_clean(self) -> bool:
        eng = self._engine
        if eng is None:
            return True
        try:
            return len(eng.free_slots) == self.max_seqs and eng._free_page_count() == eng.config.max_pages
        except Exception:  # any doubt: rebuild
            return False

    def update_model(self, model: Any) -> None:
        """Swap in `model` (cast to the compute dtype); the engine's jitted loops take it as an argument."""
        self._model = cast_floating(model, self.compute_dtype)
        self.vocab_size = model.Vocab.size
        if self._engine is not None:
            self._engine.model = self._model

    def shutdown(self) -> None:
        self._engine = None
        self._model = None

    def _generate_rows(
        self, rows: list[_Row], *, temperature: float, stops: list[int], seed: int
    ) -> list[Completion | None]:
        if self._model is None:
            raise RuntimeError("levanter backend was shut down")
        if len(stops) > self.max_stop_tokens:
            raise ValueError(f"{len(stops)} stop tokens; the levanter backend holds at most {self.max_stop_tokens}")
        results: list[Completion | None] = [None] * len(rows)
        pending = list(range(len(rows)))
        for attempt in range(2):
            for start in range(0, len(pending), self.max_seqs):
                chunk = pending[start : start + self.max_seqs]
                got = self._run_chunk([rows[i] for i in chunk], temperature, stops, seed)
                for i, comp in zip(chunk, got, strict=True):
                    results[i] = comp
            pending = [i for i, c in enumerate(results) if c is None]
            if not pending:
                break
            logger.warning(
                "levanter: %d samples came back empty (attempt %d): %s",
                len(pending),
                attempt + 1,
                [(rows[i].prompt_index, rows[i].sample_index) for i in pending[:10]],
            )
            self._engine = None  # a fresh engine for the retry
        return results

    def _run_chunk(self, rows: list[_Row], temperature: float, stops: list[int], seed: int) -> list[Completion | None]:
        import haliax as hax
        from levanter.inference.engine import Request
        from levanter.inference.jit_scheduler import SeqDecodingParams

        if not self._engine_is_clean():
            logger.info("levanter: engine kept slots/pages after the last call; building a new one")
            self._engine = None
        engine = self._get_engine()
        engine.model = self._model
        stop_arr = None
        if stops:
            stop_arr = hax.named(jnp.asarray(np.asarray(stops, np.int32)[:, None]), ("stop_seq", "position"))
        base = jax.random.PRNGKey(seed)
        requests = []
        for k, r in enumerate(rows):
            params = SeqDecodingParams(
                max_num_tokens=jnp.array(len(r.prompt) + r.max_tokens, dtype=jnp.int32),  # counts the prompt
                stop_tokens=stop_arr,
                temperature=jnp.array(temperature, dtype=jnp.float32),
                key=jax.random.fold_in(base, r.sample_id),
            )
            requests.append(
                Request(
                    prompt_tokens=list(r.prompt),
                    request_id=k,
                    decode_params=params,
                    n_generations=1,
                    enable_logprobs=True,
                )
            )
        try:
            result = engine.generate(requests)
        except Exception:
            self._engine = None  # never reuse an engine that raised
            raise
        out: list[Completion | None] = []
        for k, r in enumerate(rows):
            toks = list(result.tokens[k]) if k < len(result.tokens) else []
            lps = list(result.logprobs[k]) if result.logprobs is not None and k < len(result.logprobs) else []
            toks, lps = toks[: r.max_tokens], lps[: r.max_tokens]
            stopped = bool(toks) and toks[-1] in stops
            if not toks or len(toks) != len(lps) or any(not np.isfinite(x) for x in lps):
                out.append(None)
            elif len(toks) < r.max_tokens and not stopped:
                # the engine gave up early (e.g. its outer-round guard): incomplete, not a "length" finish
                logger.warning(
                    "levanter: sample %s ended after %d of %d tokens without a stop token",
                    (r.prompt_index, r.sample_index),
                    len(toks),
                    r.max_tokens,
                )
                out.append(None)
            else:
                out.append(self._completion(toks, lps, stops))
        return out


# ---------------------------------------------------------------------------------------------
# factory and the environments' InferenceContext
# ---------------------------------------------------------------------------------------------


def make_backend(
    cfg: InferenceConfig,
    model: Any,
    tokenizer: Any,
    max_seq_len: int,
    *,
    compute_dtype: str | None = None,
    fast_compile: bool = False,
) -> InferenceBackend:
    """The backend `cfg.backend` names, sampling from `model` with sequences of at most `max_seq_len` tokens.

    `compute_dtype=None`: float32 on CPU, bfloat16 on an accelerator. `fast_compile` (dense only): lowest
    XLA optimisation level, about half the CPU compile time and slower execution (tests).
    """
    dtype = compute_dtype or default_compute_dtype()
    if cfg.backend == "dense":
        return DenseBackend(
            model, tokenizer, max_seq_len, max_seqs=cfg.max_seqs, compute_dtype=dtype, fast_compile=fast_compile
        )
    if cfg.backend == "levanter":
        return LevanterEngineBackend(
            model, tokenizer, max_seq_len, max_seqs=cfg.max_seqs, page_size=cfg.page_size, compute_dtype=dtype
        )
    raise ValueError(f"inference.backend={cfg.backend!r}: not an in-process backend (use the rollout step's client)")


@dataclasses.dataclass
class BackendInferenceContext:
    """The environments' `InferenceContext`: a tokenizer plus `backend.generate`."""

    tokenizer: Any
    backend: InferenceBackend

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        n: int,
        temperature: float,
        max_tokens: int,
        stop_tokens: Sequence[int] | None,
        seed: int,
    ) -> list[list[Completion]]:
        """`n` completions per prompt (see `InferenceBackend.generate`)."""
        return self.backend.generate(
            prompts, n=n, temperature=temperature, max_tokens=max_tokens, stop_tokens=stop_tokens, seed=seed
        )
