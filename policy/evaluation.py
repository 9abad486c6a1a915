"""Evaluation's loop (`steps.evaluate`): the `Evaluator` and the phases its `main` calls.

The `Evaluator` holds one run root's evaluation: the tokenizer, the model and its `RolloutManager` (built once, on
the first policy loaded), the policies set aside as damaged (`skip`: quarantined with the reason) and those done.
`evaluate_step` writes each missing lesson of one policy (rollouts, then the summary: its commit, with pass@k,
`with_pass_at_k`), seeded per lesson (`lesson_seed`: every policy scored on the same problems); `evaluate_external`
the same for a Hugging Face checkpoint (`external_model`). `following` tells follow mode from explicit targets;
`follow` evaluates policies as they are committed, `explicit_targets` lists what `--all` / `--steps` name;
`report_skipped` ends a run that skipped a policy `--steps` named. `recorded_config` is the config of
`python -m steps.evaluate --store.run_root R` (`EvaluateCommand`): the run's own evaluator, from its run.json.

JAX, the model and the backends are imported only when a policy is first loaded: a rerun with nothing left to
evaluate (`steps.early`) imports this module without them.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import math
import time
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np

from pipeline.config import ConfigError, EvaluateStepConfig, ModelSpec
from pipeline.config.model import MODEL_FAMILIES, SHAPE_FIELDS
from pipeline.config.steps import EvaluateCommand
from pipeline.process.exits import DamagedInputError
from pipeline.process.step_kind import StepKind
from pipeline.rollout.passk import pass_at_k_of_groups
from pipeline.rollout.rollout_batch import SUCCESS_REWARD
from pipeline.store import layout, run_state
from pipeline.store.notify import waker_for
from pipeline.store.poll import poll_until
from pipeline.store.storage import RunStore
from pipeline.telemetry.metrics import MetricsWriter
from schemas import EVAL_ROW, EVAL_SUMMARY, EvalSummaryRow

logger = logging.getLogger("rlpipe.evaluate")
"""The program's logger (its lines read `rlpipe.evaluate` wherever the code that logs them lives)."""

WORKER_ID = "evaluator"


def with_pass_at_k(summary: EvalSummaryRow, batch: Any, k: int) -> EvalSummaryRow:
    """`summary` with pass@k and mean@k (`pipeline.rollout.passk`) of the batch's problems (its groups: the samples
    of one prompt, one per episode, successes as the batch judged them); `k` 0: the samples per problem. Unchanged
    without rows."""
    if batch is None or not batch.rows:
        return summary
    flags = batch.successes if len(batch.successes) == len(batch.rows) else [None] * len(batch.rows)
    groups: dict[str, list[tuple[float, bool]]] = {}
    for row, ok in zip(batch.rows, flags, strict=True):
        if row.segment_index != 0:  # an episode written as several segment rows is one sample
            continue
        success = bool(ok) if ok is not None else row.episode_reward >= SUCCESS_REWARD
        groups.setdefault(row.group_key, []).append((float(row.episode_reward), success))
    p = pass_at_k_of_groups(groups, k or None)
    if p is None:
        return summary
    return dataclasses.replace(
        summary, samples_per_problem=p.n, pass_k=p.k, pass_at_k=p.pass_at_k, mean_at_k=p.mean_at_k
    )


