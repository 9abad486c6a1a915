"""The RolloutManager: inference, the policy model, environments, rollout generation and evaluation.

No storage and no weight sync (the rollout worker, `pipeline.rollout.worker`, owns those): usable on its own for
offline evaluation and tests. Also the data it returns: `RolloutBatch` (rows + `RolloutMetadata` + every
`RecordedFailure`) and its summary `RolloutBatchStats` (`batch_stats`).

Semantics: generation is atomic per `sample_batch` call: `update_model` waits for a running call to finish, so
no rollout mixes weights; every row carries the step the call started with. With an external server (`openai`
backend) that reports a different policy step during one call, the whole call is re-rolled. An example that
fails is retried (a fresh example of the same lesson is drawn, since environments choose examples by rng) up to
`max_example_retries` more times (in training; an eval example that fails is recorded as failed, never replaced);
every failure is kept with its reason. Nothing is dropped silently. A missing or non-finite reward, from any
environment kind, fails its example with the reason (`pipeline.environments.reward_checks.split_bad_rewards`).

With partial rollouts (`inference.partial_rollouts`, dense backend with continuous batching) `stage_model` hands a
newer policy to the sampler without waiting for the running call: it is swapped in between decode steps, every
token records the policy that sampled it, and the call's rows carry the oldest of those steps as `policy_step`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import threading
import time
import uuid
from collections.abc import Collection
from typing import Any

import numpy as np

from pipeline.config import CurriculumConfig, InferenceConfig, ModelSpec, SamplingParams
from pipeline.environments import Environment, SampleSpec, load_environment
from pipeline.environments.base import PromptSkip
from pipeline.environments.reward_checks import split_bad_rewards
from pipeline.environments.tokenizer import check_chat_lessons
from pipeline.rollout.rollout_batch import (  # noqa: F401  (re-exported: the manager's return types)
    SUCCESS_REWARD,
    RecordedFailure,
    RolloutBatch,
    RolloutBatchStats,
    RolloutMetadata,
    batch_stats,
    controls_of,
    is_success,
    schema_rows,
)
from pipeline.store.storage import RunStore
from policy.inference import BackendContext, InferenceBackend, make_backend

logger = logging.getLogger(__name__)

SUMMED_ENV_METRICS = frozenset({"failures", "episodes"})
"""Environment metrics that are counts (besides `n_*`): summed over a call's attempts, not the last attempt's."""


class RolloutManager:
    """Inference lifecycle, the policy model, environments, rollout generation and evaluation.

    Stateless in `weight_step` and `worker_id`: they are arguments of every call and end up in
    the returned metadata and rows. Usable on its own (offline evaluation, tests): no storage, no weight
    sync. Thread-safe: sampling calls and `update_model` are serialised by one lock, so a sampling call
    never mixes two models.
    """

    def __init__(
        self,
        inference: InferenceConfig,
        model_spec: ModelSpec,
        curriculum: CurriculumConfig,
        tokenizer: Any,
        initial_model: Any,
        *,
        max_example_retries: int = 2,
        backend: InferenceBackend | None = None,
    ) -> None:
        """Start the inference backend (`policy.inference.make_backend` unless `backend` is given), sampling in
        `model_spec.compute_dtype` with sequences of at most `model_spec.max_seq_len` tokens."""
        if max_example_retries < 0:
            raise ValueError(f"max_example_retries={max_example_retries}: must be >= 0")
        check_chat_lessons(curriculum.lessons, tokenizer, model_spec.tokenizer)
        self.inference_config = inference
        self.model_spec = model_spec
        self.curriculum_config = curriculum
        self.tokenizer = tokenizer
        self.max_example_retries = max_example_retries
        self._policy_model = initial_model
        self._environments: dict[str, Environment] = {}
        self._lock = threading.RLock()
        if backend is None:
            backend = make_backend(
                inference, initial_model, tokenizer, model_spec.max_seq_len, compute_dtype=model_spec.compute_dtype
            )
        self._backend = backend

    # -- lifecycle ------------------------------------------------------------------------------

    @property
    def external_weights(self) -> bool:
        """True when an external server owns the weights (the `openai` backend)."""
        return self._backend.external_weights

    @property
    def manages_weights(self) -> bool:
        """True when the backend's server is told which committed policy to load (the `server` backend)."""
        return self._backend.manages_weights

    def attach_run(self, run_root: str, log_path: str | None = None, log_location: str | None = None) -> None:
        """Name the run root whose policies a weight-managing server loads; its server logs to the local file
        `log_path`, kept at `log_location` (named in start-up errors; see `ServerBackend.attach`)."""
        spec = json.dumps(dataclasses.asdict(self.model_spec))
        self._backend.attach(run_root, spec, log_path, log_location)  # type: ignore[attr-defined]

    def load_policy(self, step: int) -> float:
        """Make the server serve committed policy `step` once the running sampling call finished (requests in
        flight complete on the policy they started with); returns the seconds it took."""
        with self._lock:
            return float(self._backend.load_policy(step))  # type: ignore[attr-defined]

    def served_policy_step(self) -> int | None:
        """The policy step an external server says it serves (None: in-process backend or not reported)."""
        return self._backend.served_policy_step()

    def stage_model(self, model: Any, step: int) -> None:
        """Partial rollouts: have the sampler switch to `model` (policy `step`) at its next decode-step boundary
        (or the next call's start); never waits for a running call (the caller's thread converts the weights).
        Raises RuntimeError when the backend cannot switch policies mid-call."""
        stage = getattr(self._backend, "stage_model", None)
        if stage is None or not getattr(self._backend, "partial_rollouts", False):
            raise RuntimeError(
                f"inference backend {type(self._backend).__name__} does not do partial rollouts "
                "(inference.partial_rollouts needs type dense with continuous batching)"
            )
        stage(model, step)
        self._policy_model = model

    def update_model(self, model: Any) -> None:
        """Swap in new policy weights; waits for a running sampling call to finish first."""
        with self._lock:
            self._policy_model = model
            self._backend.update_model(model)
        logger.info("policy model updated")

    def expect_prompt_lengths(self, lengths: Collection[int]) -> None:
        """Tell the backend the token counts of prompts later calls will likely sample (`DenseBackend.
        expect_prompt_lengths`: the prompt buckets `warm_up` compiles); a backend that does not warm ignores them."""
        expect = getattr(self._backend, "expect_prompt_lengths", None)
        if expect is not None:
            with self._lock:
                expect(lengths)

    def warm_up(self, draws_left: float | None = None) -> bool:
        """Compile one sampler shape a later sampling call is likely to need (`DenseBackend.warm_up`; `draws_left`: how
        many prompts the caller may still sample, None: unbounded), between calls; True if it did (seconds of work),
        False when the backend has nothing to warm (cheap). For idle time only."""
        warm = getattr(self._backend, "warm_up", None)
        if warm is None:
            return False
        with self._lock:
            return bool(warm(draws_left))

    def shutdown(self) -> None:
        """Close every environment it built (their processes and connections; one that fails to close is logged,
        the others still close), then release the inference backend. Idempotent."""
        with self._lock:
            environments, self._environments = list(self._environments.values()), {}
            for env in environments:
                try:
                    env.close()
                except Exception as e:  # a failing close must not keep the others, or the backend, open
                    logger.warning("closing environment %s failed: %s: %s", type(env).__name__, type(e).__name__, e)
            self._backend.shutdown()

    # -- environments -----------------------------------------------------------------------------

    def _load_environment(self, lesson_id: str) -> Environment:
        """The lesson's environment, built once per (class path, kwargs) and cached.

        Raises KeyError naming an unknown lesson; EnvironmentLoadError naming the class path.
        """
        if lesson_id not in self.curriculum_config.lessons:
            raise KeyError(f"unknown lesson {lesson_id!r}; known: {sorted(self.curriculum_config.lessons)}")
        env_cfg = self.curriculum_config.lessons[lesson_id].env
        key = f"{env_cfg.env_class}:{sorted(env_cfg.env_args.items())!r}"
        if key not in self._environments:
            logger.info("loading environment %s for lesson %s", env_cfg.env_class, lesson_id)
            self._environments[key] = load_environment(env_cfg)
        return self._environments[key]

    # -- sampling ---------------------------------------------------------------------------------

    def sample_batch(
        self,
        lesson_id: str,
        n_examples: int,
        n_generations: int,
        mode: str,
        rng: np.random.Generator | int,
        weight_step: int,
        worker_id: str,
        *,
        batch_id: str | None = None,
        sampling: SamplingParams | None = None,
        eval_type: str | None = None,
        skip: PromptSkip | None = None,
    ) -> tuple[RolloutBatch | None, dict[str, float]]:
        """Generate, score and group rollouts of one lesson with the current model.

        Returns `(batch, metrics)`; `batch` is None when no example succeeded (then `metrics` says why:
        `failures`, and the failures are logged). Rows carry `policy_step=weight_step` (or the step an
        external server reports), `worker_id`, the sampling temperature and a timestamp; `rollout_id` is
        `<batch_id>-<i>` and `group_key` `<lesson>/<env group key>/<batch_id>`. `batch_id` defaults to
        `<worker_id>.<uuid4 hex[:12]>`; the worker passes its file stem. Sampling params: `sampling` if
        given, else the lesson's training params (mode "train") or eval params (mode "eval"). `skip`: prompts a
        training draw passes over (`pipeline.environments.base.draw_skipping`; difficulty-aware sampling).
        Raises KeyError (unknown lesson), EnvironmentLoadError (environment cannot be built).
        """
        env = self._load_environment(lesson_id)
        if sampling is None:
            cur = self.curriculum_config
            sampling = cur.sampling_for(lesson_id) if mode == "train" else cur.eval_sampling_for(lesson_id)
        gen = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
        batch_id = batch_id or f"{worker_id}.{uuid.uuid4().hex[:12]}"
        start = time.monotonic()
        with self._lock:
            rows_src, failures, env_metrics, tokens, step = self._sample_with_retries(
                env, lesson_id, n_examples, n_generations, mode, gen, weight_step, sampling, skip
            )
        generate_s = time.monotonic() - start
        token_steps = [min(r.token_policy_steps) for _, r in rows_src if getattr(r, "token_policy_steps", None)]
        if token_steps:  # partial rollouts: the call's policy step is its oldest token's
            step = min(token_steps)
        self.last_failures = failures  # the worker reads them when nothing was generated (its no-progress check)
        now = time.time()
        rows = schema_rows(rows_src, lesson_id, batch_id, sampling, step, worker_id, now, eval_type)
        n_groups = len({r.group_key for r in rows})
        metrics = {
            **{f"env/{k}": float(v) for k, v in env_metrics.items()},
            "rows": float(len(rows)),
            "groups": float(n_groups),
            "failures": float(len(failures)),
            "failed_examples": float(max(0, n_examples - n_groups)),
            "tokens": float(tokens),
            "time/generate_s": generate_s,
        }
        for f in failures:
            logger.warning("lesson %s example %s failed (attempt %d): %s", lesson_id, f.example_id, f.attempt, f.reason)
        if not rows:
            logger.warning("lesson %s: no rollouts generated (%d failures)", lesson_id, len(failures))
            return None, metrics
        batch = RolloutBatch(
            batch_id=batch_id,
            lesson_id=lesson_id,
            mode=mode,
            temperature=float(sampling.temperature),
            metadata=RolloutMetadata(worker_id=worker_id, timestamp=now, weight_step=int(step)),
            rows=rows,
            failures=failures,
            n_examples_requested=n_examples,
            n_response_tokens=tokens,
            generate_s=generate_s,
            env_metrics=env_metrics,
            successes=[is_success(r) for _, r in rows_src],
            sampling={
                "temperature": float(sampling.temperature),
                "top_p": float(sampling.top_p),
                "top_k": int(sampling.top_k),
                "min_p": float(sampling.min_p),
                "max_tokens": int(sampling.max_tokens),
            },
        )
        logger.info(
            "lesson %s: %d groups, %d rows from policy %d (%d failures)",
            lesson_id,
            n_groups,
            len(rows),
            step,
            len(failures),
        )
        return batch, metrics

    def _sample_with_retries(
        self,
        env: Environment,
        lesson_id: str,
        n_examples: int,
        n_generations: int,
        mode: str,
        rng: np.random.Generator,
        weight_step: int,
        sampling: SamplingParams,
        skip: PromptSkip | None = None,
    ) -> tuple[list[tuple[str, Any]], list[RecordedFailure], dict[str, float], int, int]:
        """Run `env.sample`, re-drawing failed examples up to `max_example_retries` times (train mode; in eval mode an
        example that fails is recorded as failed, never replaced: the eval stream is fixed, so a re-draw would
        evaluate another example twice).

        Every group passes the shared reward check (`pipeline.environments.reward_checks.split_bad_rewards`): a
        missing or non-finite reward fails its example with the reason. `env_metrics["failures"]` counts every
        failure of every attempt; `n_*` counts (and `SUMMED_ENV_METRICS`) are summed over attempts, other metrics
        are the last attempt's.

        A call during which an external server reported more than one policy step is discarded whole and
        re-rolled (counted as an attempt); if that keeps happening, its examples are recorded as failed.
        Returns (rows as (env group key, EnvRollout)), failures, env metrics, sampled tokens, policy step).
        """
        rows: list[tuple[str, Any]] = []
        failures: list[RecordedFailure] = []
        env_metrics: dict[str, float] = {}
        tokens = 0
        remaining = n_examples
        step: int | None = None
        for attempt in range(self.max_example_retries + 1):
            if remaining <= 0:
                break
            ctx = BackendContext(self.tokenizer, self._backend, controls_of(sampling))
            ctx.policy_step, ctx.max_seq_len = weight_step, self.model_spec.max_seq_len  # for the generate endpoint
            spec = SampleSpec(
                remaining,
                n_generations,
                sampling.temperature,
                sampling.max_tokens,
                sampling.stop_tokens,
                mode,
                chat=self.curriculum_config.lessons[lesson_id].chat,
                skip=skip if mode == "train" else None,
            )
            result = env.sample(ctx, spec, rng)
            # the one reward check of every environment kind: a missing or non-finite reward fails its example
            groups, bad_rewards = split_bad_rewards(result.groups)
            if bad_rewards:
                result = dataclasses.replace(result, groups=groups, failures=[*result.failures, *bad_rewards])
            served = ctx.served_steps
            call_step = next(iter(served)) if len(served) == 1 else weight_step
            if len(served) > 1 or (step is not None and result.groups and call_step != step):
                # results from two policies are never mixed: the whole call is re-rolled
                earlier = "" if step is None else f"; earlier attempts of this call: {step}"
                reason = f"policy changed during sampling (server reported steps {sorted(served)}{earlier})"
                logger.warning("lesson %s: %s; re-rolling %d examples", lesson_id, reason, remaining)
                failures += [RecordedFailure(str(g.rollouts[0].example_id), reason, attempt) for g in result.groups]
                failures += [RecordedFailure(str(f.example_id), f.reason, attempt) for f in result.failures]
                continue
            if served and call_step != weight_step:
                logger.info(
                    "server serves policy %d (caller said %d); tagging rows with %d", call_step, weight_step, call_step
                )
            if result.groups:
                step = call_step
            tokens += ctx.generated_tokens
            for g in result.groups:
                for r in g.rollouts:
                    rows.append((g.key, r))
            failures += [RecordedFailure(str(f.example_id), f.reason, attempt) for f in result.failures]
            for k, v in result.metrics.items():
                if not math.isfinite(float(v)):  # e.g. a mean over the rewards the check above refused
                    continue
                summed = k.startswith("n_") or k in SUMMED_ENV_METRICS
                env_metrics[k] = env_metrics.get(k, 0.0) + float(v) if summed else float(v)
            remaining -= len(result.groups)
            if mode == "eval":  # a retry would draw the eval stream's first examples again: duplicates, not retries
                break
            if result.failures and remaining > 0 and attempt < self.max_example_retries:
                logger.info(
                    "lesson %s: %d examples failed; retrying (attempt %d of %d)",
                    lesson_id,
                    len(result.failures),
                    attempt + 1,
                    self.max_example_retries,
                )
        env_metrics["failures"] = float(len(failures))  # every failure of every attempt, whatever the environment
        return rows, failures, env_metrics, tokens, step if step is not None else weight_step

    # -- evaluation -------------------------------------------------------------------------------

    def evaluate_lesson(
        self,
        lesson_id: str,
        n_examples: int,
        eval_type: str,
        rng: np.random.Generator | int,
        step: int,
        weight_step: int,
        worker_id: str,
    ) -> tuple[RolloutBatchStats, RolloutBatch | None]:
        """Evaluate one lesson with its eval sampling params (mode "eval"); rows are `schemas.EvalRow`s.

        `eval_type` is "eval" (full evaluation) or "micro_eval" (logged only). `step` is the caller's
        progress counter (for logs). The curriculum is not updated here: in the file-based pipeline the
        BatchMaker folds the evaluate step's summaries (one writer); callers persist what they want.
        Returns (stats, batch); batch is None when every example failed (stats then count the failures).
        """
        if eval_type not in ("eval", "micro_eval"):
            raise ValueError(f"eval_type={eval_type!r}: must be 'eval' or 'micro_eval'")
        sp = self.curriculum_config.eval_sampling_for(lesson_id)
        batch, metrics = self.sample_batch(
            lesson_id,
            n_examples,
            sp.n_generations_per_prompt,
            "eval",
            rng,
            weight_step,
            worker_id,
            sampling=sp,
            eval_type=eval_type,
        )
        if batch is None:
            stats = RolloutBatchStats(
                lesson_id, weight_step, n_examples, 0, 0, int(metrics["failures"]), 0.0, 0.0, 0.0, 0.0, sp.temperature
            )
        else:
            stats = batch_stats(batch)
        logger.info(
            "%s of %s at step %d (policy %d): mean reward %.3f, success %.3f",
            eval_type,
            lesson_id,
            step,
            stats.policy_step,
            stats.mean_reward,
            stats.success_rate,
        )
        return stats, batch

    def evaluate_curriculum(
        self,
        eval_n_examples: int,
        rng: np.random.Generator | int,
        step: int,
        weight_step: int,
        worker_id: str,
    ) -> dict[str, tuple[RolloutBatchStats, RolloutBatch | None]]:
        """Full evaluation ("eval") of every lesson, in sorted lesson order: {lesson_id: (stats, batch)}."""
        gen = rng if isinstance(rng, np.random.Generator) else np.random.default_rng(rng)
        return {
            lesson_id: self.evaluate_lesson(lesson_id, eval_n_examples, "eval", gen, step, weight_step, worker_id)
            for lesson_id in sorted(self.curriculum_config.lessons)
        }

    def update_training_stats(self, lesson_id: str, batch: RolloutBatch, step: int) -> RolloutBatchStats:
        """Training statistics of a batch (a pure summary).

        In the file-based pipeline the curriculum state has one writer, the BatchMaker, which folds the
        committed rollout files themselves; so this changes no state and only returns what to log.
        """
        if batch.lesson_id != lesson_id:
            raise ValueError(f"batch is from lesson {batch.lesson_id!r}, not {lesson_id!r}")
        return batch_stats(batch)


def policy_runtime(config: Any, tokenizer: Any, prompt_lengths: Collection[int] = ()) -> Any:
    """The `pipeline.rollout.worker.PolicyRuntime` of a rollout step config: its backend's manager (told that its
    prompts will have about `prompt_lengths` tokens: `RolloutManager.expect_prompt_lengths`), the policy models of
    committed steps, and the Hugging Face folders a server backend loads."""
    from pipeline.rollout.worker import PolicyRuntime
    from policy.inference import backend_class
    from policy.policy_format import policy_metadata, publish_hf_if_needed, read_policy

    def build_manager(model: Any) -> RolloutManager:
        manager = RolloutManager(
            config.inference,
            config.model,
            config.curriculum,
            tokenizer,
            model,
            max_example_retries=config.max_example_retries,
        )
        manager.expect_prompt_lengths(prompt_lengths)
        return manager

    def load_model(store: RunStore, step: int) -> Any:
        return read_policy(store, step, config.model, policy_metadata(store, step).vocab_size)

    return PolicyRuntime(
        manages_weights=backend_class(config.inference).manages_weights,
        build_manager=build_manager,
        load_model=load_model,
        publish_hf=lambda store, step: publish_hf_if_needed(store, config, step, tokenizer),
    )
