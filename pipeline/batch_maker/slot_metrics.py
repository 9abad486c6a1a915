"""The BatchMaker step's metrics record: one per committed batch, under metrics/batchmaker/."""

from __future__ import annotations

from typing import Any

from pipeline.batch_maker import BatchResult

WASTE_REASONS = ("stale", "zero_variance", "superseded", "zero_advantage")
"""Drop reasons that are waste: rows generated (sampler compute spent) that trained nothing because of pacing or a
saturated task, not because they were broken (too_long, malformed and future_policy are not counted)."""

SATURATED_NO_SIGNAL = 0.75
"""The share of a slot's rows admitted without signal (advantage 0) from which the next slot fills at once
(`fills_at_once`): fewer than one row in 4 had signal, so filtering would read 4 times the batch to fill it and drop
the rest. At 7/8 the demo job (configs/demo_cats.yaml) trained on 76.9% of the rows it generated (10 runs pooled),
at 3/4 on 81.0% (20 runs), every run solving the task; no slot of the basic_arithmetic recipe fills at all."""

METRICS = {
    "slot": "batch slot T",
    "n_rollouts": "rollout rows in the batch (segments)",
    "n_groups": "distinct (file, group) groups in the batch",
    "staleness_min/mean/max": "(T-1) - policy_step over the batch's rollouts",
    "mean_reward": "mean episode reward of the batch's rollouts",
    "advantage_mean/std/abs_mean/min/max": "advantage statistics over the batch's rollouts",
    "tokens / loss_tokens": "non-padding tokens / tokens with loss_mask 1",
    "padding_fraction": "1 - tokens / (batch_size * seq_len)",
    "dropped_<reason>": "rollout rows dropped while building this slot, per reason",
    "rows_wasted": "rows dropped this slot for a `WASTE_REASONS` reason (stale, zero-variance, superseded, zero-adv.)",
    "waste_per_trained_row": "rows_wasted / n_rollouts: generated rows thrown away per row trained, this slot",
    "groups_filtered_zero_variance": "groups dropped because all their rewards were equal",
    "rows_filled_no_signal": "rows admitted with advantage 0 (train.no_signal_fill_after)",
    "files_ingested": "rollout files first read for this slot",
    "wait_s / ingest_s / build_s / write_s": "time waiting for the learner or rollouts / reading / building / writing",
    "batch_noticed_at / batch_committed_at": "unix times the slot had all it needed / its log entry was written",
}
"""The fields of a batchmaker metrics record, with what each measures."""


def batch_metrics(batch: BatchResult, log: dict[str, Any]) -> dict[str, Any]:
    """The metrics record (fields: `METRICS`) of a committed batch and its slot's bookkeeping."""
    s = batch.stats
    rec: dict[str, Any] = {
        "slot": batch.slot,
        "n_rollouts": s["n_rollouts"],
        "n_groups": s["n_groups"],
        "staleness_min": s["lag_min"],
        "staleness_mean": s["lag_mean"],
        "staleness_max": s["lag_max"],
        "mean_reward": s["reward_mean"],
        "advantage_mean": s["advantage_mean"],
        "advantage_std": s["advantage_std"],
        "advantage_abs_mean": s["advantage_abs_mean"],
        "advantage_min": s["advantage_min"],
        "advantage_max": s["advantage_max"],
        "tokens": s["tokens"],
        "loss_tokens": s["loss_tokens"],
        "padding_fraction": s["padding_fraction"],
        "segments_per_row": s["segments_per_row"],
        "n_truncated": s["n_truncated"],
        "n_cut_overlong": s["n_cut_overlong"],
        "files_ingested": len(log["ingested_files"]),
        "groups_filtered_zero_variance": log["groups_filtered_zero_variance"],
        "rows_filled_no_signal": log["filled_no_signal"],
        "wait_s": log["wait_s"],
        "ingest_s": log["ingest_s"],
        "build_s": log["build_s"],
        "write_s": log["write_s"],
        "batch_noticed_at": log["batch_noticed_at"],
        "batch_committed_at": log.get("batch_committed_at"),
    }
    for reason, n in log["dropped"].items():
        rec[f"dropped_{reason}"] = n
    rec["rows_wasted"] = waste = sum(int(log["dropped"].get(r, 0)) for r in WASTE_REASONS)
    rec["waste_per_trained_row"] = waste / s["n_rollouts"] if s["n_rollouts"] else None
    return rec