def lesson_seed(seed: int, policy_step: int, lesson_id: str) -> int:
    """Deterministic evaluation seed of one lesson. `policy_step` is deliberately not mixed in: every
    checkpoint is scored on the same problems, so curves compare like with like."""
    digest = hashlib.sha256(f"{seed}/{lesson_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def recorded_config(store: RunStore, command: EvaluateCommand) -> EvaluateStepConfig:
    """The evaluator's config as the run's run.json gives it (the job's own evaluator: model, curriculum, inference,
    seed), with the command's targets; ConfigError naming `store.run_root` when run.json has no readable job config."""
    from pipeline.jobs.job import recorded_step_config

    base: EvaluateStepConfig = recorded_step_config(store, StepKind.EVALUATE)
    return dataclasses.replace(
        base,
        store=command.store,
        steps=list(command.steps),
        all=command.all,
        follow=command.follow,
        hf_checkpoint=command.hf_checkpoint,
        force=command.force,
        n_examples=command.n_examples if command.n_examples is not None else base.n_examples,
    )


def external_model(model: ModelSpec, path: str) -> ModelSpec:
    """The spec of HF checkpoint `path`: its family and shape from its config.json (the run's shape fields back to
    their defaults, as `model.hf_checkpoint` requires; no LoRA), the run's tokenizer, dtypes and max_seq_len kept.
    ConfigError naming `hf_checkpoint` when the folder has no config.json or is of a family we do not build."""
    from policy.families import hf_metadata_folder

    try:
        folder = hf_metadata_folder(path)
        hf_config = json.loads((Path(folder) / "config.json").read_text())
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError) as e:
        why = f"not a Hugging Face checkpoint folder (no readable config.json: {e})"
        raise ConfigError("hf_checkpoint", path, why) from None
    family = hf_config.get("model_type") if isinstance(hf_config, dict) else None
    if family not in MODEL_FAMILIES:
        raise ConfigError("hf_checkpoint", path, f"a {family!r} checkpoint; the families evaluated: {MODEL_FAMILIES}")
    shape = {name: getattr(ModelSpec, name) for name in SHAPE_FIELDS}
    return dataclasses.replace(model, family=family, hf_checkpoint=path, lora=None, **shape)


