"""`make demo`: run the cats job on a local run root and show that it learned.

Reads: a job config (default `configs/demo_cats.yaml`). Writes: the run root (default `runs/demo`), and
`<run root>/report/index.html`. An existing, non-empty run root is never deleted silently: the demo refuses it
(one line, exit code 2) unless `--fresh true` (`make demo FRESH=1`: delete it, saying so, and start over) or
`--keep true` (continue it).

Phases: (1) run the whole job (learner, BatchMaker, 2 rollout workers, evaluator) with the job runner;
(2) measure learning from the committed rollout files alone: mean episode reward of rollouts sampled
from the first policies vs the last ones; (3) greedy answers of the first and the final policy to the
7 fixed probe prompts; (4) write the report. It prints PASS/FAIL for the two checks of the issue
(end reward ≥ 3× start; ≥ 3 of 7 probes answered with "cat"); on a FAIL it ends with one line
`error: learning check failed: …` naming the failed checks, exit code 11 (`Exit.LEARNING_CHECK`).

    python -m steps.demo --config_path configs/demo_cats.yaml --run_root runs/demo [--fresh true | --keep true]
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.config import ConfigError, RLJobConfig
from pipeline.jobs.job import RLJob
from pipeline.jobs.runner import JobRunner
from pipeline.process.exits import LearningCheckError
from pipeline.store import layout
from pipeline.store.storage import RunStore
from schemas import ROLLOUT
from steps.cli import parse_bool, run_command
from steps.run import parse_job

logger = logging.getLogger("rlpipe.demo")

REWARD_RATIO = 3.0
MIN_PROBES_WITH_CAT = 3
WINDOW = 3


def rewards_by_policy(store: RunStore) -> dict[int, float]:
    """Mean episode reward of the committed rollouts sampled from each policy step."""
    out: dict[int, float] = {}
    for d in store.list(layout.ROLLOUTS):
        rewards: list[float] = []
        for path in store.list_committed(d):
            table = store.read_committed(path, ROLLOUT)
            if table is not None:
                rewards.extend(table.column("episode_reward").to_pylist())
        if rewards:
            out[layout.parse_step(d)] = float(np.mean(rewards))
    return dict(sorted(out.items()))


def probe_answers(store: RunStore, cfg: Any, step: int) -> list[tuple[str, str]]:
    """Greedy answers of policy `step` to the cats probe prompts: [(prompt, answer)]."""
    from pipeline.environments.cats import PROBE_PROMPTS
    from pipeline.environments.tokenizer import load_tokenizer
    from policy.model import model_vocab_size
    from policy.policy_format import read_policy
    from policy.rollout_manager import RolloutManager

    tok = load_tokenizer(cfg.model.tokenizer)
    model = read_policy(store, step, cfg.model, model_vocab_size(tok))
    manager = RolloutManager(cfg.inference, cfg.model, cfg.curriculum, tok, model)
    try:
        lesson = next(iter(sorted(cfg.curriculum.lessons)))
        _, batch = manager.evaluate_lesson(lesson, len(PROBE_PROMPTS), "eval", 0, step, step, "demo")
    finally:
        manager.shutdown()
    rows = batch.rows if batch is not None else []
    answers = [tok.decode(r.response_tokens, skip_special_tokens=True) for r in rows]
    return list(zip(PROBE_PROMPTS, answers, strict=False))


@dataclass(frozen=True)
class DemoArgs:
    """The demo's command line: the job config (with the run root set) and what to do with an existing root."""

    job: RLJobConfig
    keep: bool
    fresh: bool = False


def parse_args(argv: list[str]) -> DemoArgs:
    """`--config_path`, `--run_root`, `--keep` and job config overrides; UsageError names a bad field."""
    parser = argparse.ArgumentParser(
        prog="python -m steps.demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config_path", default="configs/demo_cats.yaml")
    parser.add_argument("--run_root", default="runs/demo")
    parser.add_argument("--keep", default="false", help="true: continue an existing run root")
    parser.add_argument("--fresh", default="false", help="true: delete an existing run root first (make demo FRESH=1)")
    args, rest = parser.parse_known_args(argv)
    job = parse_job(["--config_path", args.config_path, "--store.run_root", args.run_root, *rest])
    keep, fresh = parse_bool("--keep", args.keep), parse_bool("--fresh", args.fresh)
    if keep and fresh:
        raise ConfigError("fresh", True, "--fresh true and --keep true contradict each other")
    return DemoArgs(job=job, keep=keep, fresh=fresh)


