"""Scheduled steps on a finished run end before importing JAX (`steps.early`): `python -m steps.learn` and `python -m
steps.rollout`, and the scheduled-jobs guide's `steps.run step learn|rollout` lines (through `make learn` and `rlpipe
rollout`), started on a run whose learner finished, exit 0 with their usual line and import neither JAX nor levanter;
so do the job's evaluator (restarted on a finished run whose evaluations are committed) and the guide's `steps.run
step evaluate … --all true` line once every policy is scored; a raised `train.num_train_steps`, a run still training,
a damaged final policy marker (left to the worker's full path, which quarantines it) and `control/STOP` are told
apart (the checks themselves, in-process)."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import draccus
import pytest
from jobs import ROOT, FinishedJob
from jobs import TEST_CONFIG as JOB_CONFIG

from pipeline.config import RLJobConfig
from pipeline.jobs.job import RLJob
from pipeline.store import layout, run_state
from pipeline.store.storage import RunStore
from steps.early import evaluate_nothing_to_do, learner_already_done, rollout_nothing_to_do

NUM_STEPS = 6
"""configs/test_cats.yaml's learner steps (the `default_job` fixture)."""


def step_configs(root: Path) -> dict[str, Any]:
    """The configs the job gives its steps, on run root `root`."""
    cfg = draccus.parse(RLJobConfig, config_path=str(JOB_CONFIG), args=[])
    cfg = dataclasses.replace(cfg, store=dataclasses.replace(cfg.store, run_root=str(root)))
    return {k: (v[0] if isinstance(v, list) else v) for k, v in RLJob(cfg).to_worker_configs().items()}


def run_step(module: str, config: Any, tmp: Path) -> subprocess.CompletedProcess[str]:
    """`python -X importtime -m <module> --config_path F`: stderr holds one line per module imported."""
    path = tmp / f"{module}.yaml"
    path.write_text(str(draccus.dump(config)))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-X", "importtime", "-m", module, "--config_path", str(path)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)  # fmt: skip


def imported(stderr: str) -> set[str]:
    """Top-level packages named by `-X importtime` lines."""
    names = set()
    for line in stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            names.add(line.rsplit("|", 1)[1].strip().split(".")[0])
    return names


@pytest.mark.slow
def test_learner_and_rollout_worker_on_a_finished_run_end_without_jax(default_job: FinishedJob, tmp_path: Path) -> None:
    root = tmp_path / "run"
    shutil.copytree(default_job.root, root, ignore=shutil.ignore_patterns("leases", "logs"))
    configs = step_configs(root)
    before = sorted(p.name for p in (root / "policies").iterdir())

    learn = run_step("steps.learn", configs["learner"], tmp_path)
    assert learn.returncode == 0, learn.stderr[-3000:]
    assert f"already trained {NUM_STEPS} steps; nothing to do" in learn.stderr
    assert not {"jax", "levanter", "haliax"} & imported(learn.stderr), sorted(imported(learn.stderr))

    rollout = run_step("steps.rollout", configs["rollout"], tmp_path)
    assert rollout.returncode == 0, rollout.stderr[-3000:]
    assert f"learner finished (policy {NUM_STEPS} published)" in rollout.stderr
    assert not {"jax", "levanter", "haliax"} & imported(rollout.stderr), sorted(imported(rollout.stderr))
    assert sorted(p.name for p in (root / "policies").iterdir()) == before  # nothing written


@pytest.mark.slow
def test_the_scheduled_lines_of_a_finished_run_end_without_jax(default_job: FinishedJob, tmp_path: Path) -> None:
    """The scheduled-jobs guide's learner and rollout lines (`steps.run step …`, which `make learn` and `rlpipe
    rollout` run) on a finished run, as a user types them and without a config (it comes from run.json): exit 0 with
    the step's closing line, and neither imports JAX, levanter or haliax (`PYTHONPROFILEIMPORTTIME=1`: one stderr
    line per module imported)."""
    root = tmp_path / "run"
    shutil.copytree(default_job.root, root, ignore=shutil.ignore_patterns("leases", "logs"))
    env = {**os.environ, "PYTHONPROFILEIMPORTTIME": "1"}
    runs = {
        "make learn": ["make", "--no-print-directory", "-o", "setup", "learn", f"RUN={root}"],
        "rlpipe rollout": [str(Path(sys.executable).parent / "rlpipe"), "rollout", "--run_root", str(root)],
    }
    closing = {"make learn": f"already trained {NUM_STEPS} steps; nothing to do",
               "rlpipe rollout": f"learner finished (policy {NUM_STEPS} published)"}  # fmt: skip
    for name, command in runs.items():
        proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"{name}: {proc.stderr[-3000:]}"
        assert closing[name] in proc.stderr and f"job config: {root}/run.json" in proc.stderr, proc.stderr[-3000:]
        assert not {"jax", "levanter", "haliax"} & imported(proc.stderr), (name, sorted(imported(proc.stderr)))