class Evaluator:
    """Evaluates policies of one run root; builds the model and the RolloutManager once."""

    def __init__(self, cfg: EvaluateStepConfig) -> None:
        from pipeline.environments.tokenizer import check_chat_lessons, load_tokenizer

        self.cfg = cfg
        self.store = RunStore(cfg.store.run_root, cfg.store.storage_options)
        self.tokenizer = load_tokenizer(cfg.model.tokenizer)
        check_chat_lessons(cfg.curriculum.lessons, self.tokenizer, cfg.model.tokenizer)
        self.metrics = MetricsWriter(self.store, StepKind.EVALUATE, WORKER_ID, flush_every=1)
        self._manager: Any = None
        self._loaded_step: int | None = None
        self.skipped: dict[int, str] = {}
        """Policies whose files failed verification on read: {step: the one-line reason} (see `skip`)."""
        self.done: set[int] = set()
        """Policies this process evaluated (or found evaluated): `follow` never looks at them again, so a wake costs
        no existence check per evaluated policy, and `--force` re-evaluates each policy once, not forever."""

    # -- model ----------------------------------------------------------------------------------
    @functools.cached_property
    def vocab_size(self) -> int:
        """The model's vocabulary size; found when a model is first built (`policy.model` imports JAX and levanter,
        ~2 CPU s, which a rerun with nothing left to evaluate never needs)."""
        from policy.model import model_vocab_size

        return model_vocab_size(self.tokenizer)

    def _manager_for(self, model: Any) -> Any:
        from policy.rollout_manager import RolloutManager

        if self._manager is None:
            self._manager = RolloutManager(
                self.cfg.inference, self.cfg.model, self.cfg.curriculum, self.tokenizer, model
            )
        else:
            self._manager.update_model(model)
        return self._manager

    def _load(self, step: int) -> Any:
        from policy.policy_format import read_policy

        if self._loaded_step != step:
            self._manager_for(read_policy(self.store, step, self.cfg.model, self.vocab_size))
            self._loaded_step = step
        return self._manager

    # -- what to do -------------------------------------------------------------------------------
    def committed_steps(self) -> list[int]:
        """Committed policy steps, ascending (listing is the truth)."""
        return run_state.committed_steps(self.store, layout.POLICIES)

    def missing_lessons(self, step: int, external: str | None = None) -> list[str]:
        """Lessons of `step` without a committed summary (all of them with --force)."""
        lessons = sorted(self.cfg.curriculum.lessons)
        if self.cfg.force:
            return lessons
        return [
            lesson
            for lesson in lessons
            if not self.store.exists(layout.eval_summary_file(step, lesson, external=external))
        ]

    # -- evaluation --------------------------------------------------------------------------------
    def evaluate_step(self, step: int, *, manager: Any = None, external: str | None = None) -> int:
        """Evaluate the missing lessons of one policy; returns the number of lessons written."""
        todo = self.missing_lessons(step, external)
        if not todo:
            logger.info("policy %d: every lesson already evaluated", step)
            if external is None:
                self.done.add(step)
            return 0
        if manager is None:
            if step in self.skipped:
                return 0
            try:
                manager = self._load(step)
            except DamagedInputError as e:
                self.skip(step, e)
                return 0
        for lesson in todo:
            self.evaluate_lesson(manager, step, lesson, external)
        if external is None:
            self.done.add(step)
        return len(todo)

    def skip(self, step: int, error: DamagedInputError) -> None:
        """Set policy `step` aside: its damaged file is quarantined with the reason (what the report lists as
        skipped), one warning line, and the evaluation goes on with the next policy."""
        if not self.store.is_quarantined(error.path):
            self.store.quarantine(error.path, error.reason)
        self.skipped[step] = str(error)
        logger.warning("skipped policy %d (damaged: %s); going on with the next one", step, error)

    def damaged_policies(self) -> dict[int, str]:
        """Policies set aside (a file of `policies/step-S/` quarantined, by this process or an earlier one):
        {S: why}."""
        out = dict(self.skipped)
        for path in sorted(self.store.quarantined()):
            if path.startswith(f"{layout.POLICIES}/step-") and layout.parse_step(path) not in out:
                try:
                    reason = str(self.store.get_json(layout.quarantine_record(path))["reason"])
                except (FileNotFoundError, ValueError, KeyError, TypeError):
                    reason = "quarantined (no readable reason)"
                out[layout.parse_step(path)] = f"{path}: {reason}"
        return out

    def evaluate_lesson(self, manager: Any, step: int, lesson: str, external: str | None) -> None:
        """Evaluate one lesson of policy `step`: rollouts, then the summary (its commit), then a metrics record."""
        t0 = time.monotonic()
        n = self.cfg.n_examples or self.cfg.curriculum.eval_n_examples
        rng = np.random.default_rng(lesson_seed(self.cfg.seed, step, lesson))
        stats, batch = manager.evaluate_lesson(lesson, n, "eval", rng, step, step, WORKER_ID)
        rows = batch.rows if batch is not None else []
        source = external or layout.policy_dir(step)
        self.store.write_parquet(
            layout.eval_rollouts_file(step, lesson, external=external), EVAL_ROW.to_table(rows), EVAL_ROW
        )
        summary = with_pass_at_k(stats.to_summary_row("eval", source), batch, self.cfg.curriculum.eval_pass_k)
        self.store.write_parquet(
            layout.eval_summary_file(step, lesson, external=external), EVAL_SUMMARY.to_table([summary]), EVAL_SUMMARY
        )
        self.metrics.log(
            {
                "policy_step": step,
                "lesson_id": lesson,
                "mean_reward": stats.mean_reward,
                "success_rate": stats.success_rate,
                "pass_at_k": summary.pass_at_k,
                "mean_at_k": summary.mean_at_k,
                "n_rows": stats.n_rows,
                "failures": stats.n_failures,
                "eval_s": time.monotonic() - t0,
                "external": external or "",
            }
        )
        logger.info(
            "evaluated %s on %s: mean reward %.3f, success %.3f (%d rows)",
            source,
            lesson,
            stats.mean_reward,
            stats.success_rate,
            stats.n_rows,
        )

    def evaluate_external(self, path: str) -> int:
        """Evaluate a Hugging Face checkpoint folder as a baseline (`evals/external-<name>/`)."""
        from policy.model import build_model

        name = PurePosixPath(path.rstrip("/")).name.replace(" ", "_") or "hf"
        spec = external_model(self.cfg.model, path)
        model = build_model(spec, self.vocab_size)
        from policy.rollout_manager import RolloutManager

        manager = RolloutManager(self.cfg.inference, spec, self.cfg.curriculum, self.tokenizer, model)
        try:
            return self.evaluate_step(0, manager=manager, external=name)
        finally:
            manager.shutdown()

    def close(self) -> None:
        self.metrics.flush()
        if self._manager is not None:
            self._manager.shutdown()


