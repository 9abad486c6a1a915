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

A committed policy whose files fail verification on read (a COMMITTED marker cut or missing a field, a weights file
truncated or replaced) is skipped with its reason: the damaged file is quarantined (`quarantine/`, which the report
lists), one warning line names it, and the evaluation goes on with the next policy (exit 0 under `--all` and
`--follow`; a policy named by `--steps` ends the run in one line, exit code 7, once the other targets are done).

Algorithm: for each target policy (explicit `--steps`, `--all` committed policies, or `--follow`:
every policy whose step is a multiple of `curriculum.eval_frequency` plus the final one, as they
appear; explicit `--steps`/`--all`/`--hf_checkpoint` win over a `follow` inherited from the job config, as under
`python -m steps.run step evaluate`), for each lesson in sorted order whose summary is missing
(or with `--force`): evaluate with the lesson's eval sampling params (temperature 0 by default)
through a `RolloutManager` with a seed derived from (seed, lesson) (see `lesson_seed`), write
rollouts then the summary. Idempotent: a rerun writes nothing new; a run killed midway completes
the missing (policy, lesson) pairs on the next run. With nothing left to evaluate (every policy it would evaluate
has its summaries; following: and the final policy is committed) it ends before importing JAX (`steps.early`).
The BatchMaker folds the summaries into the curriculum (it is the one curriculum writer).

Config: `python -m steps.evaluate --store.run_root R …` (what `make evaluate RUN=R` runs) is read-only towards
run.json: the model, curriculum, inference and seed are the run's own, as its run.json records them (the evaluator
the job would start); the flags say only what to evaluate (`EvaluateCommand`). Nothing is compared with or written to
run.json. A run root that does not exist or has no run.json is refused (one line naming it, exit 2, nothing created).
With `--config_path FILE` the program takes a whole `EvaluateStepConfig` instead: that is how the job runner starts
its evaluator (and `python -m steps.run step evaluate`), checked against run.json as every step config is.

An external checkpoint (`--hf_checkpoint DIR`) is evaluated with the model its config.json describes (family and
shape); the run's tokenizer, dtypes and max_seq_len are kept (a vocabulary of another size is resized to the
tokenizer's), as the run's prompts and rewards are.

Run
    python -m steps.evaluate --store.run_root runs/demo --all true
    python -m steps.evaluate --store.run_root runs/demo --steps 0,10 --force true     # or --steps "[0,10]"
    python -m steps.evaluate --store.run_root runs/demo --hf_checkpoint /path/to/hf_folder
    make evaluate RUN=runs/demo ARGS="--all true"
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import math
import os
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import numpy as np

from pipeline.config import ConfigError, EvaluateStepConfig, ModelSpec, StoreConfig
from pipeline.config.model import MODEL_FAMILIES, SHAPE_FIELDS
from pipeline.config.steps import EvaluateTargets
from pipeline.environments.start_checks import check_evaluate_step
from pipeline.process.exits import DamagedInputError
from pipeline.process.step_kind import StepKind
from pipeline.rollout.passk import pass_at_k_of_groups
from pipeline.rollout.rollout_batch import SUCCESS_REWARD
from pipeline.store import layout, run_state
from pipeline.store.notify import waker_for
from pipeline.store.poll import poll_until
from pipeline.store.storage import RunStore, require_run
from pipeline.telemetry.metrics import MetricsWriter
from schemas import EVAL_ROW, EVAL_SUMMARY, EvalSummaryRow

logger = logging.getLogger("rlpipe.evaluate")

WORKER_ID = "evaluator"


def with_pass_at_k(summary: EvalSummaryRow, batch: Any, k: int) -> EvalSummaryRow:
    """`summary` with pass@k and mean@k (`pipeline.rollout.passk`) of the batch's problems (its groups: the samples
    of one prompt, successes as the batch judged them); `k` 0: the samples per problem. Unchanged without rows."""
    if batch is None or not batch.rows:
        return summary
    flags = batch.successes if len(batch.successes) == len(batch.rows) else [None] * len(batch.rows)
    groups: dict[str, list[tuple[float, bool]]] = {}
    for row, ok in zip(batch.rows, flags, strict=True):
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