def main(args: DemoArgs) -> int:
    """Run the demo; 0 when both learning checks pass, else LearningCheckError (one line naming the failed checks,
    exit code `Exit.LEARNING_CHECK`); a failed job ends with the job's own exit code."""
    cfg = args.job
    prepare_run_root(cfg.store.run_root, keep=args.keep, fresh=args.fresh)
    rc = JobRunner(RLJob(cfg)).run()  # 1. the job
    if rc != 0:
        logger.error("the job failed (exit %d); logs under %s", rc, Path(cfg.store.run_root) / "logs")
        return rc
    store = RunStore(cfg.store.run_root)
    start, end = show_rewards(store)  # 2. learning, from the rollout files
    hits = show_probes(store, cfg)  # 3. behaviour on fixed probes
    from pipeline.report import build_report  # 4. the report

    print(f"\nreport: {build_report(cfg.store.run_root)}", flush=True)
    failed = verdict(start, end, hits)
    if failed:
        raise LearningCheckError(
            f"the run at {cfg.store.run_root} did not pass the demo's checks: " + "; ".join(failed)
        )
    return 0


def prepare_run_root(run_root: str, *, keep: bool, fresh: bool) -> None:
    """Leave an absent or empty run root alone; continue a non-empty one if `keep`; delete it (logged) if `fresh`;
    otherwise refuse it (ConfigError naming the path: one line, exit code 2). Nothing is deleted silently."""
    root = Path(run_root)
    entries = sorted(p.name for p in root.iterdir()) if root.is_dir() else []
    if not entries and not root.is_file():
        return
    if keep:
        logger.info("--keep true: continuing the existing run root %s", root)
    elif fresh:
        logger.warning("FRESH=1 (--fresh true): deleting the existing run root %s (%s)", root, ", ".join(entries))
        shutil.rmtree(root)
    else:
        raise ConfigError(
            "run_root",
            run_root,
            "already holds a run: `make demo FRESH=1` (--fresh true) deletes it and starts over, "
            "--keep true continues it, RUN=<other folder> keeps it",
        )


def show_rewards(store: RunStore) -> tuple[float, float]:
    """Print the mean reward by policy step; returns (start, end): the means over the first / last WINDOW."""
    by_policy = rewards_by_policy(store)
    steps = sorted(by_policy)
    start = float(np.mean([by_policy[s] for s in steps[:WINDOW]]))
    end = float(np.mean([by_policy[s] for s in steps[-WINDOW:]]))
    print("\nmean cats reward of rollouts, by policy step:")
    print("  " + "  ".join(f"{s}:{by_policy[s]:.2f}" for s in steps))
    print(f"start (policies {steps[:WINDOW]}): {start:.3f}   end (policies {steps[-WINDOW:]}): {end:.3f}")
    return start, end


def show_probes(store: RunStore, cfg: RLJobConfig) -> int:
    """Print the first and the final policy's probe answers; returns how many of the final's say 'cat'."""
    from pipeline.environments.cats import says_cat
    from pipeline.store.run_state import latest_policy_step

    final = latest_policy_step(store) or 0
    hits = 0
    for step in (0, final):
        answers = probe_answers(store, cfg, step)
        hits = sum(says_cat(a) for _, a in answers)
        print(f"\npolicy {step}: {hits}/{len(answers)} probe answers say 'cat'")
        for prompt, answer in answers:
            print(f"  {prompt!r:40} -> {answer!r}")
    return hits


def verdict(start: float, end: float, hits: int) -> list[str]:
    """Print PASS/FAIL for both checks; what failed, one phrase per failed check (empty when both pass)."""
    ok_reward = end >= REWARD_RATIO * max(start, 1e-6)
    ok_probe = hits >= MIN_PROBES_WITH_CAT
    print(f"{'PASS' if ok_reward else 'FAIL'}: end reward {end:.3f} >= {REWARD_RATIO:g} x start reward {start:.3f}")
    print(
        f"{'PASS' if ok_probe else 'FAIL'}: {hits}/7 probe prompts answered with 'cat' (need >= {MIN_PROBES_WITH_CAT})"
    )
    failed = [] if ok_reward else [f"end reward {end:.3f} < {REWARD_RATIO:g} x start reward {start:.3f}"]
    if not ok_probe:
        failed.append(f"{hits}/7 probe prompts answered with 'cat' < {MIN_PROBES_WITH_CAT}")
    return failed


def cli(argv: list[str] | None = None) -> int:
    """`python -m steps.demo [--config_path F] [--run_root R] [--fresh true | --keep true] [--field value …]`; the
    exit code."""
    return run_command(parse_args, main, argv)


if __name__ == "__main__":
    sys.exit(cli())