def report_skipped(cfg: EvaluateStepConfig, evaluator: Evaluator) -> None:
    """One warning line per run naming the policies skipped as damaged; with explicit `--steps`, a skipped policy
    ends the program in DamagedInputError (exit code 7) once every other target is evaluated: the user asked for it."""
    if not evaluator.skipped:
        return
    listed = "; ".join(f"policy {s}: {why}" for s, why in sorted(evaluator.skipped.items()))
    logger.warning("skipped %d damaged %s (quarantined; the report lists them): %s", len(evaluator.skipped),
                   "policy" if len(evaluator.skipped) == 1 else "policies", listed)  # fmt: skip
    named = sorted(s for s in evaluator.skipped if s in set(cfg.steps)) if not cfg.all else []
    if named:
        first = evaluator.skipped[named[0]]
        path, _, reason = first.partition(": ")
        raise DamagedInputError(path, f"{reason} (policy {named[0]} named by --steps was not evaluated)")


def follow(evaluator: Evaluator) -> None:
    """Evaluate every eval_frequency-th policy and the final one as they appear, until the final
    one (`stop_after_step`) is evaluated or control/STOP exists. Waits (without a bound) through `poll_until`."""
    final = evaluator.cfg.stop_after_step
    freq = max(1, evaluator.cfg.curriculum.eval_frequency)
    what = f"a policy to evaluate (a multiple of eval_frequency={freq}, or the final one {final}) or {layout.STOP_FILE}"

    def next_event() -> tuple[str, int | None] | None:
        steps = evaluator.committed_steps()
        step = next_to_follow(evaluator, steps)
        if step is not None:
            return "evaluate", step
        if final is not None and final in steps:
            return "final", final
        if evaluator.store.exists(layout.STOP_FILE):
            return "stop", None
        return None

    while True:
        (event, step), _ = poll_until(
            next_event,
            timeout_s=math.inf,
            what=what,
            interval_s=evaluator.cfg.polling.interval_s,
            log=logger,
            waker=waker_for(evaluator.store),
        )
        if event == "evaluate" and step is not None:
            evaluator.evaluate_step(step)  # then re-list: a newer policy may have appeared meanwhile
        elif event == "final":
            logger.info("final policy %d evaluated; done", final)
            return
        else:
            logger.info("stop file found; done")
            return


def next_to_follow(evaluator: Evaluator, steps: list[int]) -> int | None:
    """The oldest of `steps` of interest (a multiple of eval_frequency, or the final one) with a lesson not yet
    evaluated (with `--force`: not yet evaluated by this process); None when there is none."""
    freq = max(1, evaluator.cfg.curriculum.eval_frequency)
    for s in steps:
        if s in evaluator.skipped or s in evaluator.done:  # damaged: set aside, never retried
            continue
        if s % freq == 0 or s == evaluator.cfg.stop_after_step:
            if evaluator.missing_lessons(s):
                return s
            evaluator.done.add(s)  # evaluated by an earlier run of the evaluator: summaries are never taken back
    return None


def following(cfg: EvaluateStepConfig) -> bool:
    """Follow mode, unless explicit targets are given.

    Explicit targets (--all, --steps, --hf_checkpoint) make a bounded run even when the config says follow:
    the job's evaluator config (follow mode) is the base of `steps.run step evaluate`, whose `--all true`
    must not silently fall back to following eval_frequency multiples.
    """
    explicit = bool(cfg.all or cfg.steps or cfg.hf_checkpoint)
    if cfg.follow and explicit:
        logger.info("explicit targets (--all/--steps/--hf_checkpoint) given: evaluating them, not following")
    return cfg.follow and not explicit


def explicit_targets(cfg: EvaluateStepConfig, evaluator: Evaluator) -> list[int]:
    """The policies `--all` / `--steps` name, ascending; ConfigError naming `steps` for one not committed."""
    committed = evaluator.committed_steps()
    targets = committed if cfg.all else sorted(set(cfg.steps))
    for s in targets:
        if s not in committed:
            raise ConfigError("steps", s, f"policy {s} is not committed ({layout.policy_marker(s)} is missing)")
    return targets
