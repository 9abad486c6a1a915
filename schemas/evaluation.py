"""Evaluation rows (one scored eval completion) and per-lesson evaluation summaries."""

from __future__ import annotations

import dataclasses

import pyarrow as pa

from schemas.base import Float32, TableSpec, ValidationError, check_finite, check_nonempty
from schemas.rollout import ROLLOUT, RolloutRow, validate_rollout


@dataclasses.dataclass
class EvalRow(RolloutRow):
    """A rollout produced in evaluation, plus the kind of evaluation (`eval`, `micro_eval`)."""

    eval_type: str = "eval"


def validate_eval_row(row: EvalRow) -> None:
    """Rollout validation plus a known eval type."""
    validate_rollout(row)
    if row.eval_type not in ("eval", "micro_eval"):
        raise ValidationError(f"eval_type must be 'eval' or 'micro_eval', got {row.eval_type!r}")


EVAL_ROW: TableSpec[EvalRow] = TableSpec.of(
    EvalRow, "eval_rollout", validate_eval_row, version=4, upgrades=ROLLOUT.upgrades
)
"""Versions 2, 3 and 4 added the columns `schemas.ROLLOUT` versions 2, 3 and 4 added; older files are read with
them off or empty (version 4: every token at the row's policy step)."""


@dataclasses.dataclass
class EvalSummaryRow:
    """Evaluation of one lesson at one policy step.

    success_rate: fraction of episodes with episode_reward >= the lesson's success threshold
    (1.0 by default: exact answers).
    samples_per_problem, pass_k, pass_at_k, mean_at_k (version 2): with n = `samples_per_problem` samples of every
    problem, pass@k (k = `pass_k` <= n; Chen et al. 2021's unbiased estimator, `pipeline.rollout.passk`) and mean@k
    (mean reward over a problem's samples, averaged over problems). Version-1 files read with 0, 0, None, None.
    n_failures (version 3): eval examples that failed (an environment error, a reward that is missing or not
    finite, a prompt too long, ...), each recorded with its reason in the evaluator's log and never replaced by
    another example; `n_examples` counts the examples scored, so `n_examples + n_failures` were asked for. Older
    files read with 0.
    """

    policy_step: int
    lesson_id: str
    eval_type: str
    n_examples: int
    mean_reward: float
    success_rate: float
    mean_response_tokens: float
    truncation_rate: float
    temperature: Float32
    source: str
    timestamp: float
    samples_per_problem: int = 0
    pass_k: int = 0
    pass_at_k: float | None = None
    mean_at_k: float | None = None
    n_failures: int = 0


PASS_AT_K_COLUMNS_V2: tuple[tuple[str, object], ...] = (
    ("samples_per_problem", 0),
    ("pass_k", 0),
    ("pass_at_k", None),
    ("mean_at_k", None),
)
"""Columns eval-summary version 2 added, with the value a version-1 file (which did not record them) is read with."""


N_FAILURES_COLUMNS_V3: tuple[tuple[str, object], ...] = (("n_failures", 0),)
"""The column eval-summary version 3 added, with the value an older file is read with."""


def add_pass_at_k_columns(table: pa.Table) -> pa.Table:
    """A version-1 or -2 eval-summary table with the columns versions 2 and 3 added at their "not recorded"
    values."""
    for name, value in (*PASS_AT_K_COLUMNS_V2, *N_FAILURES_COLUMNS_V3):
        if name not in table.column_names:
            table = table.append_column(name, pa.array([value] * table.num_rows, EVAL_SUMMARY.schema.field(name).type))
    return table


def validate_eval_summary(row: EvalSummaryRow) -> None:
    """Raise ValidationError on empty ids, NaN metrics or rates outside [0, 1]."""
    check_nonempty("lesson_id", row.lesson_id)
    check_finite("mean_reward", row.mean_reward)
    for name in ("success_rate", "truncation_rate"):
        v = getattr(row, name)
        check_finite(name, v)
        if not 0.0 <= v <= 1.0:
            raise ValidationError(f"{name} must be in [0, 1], got {v}")
    if row.pass_k < 0 or row.pass_k > row.samples_per_problem:
        raise ValidationError(f"pass_k must be in [0, samples_per_problem={row.samples_per_problem}], got {row.pass_k}")
    if row.pass_at_k is not None:
        check_finite("pass_at_k", row.pass_at_k)
        if not 0.0 <= row.pass_at_k <= 1.0:
            raise ValidationError(f"pass_at_k must be in [0, 1], got {row.pass_at_k}")
    if row.mean_at_k is not None:
        check_finite("mean_at_k", row.mean_at_k)
    if row.n_failures < 0:
        raise ValidationError(f"n_failures must be >= 0, got {row.n_failures}")


EVAL_SUMMARY: TableSpec[EvalSummaryRow] = TableSpec.of(
    EvalSummaryRow,
    "eval_summary",
    validate_eval_summary,
    version=3,
    upgrades={1: add_pass_at_k_columns, 2: add_pass_at_k_columns},
)
"""Version 2 added samples_per_problem, pass_k, pass_at_k and mean_at_k, version 3 n_failures (older files are read
without them)."""
