"""The evaluate step: score saved policies (or an external Hugging Face checkpoint) on every lesson.

Reads
    policies/step-S/COMMITTED (+ weights)          the policies to evaluate (committed only)
    evals/step-S/<lesson>.summary.parquet          what is already evaluated (skipped unless --force)
Writes
    evals/step-S/<lesson>.parquet                  evaluation rollouts (schemas.EVAL_ROW)
    evals/step-S/<lesson>.summary.parquet          the summary (schemas.EVAL_SUMMARY), written LAST: its
                                                   presence commits the evaluation of that lesson
    evals/external-<name>/…                        the same for an external HF checkpoint (--hf_checkpoint)
    metrics/evaluate/…                             one record per evaluated (policy, lesson)

Algorithm: for each target policy (explicit `--steps`, `--all` committed policies, or `--follow`:
every policy whose step is a multiple of `curriculum.eval_frequency` plus the final one, as they
appear; explicit `--steps`/`--all`/`--hf_checkpoint` win over a `follow` inherited from the job config, as under
`python -m steps.run step evaluate`), for each lesson in sorted order whose summary is missing
(or with `--force`): evaluate with the lesson's eval sampling params (temperature 0 by default)
through a `RolloutManager` with a seed derived from (seed, lesson) (see `lesson_seed`), write
rollouts then the summary. Idempotent: a rerun writes nothing new; a run killed midway completes
the missing (policy, lesson) pairs on the next run.
The BatchMaker folds the summaries into the curriculum (it is the one curriculum writer).

Run
    python -m steps.evaluate --store.run_root runs/demo --all true
    python -m steps.evaluate --store.run_root runs/demo --steps "[0,10]" --force true
    python -m steps.evaluate --store.run_root runs/demo --hf_checkpoint /path/to/hf_folder
    make evaluate RUN=runs/demo ARGS="--all true"
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import sys
import time
from pathlib import PurePosixPath
from typing import Any

import numpy as np

from pipeline.config import ConfigError, EvaluateStepConfig, validate_evaluate
from pipeline.process.step_kind import StepKind
from pipeline.store import layout, run_state
from pipeline.store.notify import waker_for
from pipeline.store.poll import poll_until
from pipeline.store.storage import RunStore
from pipeline.telemetry.metrics import MetricsWriter
from schemas import EVAL_ROW, EVAL_SUMMARY

logger = logging.getLogger("rlpipe.evaluate")

WORKER_ID = "evaluator"


def lesson_seed(seed: int, policy_step: int, lesson_id: str) -> int:
    """Deterministic evaluation seed of one lesson. `policy_step` is deliberately not mixed in: every
    checkpoint is scored on the same problems, so curves compare like with like."""
    digest = hashlib.sha256(f"{seed}/{lesson_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


class Evaluator:
    """Evaluates policies of one run root; builds the model and the RolloutManager once."""

    def __init__(self, cfg: EvaluateStepConfig) -> None:
        from pipeline.environments.tokenizer import check_chat_lessons, load_tokenizer
        from policy.model import model_vocab_size

        self.cfg = cfg
        self.store = RunStore(cfg.store.run_root, cfg.store.storage_options)
        self.tokenizer = load_tokenizer(cfg.model.tokenizer)
        check_chat_lessons(cfg.curriculum.lessons, self.tokenizer, cfg.model.tokenizer)
        self.vocab_size = model_vocab_size(self.tokenizer)
        self.metrics = MetricsWriter(self.store, StepKind.EVALUATE, WORKER_ID, flush_every=1)
        self._manager: Any = None
        self._loaded_step: int | None = None

    # -- model ----------------------------------------------------------------------------------
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
            return 0
        manager = manager or self._load(step)
        for lesson in todo:
            self.evaluate_lesson(manager, step, lesson, external)
        return len(todo)

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
        summary = stats.to_summary_row("eval", source)
        self.store.write_parquet(
            layout.eval_summary_file(step, lesson, external=external), EVAL_SUMMARY.to_table([summary]), EVAL_SUMMARY
        )
        self.metrics.log(
            {
                "policy_step": step,
                "lesson_id": lesson,
                "mean_reward": stats.mean_reward,
                "success_rate": stats.success_rate,
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
        import dataclasses

        from policy.model import build_model

        name = PurePosixPath(path.rstrip("/")).name.replace(" ", "_") or "hf"
        spec = dataclasses.replace(self.cfg.model, hf_checkpoint=path)
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


def main(cfg: EvaluateStepConfig) -> int:
    """Evaluate what the config names (phases: external baseline, then follow or the explicit targets); 0."""
    validate_evaluate(cfg)
    evaluator = Evaluator(cfg)
    try:
        if cfg.hf_checkpoint:
            evaluator.evaluate_external(cfg.hf_checkpoint)
        if following(cfg):
            follow(evaluator)
        else:
            for s in explicit_targets(cfg, evaluator):
                evaluator.evaluate_step(s)
    finally:
        evaluator.close()
    return 0


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
    evaluated; None when there is none."""
    freq = max(1, evaluator.cfg.curriculum.eval_frequency)
    for s in steps:
        if (s % freq == 0 or s == evaluator.cfg.stop_after_step) and evaluator.missing_lessons(s):
            return s
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


def cli(argv: list[str] | None = None) -> int:
    """`python -m steps.evaluate [--config_path F] [--field value …]`; returns the exit code."""
    from steps.cli import run_program

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return run_program(EvaluateStepConfig, main, argv)


if __name__ == "__main__":
    sys.exit(cli())