@dataclass(frozen=True)
class EvaluateCommand(EvaluateTargets):
    """`python -m steps.evaluate --store.run_root R …` (`make evaluate`): evaluate policies of an existing run with
    the model, curriculum, inference and seed its run.json records; these flags say only what to evaluate."""

    store: StoreConfig = field(default_factory=StoreConfig)
    """The run root whose policies are evaluated (it must hold run.json)."""


STEPS_FLAG = "--steps"
STEPS_FORM = "policy steps as 3,5 (or [3,5])"


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


def main(cfg: EvaluateStepConfig) -> int:
    """Evaluate what the config names (phases: external baseline, then follow or the explicit targets); 0."""
    from steps.early import evaluate_nothing_to_do

    if (rc := evaluate_nothing_to_do(cfg)) is not None:  # before the checks and the evaluator import JAX
        return rc
    check_evaluate_step(cfg)
    evaluator = Evaluator(cfg)
    try:
        if cfg.hf_checkpoint:
            evaluator.evaluate_external(cfg.hf_checkpoint)
        if following(cfg):
            evaluator.skipped.update(evaluator.damaged_policies())
            follow(evaluator)
        else:
            targets = explicit_targets(cfg, evaluator)
            evaluator.skipped.update({s: why for s, why in evaluator.damaged_policies().items() if s in targets})
            for s in targets:
                evaluator.evaluate_step(s)
    finally:
        evaluator.close()
    report_skipped(cfg, evaluator)
    return 0


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


def evaluate_run(command: EvaluateCommand) -> int:
    """`python -m steps.evaluate --store.run_root R …`: refuse a run root without run.json (MissingRunError, nothing
    created) or a command with nothing to evaluate, then evaluate with the run's recorded config; 0."""
    store = RunStore(command.store.run_root, command.store.storage_options or None)
    require_run(store)
    if not (command.all or command.steps or command.follow or command.hf_checkpoint):
        raise ConfigError(
            "steps", [], "nothing to evaluate: give --all true, --steps 3,5, --follow true or --hf_checkpoint DIR"
        )
    return main(recorded_config(store, command))


def steps_flag_as_list(argv: Sequence[str]) -> list[str]:
    """`argv` with `--steps 3,5` (or `--steps=3,5`, `--steps 3`) written as draccus's `[3,5]`; ConfigError naming
    `steps` and the accepted form for a value that is neither."""
    out: list[str] = []
    it = iter(argv)
    for a in it:
        if a == STEPS_FLAG:
            value = next(it, None)
            out += [a] if value is None else [a, steps_value(value)]
        elif a.startswith(f"{STEPS_FLAG}="):
            out.append(f"{STEPS_FLAG}={steps_value(a.split('=', 1)[1])}")
        else:
            out.append(a)
    return out


def steps_value(value: str) -> str:
    """`3,5`, `3, 5`, `[3,5]` or `3` as `[3,5]` / `[3]`; ConfigError (naming `steps`, giving the form) otherwise."""
    inner = value.strip()
    if inner.startswith("[") and inner.endswith("]"):
        inner = inner[1:-1].strip()
    if not re.fullmatch(r"(\d+(\s*,\s*\d+)*)?", inner):
        raise ConfigError("steps", value, f"expected {STEPS_FORM}")
    return "[" + ",".join(s.strip() for s in inner.split(",") if s.strip()) + "]"


def cli(argv: Sequence[str] | None = None) -> int:
    """`python -m steps.evaluate --store.run_root R [--all true | --steps 3,5 | --follow true | --hf_checkpoint DIR]
    [--force true] [--n_examples N]` (the run's config from its run.json), or `python -m steps.evaluate --config_path F
    [--field value …]` (a whole EvaluateStepConfig: the job runner's evaluator); returns the exit code."""
    from pipeline.process.exits import Exit
    from steps.cli import run_program

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        args = steps_flag_as_list(args)
    except ConfigError as e:
        print(f"error: invalid config: {' '.join(str(e).split())}", file=sys.stderr)
        return Exit.CONFIG
    if any(a == "--config_path" or a.startswith("--config_path=") for a in args):
        return run_program(EvaluateStepConfig, main, args)
    return run_program(EvaluateCommand, evaluate_run, args)


if __name__ == "__main__":
    sys.exit(cli())
