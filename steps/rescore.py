"""The rescore step: re-score committed rollout files with a new scorer into new files, the old files untouched.

Reads   run.json (the tokenizer), rollouts/step-P/*.parquet committed by their ready markers (verified reads)
Writes  rescored/<name>/step-P/<worker>-<seq>.parquet + its ready marker, one per source file

What a rescored file holds, its lineage and why a rerun never duplicates a file: `pipeline.rescore`, the loop this
program runs.

Run
    python -m steps.rescore --store.run_root runs/demo --name judge1 --config_path configs/judge_rescore.yaml
    make rescore RUN=runs/demo ARGS="--name judge1 --config_path configs/judge_rescore.yaml"

Exit codes: 0 done, 2 bad config (no run root, bad scorer), 8 the run root's storage refused a write.
"""

from __future__ import annotations

import logging
import sys

from pipeline.config import ConfigError, RescoreStepConfig
from pipeline.rescore import pending_files, rescore_file, run_decoder
from pipeline.scoring import build_scorer, scorer_name, scorer_weight
from pipeline.store import layout
from pipeline.store.storage import RunStore

logger = logging.getLogger("rlpipe.rescore")


def main(cfg: RescoreStepConfig) -> int:
    """Re-score every committed rollout file not yet re-scored under `cfg.name`; 0."""
    store = RunStore(cfg.store.run_root, cfg.store.storage_options)
    if not store.exists(layout.RUN_CONFIG):
        raise ConfigError("store.run_root", cfg.store.run_root, "is not a run root (no run.json)")
    name, weight = scorer_name(cfg.scorer), scorer_weight(cfg.scorer)
    todo = pending_files(store, cfg)
    if not todo:
        logger.info("rescore %s: nothing to do (every selected rollout file is re-scored)", cfg.name)
        return 0
    decode = run_decoder(store, cfg.tokenizer)
    scorer = build_scorer(cfg.scorer)
    done = failed = 0
    try:
        for src in todo:
            n_failed = rescore_file(store, cfg, src, decode, scorer, name=name, weight=weight)
            if n_failed is not None:
                done += 1
                failed += n_failed
    finally:
        scorer.close()
    logger.info("rescore %s: %d files re-scored, %d rows failed", cfg.name, done, failed)
    return 0


def cli(argv: list[str] | None = None) -> int:
    """`python -m steps.rescore [--config_path F] [--field value …]`; returns the exit code."""
    from steps.cli import run_program

    return run_program(RescoreStepConfig, main, argv)


if __name__ == "__main__":
    sys.exit(cli())
