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
through a `RolloutManager` with a seed derived from (seed, lesson) (see `policy.evaluation.lesson_seed`), write
rollouts then the summary. Idempotent: a rerun writes nothing new; a run killed midway completes the missing
(policy, lesson) pairs on the next run. The `Evaluator` and this loop live in `policy.evaluation`; `main` runs its
phases. With nothing left to evaluate (every policy it would evaluate has its summaries; following: and the final
policy is committed) it ends before importing JAX (`steps.early`).
The BatchMaker folds the summaries into the curriculum (it is the one curriculum writer).

Config: `python -m steps.evaluate --store.run_root R …` (what `make evaluate RUN=R` runs) is read-only towards
run.json: the model, curriculum, inference and seed are the run's own, as its run.json records them (the evaluator
the job would start); the flags say only what to evaluate (`EvaluateCommand`, in `pipeline.config.steps`). Nothing
is compared with or written to run.json. A run root that does not exist or has no run.json is refused (one line
naming it, exit 2, nothing created).
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

import os
import re
import sys
from collections.abc import Sequence

from pipeline.config import ConfigError, EvaluateStepConfig
from pipeline.config.steps import EvaluateCommand
from pipeline.environments.start_checks import check_evaluate_step
from pipeline.store.storage import RunStore, require_run
from policy.evaluation import Evaluator, explicit_targets, follow, following, recorded_config, report_skipped
from steps.cli import run_program, step_main
from steps.early import evaluate_nothing_to_do

HEAVY_MODULES = ("policy.model", "policy.policy_format", "policy.rollout_manager")
"""What the `Evaluator` imports (JAX, levanter, the sampler; `policy.evaluation` itself is JAX-free at import): loaded
once the config is checked and something is left to evaluate (`steps.cli.step_main`), or by the job's fork server
before it forks the step."""
EARLY_EXIT = evaluate_nothing_to_do
"""An evaluator with nothing left to evaluate ends here, before JAX."""

STEPS_FLAG = "--steps"
STEPS_FORM = "policy steps as 3,5 (or [3,5])"


def main(cfg: EvaluateStepConfig) -> int:
    """Evaluate what the config names (phases: external baseline, then follow or the explicit targets); 0."""
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


def evaluate_run(command: EvaluateCommand) -> int:
    """`python -m steps.evaluate --store.run_root R …`: refuse a run root without run.json (MissingRunError, nothing
    created) or a command with nothing to evaluate, then evaluate with the run's recorded config; 0."""
    store = RunStore(command.store.run_root, command.store.storage_options or None)
    require_run(store)
    if not (command.all or command.steps or command.follow or command.hf_checkpoint):
        raise ConfigError(
            "steps", [], "nothing to evaluate: give --all true, --steps 3,5, --follow true or --hf_checkpoint DIR"
        )
    return program(recorded_config(store, command))


def program(cfg: EvaluateStepConfig) -> int:
    """`main` as the program runs it: with nothing left to evaluate (`steps.early.evaluate_nothing_to_do`) it ends
    before importing JAX; else `HEAVY_MODULES` are imported, then `main` runs (`steps.cli.step_main`)."""
    return step_main(main, HEAVY_MODULES, EARLY_EXIT)(cfg)


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

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        args = steps_flag_as_list(args)
    except ConfigError as e:
        print(f"error: invalid config: {' '.join(str(e).split())}", file=sys.stderr)
        return Exit.CONFIG
    if any(a == "--config_path" or a.startswith("--config_path=") for a in args):
        return run_program(EvaluateStepConfig, program, args)
    return run_program(EvaluateCommand, evaluate_run, args)


if __name__ == "__main__":
    sys.exit(cli())