def waste_ratio(dropped_by_reason: dict[str, int], trained_rows: int) -> float | None:
    """Generated rows dropped for a `WASTE_REASONS` reason per row trained (None when nothing was trained)."""
    wasted = sum(int(dropped_by_reason.get(r, 0)) for r in WASTE_REASONS)
    return wasted / trained_rows if trained_rows > 0 else None


def fill_starts(no_signal_files: int, no_signal_rows: int, batch_size: int, no_signal_fill_after: int) -> bool:
    """Whether the rollout files read for one slot so far, `no_signal_files` of them without any signal (holding
    `no_signal_rows` rows), start its no-signal fill (`train.no_signal_fill_after`): that many such files, or as few
    as hold a batch of rows. A file counts by its rows as well as by itself, so that large files (the demo's, of one
    batch each) start the fill after one batch without signal rather than after `no_signal_fill_after` batches,
    each one a slot's worth of generated rows dropped; small files still need `no_signal_fill_after` of them.
    Never with `no_signal_fill_after` 0; by files only with `batch_size` 0. The live BatchMaker, its rebuild and
    rollout pacing (`fill_credit`) decide by this one rule."""
    if no_signal_fill_after <= 0:
        return False
    return no_signal_files >= no_signal_fill_after or 0 < batch_size <= no_signal_rows


def fills_at_once(
    prev_filled_no_signal: int | None,
    prev_from_start: bool,
    batch_size: int,
    *,
    filter_zero_variance: bool,
    no_signal_fill_after: int,
) -> bool:
    """Whether batch slot T admits groups without signal (advantage 0) from its first rollout file on, from slot
    T-1's log entry (`filled_no_signal`, `no_signal_fill_from_start`): the run is saturated.

    - T-1 filtered as usual and still had to fill (`filled_no_signal > 0`: `no_signal_fill_after` files read for it
      had no signal at all), and the fill made up at least `SATURATED_NO_SIGNAL` of T-1's rows: every lesson sampled
      scores (nearly) each group alike, so T fills at once instead of dropping `no_signal_fill_after` more files
      first (slot after slot, that was most of the demo's waste).
    - T-1 filled from its start: T does too while T-1 admitted at least `SATURATED_NO_SIGNAL` of a batch of rows
      without signal; fewer, and T filters as usual again (the lesson gives signal). Such a slot admits every row
      it reads, a batch or more, so this holds while most of the rows read lack signal (on number_sequence at the
      basic_arithmetic recipe's sizes, 90-95% of groups without spread, every slot from the first fill on filled
      at once; a rule on the share of rows read, filtering below 95%, was measured and not kept: docs/scale.md).
    A smaller fill is a few files without signal among files with it (small files of a task where most groups are
    solved or failed alike): filling from the start then would admit every such group with advantage 0 slot after
    slot, and the rows with signal past the batch would go stale (the basic_arithmetic recipe, about half of whose
    groups have no signal, trained batches of 17-45% rows with signal from its 38th step on under the old threshold
    of a half).
    Off without zero-variance filtering or with `no_signal_fill_after` 0 (never fill). Recorded in T's entry
    (`no_signal_fill_from_start`), which a rebuild of T follows.
    """
    if not filter_zero_variance or no_signal_fill_after <= 0:
        return False
    filled = prev_filled_no_signal or 0
    return filled > 0 and filled >= SATURATED_NO_SIGNAL * batch_size
