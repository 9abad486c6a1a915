"""The rollout step: a RolloutWorker (coordination, storage, weight sync) around a RolloutManager (inference,
environments, rollout generation, evaluation), after seed 000's split.

Reads
    policies/step-S/COMMITTED (+ weights)    the newest committed policy (listing is the truth; never backwards)
    batches/log/step-T.json                  how far the BatchMaker is (pacing)
    rollouts/step-P/*.ready.json             row counts of committed rollouts (pacing)
    curriculum/state-T.json                  lesson sampling weights (written by the BatchMaker, the one writer)
    control/STOP                             stop file
Writes
    rollouts/step-P/<worker>.<nonce>-<seq>.parquet (+ .ready.json)   one file per write, P = policy that sampled it
    metrics/rollout/<worker>.<nonce>-<seq>.jsonl                     metrics records (see METRICS)

Run
    python -m steps.rollout --store.run_root runs/demo --worker_id worker0 [--max_rollouts 64] [--max_seconds 60]
    python -m steps.rollout --config_path rollout.yaml        (a RolloutStepConfig as YAML)

Algorithm (RolloutWorker.run, named phases):
    1. wait_for_policy   poll `policies/` until a committed policy exists (fails loudly after
                         `wait_for_policy_timeout_s`, naming `policies/step-00000000/COMMITTED`), load it.
    2. loop until stopped (SIGTERM/SIGINT, control/STOP, bounds, or -- in follow mode -- the learner published
       policy `train.num_train_steps`):
       a. sync_weights   newest committed policy P' > P? load it and `manager.update_model` (an older step
                         published later is ignored: P only grows).
       b. pace           next batch slot T = B + 1 (B = newest committed batch slot). A rollout from policy P
                         is usable in slot T iff 0 <= (T-1) - P <= max_lag. Pause while (T-1) - P > max_lag
                         (it would arrive stale; wait for a newer policy), and while the unconsumed rows
                         usable by slot T or later are >= max_steps_ahead × train.batch_size (counted exactly
                         from the BatchMaker's cursor in log entry B; see `count_unconsumed_rows`; with
                         zero-variance filtering a file counts the rows of its groups with signal, recorded as
                         `signal_rows` in its ready marker, see `usable_rows`). A pause
                         "ahead" that sees no batch/policy progress for `stall_grace_s` lets one write
                         through (a safety net should the BatchMaker need more rows than counted), so
                         pacing can never deadlock the run.
       c. sample_lesson  from the newest curriculum state (`pipeline.curriculum`).
       d. generate       `manager.sample_batch(...)` under the generation watchdog.
       e. write          `store.commit_data(rollouts/step-P/<worker>.<nonce>-<seq>.parquet)` under the
                         write watchdog; the ready marker also records the lesson, policy step and failures.
       f. metrics        one record per write (MetricsWriter, kind "rollout").

File names: every process incarnation draws a nonce (`<unix ms hex><4 random hex>`), and its files are
`<worker_id>.<nonce>-<seq>` with seq counting from 0. A restarted worker therefore never reuses a name of
its previous incarnation, whatever that one left behind (an uncommitted data file without a marker is
invisible to readers and simply stays unreferenced). `rollout_id` = `<file stem>-<row index>`: stable and
unique; `group_key` = `<lesson>/<env group key>/<file stem>`: unique per (lesson, example, sampling call).

Watchdogs: weight load, generation and write each run under a `Watchdog` thread timer
(`weight_load_timeout_s`, `generation_timeout_s`, `write_timeout_s`). A phase that overruns logs a CRITICAL
line naming the phase and limit and ends the process with `os._exit(WATCHDOG_EXIT_CODE)` (3): a hung JAX or
network call cannot be interrupted from Python, and the job runner restarts the step.

Task semantics (seed 002): generation is atomic per `sample_batch` call: `update_model` waits for a running
call to finish, so no rollout mixes weights; every row carries the step the call started with. With an
external server (`openai` backend) that reports a different policy step during one call, the whole call is
re-rolled. An example that fails is retried (a fresh example of the same lesson is drawn, since environments
choose examples by rng) up to `max_example_retries` more times; every failure is kept with its reason in the
batch, the ready marker (`failures`) and the metrics (`failures`). Nothing is dropped silently.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import secrets
import signal
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline import layout
from pipeline.config import CurriculumConfig, InferenceConfig, ModelSpec, RolloutStepConfig, SamplingParams
from pipeline.curriculum import load_latest_curriculum, sample_lesson, sampling_weights
from pipeline.environments import Completion, Environment, load_environment
from pipeline.metrics import MetricsWriter
from pipeline.storage import RunStore
from pipeline.tokenizer import load_tokenizer
from policy.inference.backends import make_backend
from policy.inference.openai import OpenAIBackend
from schemas import ROLLOUT, EvalRow, EvalSummaryRow, RolloutRow

logger = logging.getLogger(__name__)

WATCHDOG_EXIT_CODE = 3
"""Process exit status when a phase overran its watchdog timeout."""

METRICS: dict[str, str] = {
    "rows": "rollout rows written in this write",
    "groups": "RLOO/GRPO groups in this write",
    "failures": "examples that failed in this write (each attempt counts; reasons in the ready marker)",
    "failed_examples": "examples still missing after all retries (requested - produced)",
    "tokens": "response tokens sampled by the policy in this write (loss-mask 1)",
    "rollouts_per_s": "rows / generation seconds of this write",
    "tokens_per_s": "tokens / generation seconds of this write",
    "mean_reward": "mean episode reward of the rows of this write",
    "reward/<lesson>": "mean episode reward of this write, keyed by its lesson",
    "truncation_rate": "fraction of rows whose response hit max_tokens",
    "policy_lag": "learner's newest committed policy minus the policy that sampled this write, at write time",
    "slot_lag": "(T-1) - P for the next batch slot T at write time (usable iff 0 <= slot_lag <= max_lag)",
    "time/generate_s": "seconds in manager.sample_batch",
    "time/write_s": "seconds committing the parquet + marker",
    "time/weight_load_s": "seconds loading policies since the previous write",
    "time/pause_s": "seconds paused by pacing since the previous write",
    "time/sample_lesson_s": "seconds reading curriculum state and drawing the lesson",
}
"""Every metric the rollout step logs, defined once."""


# ---------------------------------------------------------------------------------------------
# data returned by the manager
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RolloutMetadata:
    """Who sampled a batch, when, and with which policy step (seed 000's metadata)."""

    worker_id: str
    timestamp: float
    weight_step: int


@dataclass(frozen=True)
class RecordedFailure:
    """An example that produced no group in one attempt of a sampling call."""

    example_id: str
    reason: str
    attempt: int

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (for ready markers and metrics)."""
        return {"example_id": self.example_id, "reason": self.reason, "attempt": self.attempt}


@dataclass
class RolloutBatch:
    """The rows of one sampling call with their metadata.

    `rows` are `schemas.RolloutRow`s (`schemas.EvalRow`s from evaluation), grouped by `group_key`; every row
    carries `policy_step == metadata.weight_step`, `worker_id == metadata.worker_id` and the batch temperature.
    `failures` lists every per-example failure (all attempts); `env_metrics` the environment's metrics of
    the last attempt plus totals. `successes[i]` says whether row i counts as a success (the environment's
    own `info["success"]` when it gives one, else `episode_reward >= SUCCESS_REWARD`; not persisted).
    """

    batch_id: str
    lesson_id: str
    mode: str
    temperature: float
    metadata: RolloutMetadata
    rows: list[RolloutRow]
    failures: list[RecordedFailure] = field(default_factory=list)
    n_examples_requested: int = 0
    n_response_tokens: int = 0
    generate_s: float = 0.0
    env_metrics: dict[str, float] = field(default_factory=dict)
    successes: list[bool] = field(default_factory=list)

    @property
    def groups(self) -> dict[str, list[RolloutRow]]:
        """Rows by group key (insertion order)."""
        out: dict[str, list[RolloutRow]] = {}
        for r in self.rows:
            out.setdefault(r.group_key, []).append(r)
        return out


@dataclass(frozen=True)
class RolloutBatchStats:
    """Summary of a batch (what seed 000 calls RolloutBatchStats); a pure function of the batch."""

    lesson_id: str
    policy_step: int
    n_examples: int
    n_groups: int
    n_rows: int
    n_failures: int
    mean_reward: float
    success_rate: float
    mean_response_tokens: float
    truncation_rate: float
    temperature: float

    def to_summary_row(self, eval_type: str, source: str, timestamp: float | None = None) -> EvalSummaryRow:
        """The `schemas.EvalSummaryRow` of an evaluation batch (for `evals/step-S/<lesson>.summary.parquet`)."""
        return EvalSummaryRow(
            policy_step=self.policy_step,
            lesson_id=self.lesson_id,
            eval_type=eval_type,
            n_examples=self.n_groups,
            mean_reward=self.mean_reward,
            success_rate=self.success_rate,
            mean_response_tokens=self.mean_response_tokens,
            truncation_rate=self.truncation_rate,
            temperature=self.temperature,
            source=source,
            timestamp=time.time() if timestamp is None else timestamp,
        )


SUCCESS_REWARD = 1.0
"""An episode without an environment success flag counts as a success when its reward is >= this."""


def is_success(env_rollout: Any) -> bool:
    """The environment's `info["success"]` when present, else `episode_reward >= SUCCESS_REWARD`."""
    info = getattr(env_rollout, "info", None) or {}
    if "success" in info:
        return bool(info["success"] > 0)
    return float(env_rollout.episode_reward) >= SUCCESS_REWARD


def batch_stats(batch: RolloutBatch) -> RolloutBatchStats:
    """Summary statistics of a batch: means over rows; success_rate = mean of `batch.successes` (or of
    reward >= SUCCESS_REWARD when the batch carries no success flags)."""
    rows = batch.rows
    n = len(rows)
    successes = batch.successes if len(batch.successes) == n else [r.episode_reward >= SUCCESS_REWARD for r in rows]
    return RolloutBatchStats(
        lesson_id=batch.lesson_id,
        policy_step=batch.metadata.weight_step,
        n_examples=batch.n_examples_requested,
        n_groups=len(batch.groups),
        n_rows=n,
        n_failures=len(batch.failures),
        mean_reward=float(np.mean([r.episode_reward for r in rows])) if n else 0.0,
        success_rate=float(np.mean(successes)) if n else 0.0,
        mean_response_tokens=float(np.mean([len(r.response_tokens) for r in rows])) if n else 0.0,
        truncation_rate=float(np.mean([r.truncated for r in rows])) if n else 0.0,
        temperature=batch.temperature,
    )


# ---------------------------------------------------------------------------------------------
# the manager: computes, no storage, no weight sync
# ---------------------------------------------------------------------------------------------


class PolicyChangedError(RuntimeError):
    """An external server switched policies during one sampling call (the call is re-rolled)."""


class _PolicyContext:
    """The `InferenceContext` an environment sees during one sampling call: delegates to the backend, counts
    sampled tokens, and collects the policy steps an external server reports."""

    def __init__(self, tokenizer: Any, backend: Any) -> None:
        self.tokenizer = tokenizer
        self._backend = backend
        self.generated_tokens = 0
        self.calls = 0
        self.served_steps: set[int] = set()

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
        """`backend.generate` (a prompt of >= max_seq_len tokens raises the backend's PromptTooLongError)."""
        out = self._backend.generate(
            prompts, n=n, temperature=temperature, max_tokens=max_tokens, stop_tokens=stop_tokens, seed=seed
        )
        self.calls += 1
        self.generated_tokens += sum(len(c.tokens) for comps in out for c in comps)
        steps = getattr(self._backend, "last_served_steps", None)
        if steps:
            self.served_steps |= set(steps)
        return out


def build_backend(inference: InferenceConfig, model_spec: ModelSpec, model: Any, tokenizer: Any) -> Any:
    """The inference backend the config names: `OpenAIBackend` for "openai", else `make_backend`
    (dense / levanter, sampling in `model_spec.compute_dtype`, sequences of at most `model_spec.max_seq_len`)."""
    if inference.backend == "openai":
        return OpenAIBackend(inference, tokenizer, max_seq_len=model_spec.max_seq_len)
    return make_backend(inference, model, tokenizer, model_spec.max_seq_len, compute_dtype=model_spec.compute_dtype)


class RolloutManager:
    """Inference lifecycle, the policy model, environments, rollout generation and evaluation.

    Stateless in `weight_step` and `worker_id` (seed 000): they are arguments of every call and end up in
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
        backend: Any = None,
    ) -> None:
        """Start the inference backend (`policy.inference.backends.make_backend` unless `backend` is given)."""
        if max_example_retries < 0:
            raise ValueError(f"max_example_retries={max_example_retries}: must be >= 0")
        self.inference_config = inference
        self.model_spec = model_spec
        self.curriculum_config = curriculum
        self.tokenizer = tokenizer
        self.max_example_retries = max_example_retries
        self._policy_model = initial_model
        self._environments: dict[str, Environment] = {}
        self._lock = threading.RLock()
        if backend is None:
            backend = build_backend(inference, model_spec, initial_model, tokenizer)
        self._backend = backend

    # -- lifecycle ------------------------------------------------------------------------------

    @property
    def external_weights(self) -> bool:
        """True when an external server owns the weights (the `openai` backend)."""
        return bool(getattr(self._backend, "external_weights", False))

    def served_policy_step(self) -> int | None:
        """The policy step an external server says it serves (None: in-process backend or not reported)."""
        probe = getattr(self._backend, "probe_served_step", None)
        return probe() if callable(probe) else None

    def update_model(self, model: Any) -> None:
        """Swap in new policy weights; waits for a running sampling call to finish first."""
        with self._lock:
            self._policy_model = model
            self._backend.update_model(model)
        logger.info("policy model updated")

    def shutdown(self) -> None:
        """Release the inference backend."""
        with self._lock:
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
    ) -> tuple[RolloutBatch | None, dict[str, float]]:
        """Generate, score and group rollouts of one lesson with the current model.

        Returns `(batch, metrics)`; `batch` is None when no example succeeded (then `metrics` says why:
        `failures`, and the failures are logged). Rows carry `policy_step=weight_step` (or the step an
        external server reports), `worker_id`, the sampling temperature and a timestamp; `rollout_id` is
        `<batch_id>-<i>` and `group_key` `<lesson>/<env group key>/<batch_id>`. `batch_id` defaults to
        `<worker_id>.<uuid4 hex[:12]>`; the worker passes its file stem. Sampling params: `sampling` if
        given, else the lesson's training params (mode "train") or eval params (mode "eval").
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
                env, lesson_id, n_examples, n_generations, mode, gen, weight_step, sampling
            )
        generate_s = time.monotonic() - start
        now = time.time()
        rows: list[RolloutRow] = []
        for i, (gkey, r) in enumerate(rows_src):
            common = dict(
                rollout_id=f"{batch_id}-{i}",
                env_name=r.env_name,
                example_id=str(r.example_id),
                lesson_id=lesson_id,
                group_key=f"{lesson_id}/{gkey}/{batch_id}",
                prompt_tokens=list(r.prompt_tokens),
                response_tokens=list(r.response_tokens),
                response_logprobs=list(r.response_logprobs),
                token_rewards=list(r.token_rewards),
                response_loss_mask=list(r.response_loss_mask),
                episode_reward=float(r.episode_reward),
                truncated=bool(r.truncated),
                finish_reason=r.finish_reason,
                temperature=float(sampling.temperature),
                policy_step=int(step),
                worker_id=worker_id,
                timestamp=now,
            )
            rows.append(EvalRow(**common, eval_type=eval_type) if eval_type else RolloutRow(**common))
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
    ) -> tuple[list[tuple[str, Any]], list[RecordedFailure], dict[str, float], int, int]:
        """Run `env.sample`, re-drawing failed examples up to `max_example_retries` times.

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
            ctx = _PolicyContext(self.tokenizer, self._backend)
            result = env.sample(
                ctx,
                n_examples=remaining,
                n_generations=n_generations,
                temperature=sampling.temperature,
                max_tokens=sampling.max_tokens,
                stop_tokens=sampling.stop_tokens,
                rng=rng,
                mode=mode,
            )
            served = ctx.served_steps
            call_step = next(iter(served)) if len(served) == 1 else weight_step
            if len(served) > 1 or (step is not None and result.groups and call_step != step):
                # Seed 002's re-rollout: results from two policies are never mixed.
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
                env_metrics[k] = env_metrics.get(k, 0.0) + float(v) if k.startswith("n_") else float(v)
            remaining -= len(result.groups)
            if result.failures and remaining > 0 and attempt < self.max_example_retries:
                logger.info(
                    "lesson %s: %d examples failed; retrying (attempt %d of %d)",
                    lesson_id,
                    len(result.failures),
                    attempt + 1,
                    self.max_example_retries,
                )
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


# ---------------------------------------------------------------------------------------------
# pacing (pure)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PacingDecision:
    """Whether to produce now, and why not."""

    produce: bool
    reason: str
    next_slot: int
    slot_lag: int


def slot_lag(policy_step: int, slot: int) -> int:
    """Lag of a rollout from policy P used in batch slot T: (T - 1) - P (usable iff 0 <= lag <= max_lag)."""
    return (slot - 1) - policy_step


def estimate_unconsumed_rows(rows_by_policy: dict[int, int], last_slot: int, max_lag: int, batch_size: int) -> int:
    """Rows still usable by slot B+1 or later, estimated from committed row counts.

    usable = Σ rows of policies P >= B - max_lag (those with lag <= max_lag in slot B+1);
    consumed ≈ batch_size × #{committed slots T <= B that could hold them} = batch_size × min(max_lag, B);
    estimate = max(0, usable - consumed). Rows of policies P >= B cannot be in any committed slot (a slot
    T holds P <= T - 1), so the estimate never falls below their count.
    """
    lo = last_slot - max_lag
    usable = sum(n for p, n in rows_by_policy.items() if p >= lo)
    fresh = sum(n for p, n in rows_by_policy.items() if p >= last_slot)
    consumed = batch_size * min(max_lag, last_slot)
    return max(fresh, usable - consumed, 0)


def signal_rows(rows: Sequence[RolloutRow]) -> int:
    """Rows in groups (group_key, policy_step) whose episode rewards are not all equal: what a BatchMaker that
    filters zero-variance groups can admit from them."""
    rewards: dict[tuple[str, int], list[float]] = {}
    for r in rows:
        rewards.setdefault((r.group_key, r.policy_step), []).append(r.episode_reward)
    return sum(len(v) for v in rewards.values() if max(v) > min(v))


def usable_rows(rows: int, signal: int | None, *, filter_zero_variance: bool, no_signal_fill_after: int) -> int:
    """Rows of one committed file that count toward pacing.

    Without zero-variance filtering (or for a marker without `signal_rows`): every row. With it: the signal rows,
    plus the other rows divided by `no_signal_fill_after + 1` (the BatchMaker admits no-signal rows only after that
    many all-filtered files, and the next file fills the slot), or nothing for them when it never fills (0).
    """
    if not filter_zero_variance or signal is None:
        return rows
    rest = max(rows - signal, 0)
    return signal + (math.ceil(rest / (no_signal_fill_after + 1)) if no_signal_fill_after > 0 else 0)


def count_unconsumed_rows(
    files: dict[str, tuple[int, int, float]],
    entry: dict[str, Any] | None,
    last_slot: int,
    max_lag: int,
    batch_size: int,
) -> int:
    """Rollout rows usable by slot B+1 or later (policies P >= B - max_lag) that no committed slot consumed.

    `files`: committed rollout files (all workers) of policies >= B - max_lag, as path -> (policy step, rows,
    marker time); `entry`: the batch log entry of slot B (None when B = 0). In order of precision:
    - the entry holds the BatchMaker's `cursor` (steps.make_batches): exact, the live reservoir rows of usable
      policies plus the rows of committed files it has not seen yet;
    - the entry holds its commit `time`: rows of files committed after it, plus rows of policies >= B
      (which no slot <= B can hold);
    - otherwise `estimate_unconsumed_rows`.
    """
    lo = last_slot - max_lag
    usable = {path: v for path, v in files.items() if v[0] >= lo}
    if entry is None:
        return sum(n for _, n, _ in usable.values())
    cursor = entry.get("cursor")
    if isinstance(cursor, dict) and isinstance(cursor.get("reservoir"), dict):
        seen = set(cursor.get("seen") or [])
        live = sum(
            len(f.get("rows") or [])
            for f in cursor["reservoir"].get("files", [])
            if int(f.get("policy_step", -1)) >= lo
        )
        return live + sum(n for path, (_, n, _) in usable.items() if path not in seen)
    if isinstance(entry.get("time"), int | float):
        t = float(entry["time"])
        return sum(n for p, n, mt in usable.values() if mt > t or p >= last_slot)
    by_policy: dict[int, int] = {}
    for p, n, _ in usable.values():
        by_policy[p] = by_policy.get(p, 0) + n
    return estimate_unconsumed_rows(by_policy, last_slot, max_lag, batch_size)


def pacing_decision(
    *,
    policy_step: int,
    last_slot: int,
    unconsumed_rows: int,
    max_lag: int,
    batch_size: int,
    max_steps_ahead: int,
) -> PacingDecision:
    """Produce iff rollouts from `policy_step` are usable by the next slot and we are not too far ahead.

    next slot T = last_slot + 1. Pause "stale" when (T-1) - P > max_lag; pause "ahead" when
    unconsumed_rows >= max_steps_ahead × batch_size.
    """
    nxt = last_slot + 1
    lag = slot_lag(policy_step, nxt)
    if lag > max_lag:
        return PacingDecision(
            False,
            f"stale: policy {policy_step} would have lag {lag} > max_lag={max_lag} in "
            f"slot {nxt}; waiting for a newer policy",
            nxt,
            lag,
        )
    limit = max_steps_ahead * batch_size
    if unconsumed_rows >= limit:
        return PacingDecision(
            False, f"ahead: ~{unconsumed_rows} unconsumed rows >= max_steps_ahead×batch_size={limit}", nxt, lag
        )
    return PacingDecision(True, "ok", nxt, lag)


# ---------------------------------------------------------------------------------------------
# watchdog and signals
# ---------------------------------------------------------------------------------------------


class WatchdogTimeout(RuntimeError):
    """A phase overran its watchdog (raised only by test callbacks; the default ends the process)."""


def _exit_on_timeout(phase: str, timeout_s: float) -> None:
    logger.critical("watchdog: phase %r exceeded %.1fs; exiting with status %d", phase, timeout_s, WATCHDOG_EXIT_CODE)
    logging.shutdown()
    os._exit(WATCHDOG_EXIT_CODE)


@contextlib.contextmanager
def watchdog(
    phase: str, timeout_s: float | None, on_timeout: Callable[[str, float], None] = _exit_on_timeout
) -> Iterator[None]:
    """Run the block under a timer thread: if it is still running after `timeout_s`, call
    `on_timeout(phase, timeout_s)` (default: log CRITICAL and `os._exit(3)`). None/<=0 disables it."""
    if timeout_s is None or timeout_s <= 0:
        yield
        return
    timer = threading.Timer(timeout_s, on_timeout, args=(phase, timeout_s))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


class PolicyWaitTimeoutError(TimeoutError):
    """No committed policy appeared in time; the message names the marker path waited for."""


def incarnation_nonce() -> str:
    """A name part unique to this process start: `<unix ms, hex><4 random hex digits>`."""
    return f"{int(time.time() * 1000):x}{secrets.token_hex(2)}"


# ---------------------------------------------------------------------------------------------
# the worker: coordinates, stores, syncs weights
# ---------------------------------------------------------------------------------------------


@dataclass
class WorkerSummary:
    """What one `RolloutWorker.run` did."""

    files: list[str] = field(default_factory=list)
    rows: int = 0
    failures: int = 0
    policy_steps: list[int] = field(default_factory=list)
    stop_reason: str = ""


class RolloutWorker:
    """Polls for policies, asks the manager for rollouts, commits them, logs metrics, paces itself.

    `store`, `tokenizer`, `manager` and `load_model` can be injected (tests, the evaluate step); by default
    they are built from the config. `load_model(step)` returns the policy model of a committed step.
    """

    def __init__(
        self,
        config: RolloutStepConfig,
        *,
        store: RunStore | None = None,
        tokenizer: Any = None,
        manager: RolloutManager | None = None,
        load_model: Callable[[int], Any] | None = None,
        stall_grace_s: float | None = None,
    ) -> None:
        self.config = config
        self.store = store or RunStore(config.store.run_root, config.store.storage_options)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.model.tokenizer)
        self.worker_id = config.worker_id
        self.name = layout.check_component(f"{config.worker_id}.{incarnation_nonce()}", "worker name")
        self.metrics = MetricsWriter(self.store, "rollout", self.worker_id)
        self._manager = manager
        self._load_model_fn = load_model
        self._stop = threading.Event()
        self._stop_reason = ""
        self._seq = 0
        self._rng = np.random.default_rng([config.seed, int(time.time_ns() % (1 << 62))])
        self._current_step: int | None = None
        self._markers: dict[str, tuple[int, int, float]] = {}
        self._entry_cache: tuple[int, dict[str, Any] | None] = (-1, None)
        self._stall_grace_s = stall_grace_s if stall_grace_s is not None else max(2.0, 25 * config.poll_interval_s)
        self._weight_load_s = 0.0
        self._pause_s = 0.0
        self.summary = WorkerSummary()

    # -- control ------------------------------------------------------------------------------------

    def stop(self, reason: str = "stop requested") -> None:
        """Ask the loop to end after the current phase (thread/signal safe)."""
        if not self._stop.is_set():
            self._stop_reason = reason
            self._stop.set()

    def install_signal_handlers(self) -> None:
        """SIGTERM/SIGINT: finish the current phase, then exit cleanly. A second signal exits at once (130)."""

        def handler(signum: int, _frame: Any) -> None:
            if self._stop.is_set():
                logger.error("second signal %d: exiting now", signum)
                os._exit(130)
            logger.info("signal %d: stopping after the current phase", signum)
            self.stop(f"signal {signum}")

        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, handler)
            signal.signal(signal.SIGINT, handler)

    # -- reading the run root ----------------------------------------------------------------------

    def _latest_policy(self) -> int | None:
        from policy.model import latest_policy_step

        return latest_policy_step(self.store)

    def _last_batch_slot(self) -> int:
        slots = [layout.parse_step(p) for p in self.store.list(layout.BATCH_LOG) if p.endswith(".json")]
        return max(slots) if slots else 0

    def _committed_rollouts(self, lo: int, hi: int) -> dict[str, tuple[int, int, float]]:
        """Committed rollout files (all workers) of policies in [lo, hi]: path -> (policy, rows, marker time).

        rows: what the file can contribute to batches (`usable_rows`). Markers are immutable, so each is read once.
        """
        out: dict[str, tuple[int, int, float]] = {}
        for p in range(max(lo, 0), hi + 1):
            for marker in self.store.list(layout.rollout_step_dir(p)):
                if not marker.endswith(layout.READY_SUFFIX):
                    continue
                if marker not in self._markers:
                    try:
                        rec = self.store.get_json(marker)
                        sig = rec.get("signal_rows")
                        n = usable_rows(
                            int(rec.get("rows", 0)),
                            None if sig is None else int(sig),
                            filter_zero_variance=self.config.train.filter_zero_variance,
                            no_signal_fill_after=self.config.train.no_signal_fill_after,
                        )
                        self._markers[marker] = (p, n, float(rec.get("time", 0.0)))
                    except (FileNotFoundError, ValueError, AttributeError, TypeError) as e:
                        logger.warning("pacing: unreadable marker %s (%s); counted as 0 rows", marker, e)
                        self._markers[marker] = (p, 0, 0.0)
                out[layout.data_of_marker(marker)] = self._markers[marker]
        return out

    def _log_entry(self, slot: int) -> dict[str, Any] | None:
        """The batch log entry of `slot` (None for slot 0 or an unreadable entry); cached for the newest slot."""
        if slot <= 0:
            return None
        if self._entry_cache[0] != slot:
            try:
                entry = self.store.get_json(layout.batch_log_entry(slot))
            except (FileNotFoundError, ValueError) as e:
                logger.warning("pacing: cannot read %s (%s)", layout.batch_log_entry(slot), e)
                entry = None
            self._entry_cache = (slot, entry if isinstance(entry, dict) else None)
        return self._entry_cache[1]

    def _should_stop(self, started: float) -> bool:
        c = self.config
        if self._stop.is_set():
            return True
        if self.store.exists(layout.STOP_FILE):
            self.stop(f"{layout.STOP_FILE} exists")
        elif c.max_rollouts is not None and self.summary.rows >= c.max_rollouts:
            self.stop(f"max_rollouts={c.max_rollouts} reached")
        elif c.max_seconds is not None and time.monotonic() - started >= c.max_seconds:
            self.stop(f"max_seconds={c.max_seconds} reached")
        elif not c.follow and c.max_rollouts is None and c.max_seconds is None and self.summary.files:
            self.stop("one write done (not follow mode and no bounds)")
        elif c.follow and (self._latest_policy() or -1) >= c.train.num_train_steps:
            self.stop(f"learner finished (policy {c.train.num_train_steps} published)")
        return self._stop.is_set()

    # -- phases -------------------------------------------------------------------------------------

    def _load_model(self, step: int) -> Any:
        if self._load_model_fn is not None:
            return self._load_model_fn(step)
        from policy.model import load_policy, model_vocab_size, policy_metadata

        vocab = policy_metadata(self.store, step).get("vocab_size") or model_vocab_size(self.tokenizer)
        return load_policy(self.store, step, self.config.model, int(vocab))

    def wait_for_policy(self) -> int:
        """Block until a committed policy exists; return the newest step. Raises PolicyWaitTimeoutError."""
        deadline = time.monotonic() + self.config.wait_for_policy_timeout_s
        while True:
            step = self._latest_policy()
            if step is not None:
                return step
            if self._stop.is_set():
                raise PolicyWaitTimeoutError("stopped while waiting for the first policy")
            if time.monotonic() >= deadline:
                raise PolicyWaitTimeoutError(
                    f"no committed policy after {self.config.wait_for_policy_timeout_s}s: waited for "
                    f"{self.store.full_path(layout.policy_marker(0))} (or any policies/step-*/COMMITTED)"
                )
            time.sleep(self.config.poll_interval_s)

    def _load_step(self, step: int) -> Any:
        t0 = time.monotonic()
        with watchdog(f"weight load (policy {step})", self.config.weight_load_timeout_s):
            model = self._load_model(step)
        self._weight_load_s += time.monotonic() - t0
        logger.info("loaded policy %d in %.2fs", step, time.monotonic() - t0)
        return model

    def sync_weights(self) -> bool:
        """Load the newest committed policy if it is newer than the one held (never older). True if changed."""
        if self._manager is not None and self._manager.external_weights:
            return False
        latest = self._latest_policy()
        if latest is None or (self._current_step is not None and latest <= self._current_step):
            if latest is not None and self._current_step is not None and latest < self._current_step:
                logger.warning(
                    "newest committed policy %d is older than held policy %d; keeping %d",
                    latest,
                    self._current_step,
                    self._current_step,
                )
            return False
        model = self._load_step(latest)
        t0 = time.monotonic()
        with watchdog(f"model update (policy {latest})", self.config.weight_load_timeout_s):
            self.manager.update_model(model)
        self._weight_load_s += time.monotonic() - t0
        old, self._current_step = self._current_step, latest
        self.metrics.log({"event": "weights", "from_step": old, "policy_step": latest})
        return True

    @property
    def manager(self) -> RolloutManager:
        """The RolloutManager (built on first use from the config and the newest policy)."""
        if self._manager is None:
            raise RuntimeError("manager not started: call start() first")
        return self._manager

    def start(self) -> None:
        """Phase 1: wait for a policy, load it and build the manager (unless one was injected)."""
        if self._manager is not None and self._manager.external_weights:
            return
        step = self.wait_for_policy()
        if self._manager is None:
            model = self._load_step(step)
            self._manager = RolloutManager(
                self.config.inference,
                self.config.model,
                self.config.curriculum,
                self.tokenizer,
                model,
                max_example_retries=self.config.max_example_retries,
            )
        else:
            self._manager.update_model(self._load_step(step))
        self._current_step = step
        self.metrics.log({"event": "weights", "from_step": None, "policy_step": step})

    def _policy_for_pacing(self) -> int:
        if self.manager.external_weights:
            step = self.manager.served_policy_step()
            if step is None:
                raise RuntimeError(
                    "the openai backend's server does not report its policy step (header X-Policy-Step or a "
                    "model name ending in step-<N>); rollouts cannot be tagged"
                )
            return step
        assert self._current_step is not None
        return self._current_step

    def pace(self) -> PacingDecision:
        """Decide whether to produce now (see `pacing_decision`)."""
        c = self.config
        policy = self._policy_for_pacing()
        last_slot = self._last_batch_slot()
        files = self._committed_rollouts(last_slot - c.train.max_lag, max(policy, last_slot))
        unconsumed = count_unconsumed_rows(
            files, self._log_entry(last_slot), last_slot, c.train.max_lag, c.train.batch_size
        )
        return pacing_decision(
            policy_step=policy,
            last_slot=last_slot,
            unconsumed_rows=unconsumed,
            max_lag=c.train.max_lag,
            batch_size=c.train.batch_size,
            max_steps_ahead=c.max_steps_ahead,
        )

    def _choose_lesson(self) -> str:
        state = load_latest_curriculum(self.store, self.config.curriculum)
        return sample_lesson(sampling_weights(state, self.config.curriculum), self._rng)

    def write(self, batch: RolloutBatch) -> str:
        """Commit the batch as `rollouts/step-P/<name>-<seq>.parquet` (+ ready marker); return the path."""
        P = batch.metadata.weight_step
        rel = layout.rollout_file(P, self.name, self._seq)
        table = ROLLOUT.to_table(batch.rows)
        extra = {
            "worker_id": self.worker_id,
            "worker_name": self.name,
            "policy_step": P,
            "lesson_id": batch.lesson_id,
            "mode": batch.mode,
            "signal_rows": signal_rows(batch.rows),
            "n_failures": len(batch.failures),
            "failures": [f.to_json() for f in batch.failures[:200]],
        }
        with watchdog(f"write {rel}", self.config.write_timeout_s):
            committed = self.store.commit_data(rel, table, ROLLOUT, extra=extra)
        if not committed:
            raise RuntimeError(f"{rel} was already committed: file names of this incarnation collided")
        self._seq += 1
        return rel

    def _batch_id(self) -> str:
        return f"{self.name}-{self._seq:08d}"

    def run(self) -> WorkerSummary:
        """Run phases 1-2 of the module docstring until stopped; returns what was done."""
        c = self.config
        started = time.monotonic()
        self.start()
        last_progress = (self._last_batch_slot(), self._latest_policy(), time.monotonic())
        writes = 0
        try:
            while not self._should_stop(started):
                self.sync_weights()
                decision = self.pace()
                state = (self._last_batch_slot(), self._latest_policy())
                if state != last_progress[:2]:
                    last_progress = (*state, time.monotonic())
                if not decision.produce:
                    stalled = time.monotonic() - last_progress[2]
                    if not (decision.reason.startswith("ahead") and stalled >= self._stall_grace_s):
                        logger.debug("pausing: %s", decision.reason)
                        t0 = time.monotonic()
                        self._stop.wait(c.poll_interval_s)
                        self._pause_s += time.monotonic() - t0
                        continue
                    logger.info(
                        "pacing: no batch/policy progress for %.1fs while paused (%s); producing one write anyway",
                        stalled,
                        decision.reason,
                    )
                    last_progress = (*state, time.monotonic())
                t0 = time.monotonic()
                lesson_id = self._choose_lesson()
                t_lesson = time.monotonic() - t0
                sp = c.curriculum.sampling_for(lesson_id)
                n_examples = sp.n_prompts
                if c.max_rollouts is not None:
                    left = c.max_rollouts - self.summary.rows
                    n_examples = max(1, min(n_examples, math.ceil(left / sp.n_generations_per_prompt)))
                if c.curriculum.micro_eval_frequency and writes and writes % c.curriculum.micro_eval_frequency == 0:
                    self._micro_eval(lesson_id)
                policy = self._policy_for_pacing()
                with watchdog(f"generation (lesson {lesson_id})", c.generation_timeout_s):
                    batch, m = self.manager.sample_batch(
                        lesson_id,
                        n_examples,
                        sp.n_generations_per_prompt,
                        "train",
                        self._rng,
                        policy,
                        self.worker_id,
                        batch_id=self._batch_id(),
                    )
                self.summary.failures += int(m["failures"])
                if batch is None:
                    self.metrics.log({"event": "empty", "lesson_id": lesson_id, **m})
                    continue
                t0 = time.monotonic()
                rel = self.write(batch)
                write_s = time.monotonic() - t0
                writes += 1
                self._log_write(batch, m, rel, write_s, t_lesson)
        finally:
            self.summary.stop_reason = self._stop_reason or "error"
            self.metrics.log(
                {
                    "event": "stop",
                    "reason": self.summary.stop_reason,
                    "rows": self.summary.rows,
                    "files": len(self.summary.files),
                }
            )
            self.metrics.flush()
        logger.info(
            "rollout worker %s stopped (%s): %d files, %d rows, %d failures",
            self.name,
            self.summary.stop_reason,
            len(self.summary.files),
            self.summary.rows,
            self.summary.failures,
        )
        return self.summary

    def _micro_eval(self, lesson_id: str) -> None:
        c = self.config
        policy = self._policy_for_pacing()
        with watchdog(f"micro-eval (lesson {lesson_id})", c.generation_timeout_s):
            stats, _ = self.manager.evaluate_lesson(
                lesson_id,
                c.curriculum.micro_eval_n_examples,
                "micro_eval",
                self._rng,
                len(self.summary.files),
                policy,
                self.worker_id,
            )
        self.metrics.log({"event": "micro_eval", **dataclasses.asdict(stats)})

    def _log_write(self, batch: RolloutBatch, m: dict[str, float], rel: str, write_s: float, t_lesson: float) -> None:
        c = self.config
        P = batch.metadata.weight_step
        latest = self._latest_policy()
        last_slot = self._last_batch_slot()
        stats = batch_stats(batch)
        gen_s = max(batch.generate_s, 1e-9)
        self.summary.files.append(rel)
        self.summary.rows += len(batch.rows)
        self.summary.policy_steps.append(P)
        self.metrics.log(
            {
                "event": "write",
                "file": rel,
                "lesson_id": batch.lesson_id,
                "policy_step": P,
                **{k: v for k, v in m.items() if not k.startswith("time/")},
                "rollouts_per_s": len(batch.rows) / gen_s,
                "tokens_per_s": batch.n_response_tokens / gen_s,
                "mean_reward": stats.mean_reward,
                f"reward/{batch.lesson_id}": stats.mean_reward,
                "truncation_rate": stats.truncation_rate,
                "policy_lag": (latest if latest is not None else P) - P,
                "slot_lag": slot_lag(P, last_slot + 1),
                "max_lag": c.train.max_lag,
                "time/generate_s": batch.generate_s,
                "time/write_s": write_s,
                "time/weight_load_s": self._weight_load_s,
                "time/pause_s": self._pause_s,
                "time/sample_lesson_s": t_lesson,
            }
        )
        self._weight_load_s = 0.0
        self._pause_s = 0.0
        logger.info(
            "wrote %s: %d rows, lesson %s, policy %d, reward %.3f, %.1f tok/s",
            rel,
            len(batch.rows),
            batch.lesson_id,
            P,
            stats.mean_reward,
            batch.n_response_tokens / gen_s,
        )

    def shutdown(self) -> None:
        """Release the manager's backend."""
        if self._manager is not None:
            self._manager.shutdown()


def main(config: RolloutStepConfig) -> int:
    """Run one rollout worker until stopped; returns the exit status (0: clean stop)."""
    worker = RolloutWorker(config)
    worker.install_signal_handlers()
    try:
        worker.run()
    finally:
        worker.shutdown()
    return 0


def cli(argv: list[str] | None = None) -> int:
    """`python -m steps.rollout [--config_path F] [--field value …]`; returns the exit code."""
    from steps.cli import run_program

    return run_program(RolloutStepConfig, main, argv)


if __name__ == "__main__":
    raise SystemExit(cli())