@pytest.mark.slow
def test_the_checks_tell_a_finished_run_from_one_that_trains_on(default_job: FinishedJob, tmp_path: Path) -> None:
    root = tmp_path / "run"
    shutil.copytree(default_job.root, root, ignore=shutil.ignore_patterns("leases", "logs"))
    configs = step_configs(root)
    learner, rollout = configs["learner"], configs["rollout"]
    assert learner_already_done(learner) == 0 and rollout_nothing_to_do(rollout) == 0

    more = dataclasses.replace(learner.train, num_train_steps=NUM_STEPS + 2)
    assert learner_already_done(dataclasses.replace(learner, train=more)) is None  # a raised bound trains on
    assert rollout_nothing_to_do(dataclasses.replace(rollout, train=more)) is None  # and samples for it

    marker = root / layout.policy_marker(NUM_STEPS)
    intact = marker.read_bytes()
    marker.write_bytes(intact[: len(intact) // 2])  # cut: the worker's full path sets it aside
    assert rollout_nothing_to_do(rollout) is None
    marker.write_bytes(intact)

    (root / layout.STOP_FILE).write_text("stop\n")  # a stop file: its presence is what counts
    assert rollout_nothing_to_do(dataclasses.replace(rollout, train=more)) == 0  # control/STOP: stop at once

    (root / layout.LEARNER_DONE).unlink()  # a learner that has not finished (or a cut record): the full path
    assert learner_already_done(learner) is None


@pytest.mark.slow
def test_an_evaluator_with_nothing_left_to_evaluate_ends_without_jax(default_job: FinishedJob, tmp_path: Path) -> None:
    """The job's evaluator (follow mode) on a finished run whose followed policies are evaluated, and the guide's
    `--all true` line once every policy has its summaries: exit 0 with one line, no JAX, nothing written. A policy
    without its summary, `--force`, a `--steps` policy not committed or a quarantined policy take the full path."""
    root = tmp_path / "run"
    shutil.copytree(default_job.root, root, ignore=shutil.ignore_patterns("leases", "logs"))
    evaluator = step_configs(root)["evaluate"]
    lesson = "cats"

    follow = run_step("steps.evaluate", evaluator, tmp_path)
    assert follow.returncode == 0, follow.stderr[-3000:]
    assert f"final policy {NUM_STEPS} evaluated; done" in follow.stderr, follow.stderr[-3000:]
    assert not {"jax", "levanter", "haliax"} & imported(follow.stderr), sorted(imported(follow.stderr))

    everything = dataclasses.replace(evaluator, all=True)
    policies = run_state.committed_steps(RunStore(str(root)), layout.POLICIES)
    unscored = [s for s in policies if not (root / layout.eval_summary_file(s, lesson)).exists()]
    assert unscored, "the job evaluates every eval_frequency-th policy only: --all has policies left to score"
    assert evaluate_nothing_to_do(everything) is None
    scored = root / layout.eval_summary_file(NUM_STEPS, lesson)
    for s in unscored:  # a summary's presence commits a policy's evaluation of a lesson
        target = root / layout.eval_summary_file(s, lesson)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(scored, target)
    evals_before = sorted(str(p.relative_to(root)) for p in (root / layout.EVALS).rglob("*"))

    env = {**os.environ, "PYTHONPROFILEIMPORTTIME": "1"}
    line = [sys.executable, "-m", "steps.run", "step", "evaluate", "--config_path", str(JOB_CONFIG),
            "--run_root", str(root), "--all", "true"]  # fmt: skip  # the scheduled-jobs guide's evaluate line
    proc = subprocess.run(line, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    mark = "INFO rlpipe.evaluate: "
    said = [ln.split(mark, 1)[1] for ln in proc.stderr.splitlines() if mark in ln]
    assert said == [f"policy {s}: every lesson already evaluated" for s in policies], proc.stderr[-3000:]
    assert not {"jax", "levanter", "haliax"} & imported(proc.stderr), sorted(imported(proc.stderr))
    assert sorted(str(p.relative_to(root)) for p in (root / layout.EVALS).rglob("*")) == evals_before

    assert evaluate_nothing_to_do(everything) == 0
    assert evaluate_nothing_to_do(dataclasses.replace(everything, force=True)) is None
    assert evaluate_nothing_to_do(dataclasses.replace(evaluator, steps=[NUM_STEPS + 1])) is None
    (root / layout.eval_summary_file(unscored[0], lesson)).unlink()
    assert evaluate_nothing_to_do(everything) is None
    assert evaluate_nothing_to_do(evaluator) == 0  # a policy the evaluator does not follow
    RunStore(str(root)).quarantine(layout.policy_marker(NUM_STEPS), "a test's damaged marker")
    assert evaluate_nothing_to_do(evaluator) is None
