"""The `levanter` backend: levanter's `InferenceEngine`, with every output checked.

Worked around per the facts probed on levanter 1.2.dev1644: one request per sample (`n_generations > 1` leaks
KV pages), prefill sized to hold every admitted prompt, every output checked (missing ones retried once, then
`GenerationError`), KV cache float32 on CPU, and a fresh engine (same config, so the compile cache is reused)
instead of `engine.reset()` whenever the old one did not free every slot and page.
"""

from __future__ import annotations

import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pipeline.config import LevanterInferenceConfig
from pipeline.environments.base import Completion
from policy.inference.base import BackendBuild, GenerationRequest
from policy.inference.dtypes import cast_floating, default_compute_dtype
from policy.inference.local import LocalBackend, SampleRow
from policy.inference.registry import register_backend

logger = logging.getLogger(__name__)


@register_backend(LevanterInferenceConfig)
class LevanterEngineBackend(LocalBackend):
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

    @classmethod
    def from_config(cls, config: Any, build: BackendBuild) -> LevanterEngineBackend:
        """An engine of `config.max_seqs` slots and `config.page_size` KV pages (`fast_compile` does not apply)."""
        dtype = build.compute_dtype or default_compute_dtype()
        return cls(
            build.model,
            build.tokenizer,
            build.max_seq_len,
            max_seqs=config.max_seqs,
            page_size=config.page_size,
            compute_dtype=dtype,
        )

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
        """Drop the engine and the model."""
        self._engine = None
        self._model = None

    def _generate_rows(
        self, rows: list[SampleRow], request: GenerationRequest, stops: list[int]
    ) -> list[Completion | None]:
        temperature, seed, controls = float(request.temperature), int(request.seed), request.controls
        if not controls.is_default:
            raise ValueError(f"levanter engine: top-p/top-k/min-p are not supported by levanter's sampler ({controls})")
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

    def _run_chunk(
        self, rows: list[SampleRow], temperature: float, stops: list[int], seed: int
    ) -> list[Completion | None]:
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
