"""The offline evaluate step (`python -m steps.run step evaluate …`) on a finished run, as real processes.

One small cats job (test_cats.yaml, NUM_STEPS learner steps, the job's own evaluator off) is run once per module;
evaluation starts from a fresh copy of its run root (an empty `evals/` folder). Tests share an evaluate process where
one run shows several claims (a process start imports JAX and levanter and builds the sampler):

- a SIGKILLed `--all` run is completed by a rerun: the full set, schema-valid, no duplicates, nothing quarantined
  (module fixture `killed_then_completed`);
- on a copy of that completed run, a rerun of `--all true` writes nothing, and `--all true --force true` scores every
  committed policy (listed from the run root) again, rewriting every file with the same greedy scores;
- one `make evaluate` (module fixture `made_evaluation`; `make evaluate`'s own command line, no CONFIG: the config is
  the run's run.json, here not demo_cats.yaml's) with `--steps 0,S` and `--hf_checkpoint DIR` (a folder `make export`
  wrote from the run): it scores exactly those policies and the folder, leaves run.json byte-identical, the trained
  policy says "cat" more than the initial one (greedy, the 7 probe prompts), and the exported folder scores as the
  policy itself; a `--steps` value of another form is one line giving the accepted one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from jobs import ROOT, job_config, run_job
from makefile import make_env, recipe_command

from pipeline.environments.cats import PROBE_PROMPTS
from pipeline.store import layout
from pipeline.store.storage import RunStore
from pipeline.telemetry.metrics import read_metrics
from schemas import EVAL_ROW, EVAL_SUMMARY
from schemas.evaluation import EvalSummaryRow

NUM_STEPS = 12
"""Learner steps of the module's job. test_cats.yaml's 6 are too few for greedy evaluation to move (measured policy 0
-> 6: 0.071 -> 0.107 on the 7 probe prompts). With 12 steps at test_cats.yaml's batch of 16: 0.071 -> 0.571, 0.857,
0.750, 0.607, 1.000, but 0.143 in one CI run; at the demo's batch of 32 (JOB_OVERRIDES): 0.071 -> 0.750, 1.000 (two
runs side by side on 2 CPU cores, ~2 min each); later pairs: 0.643, 0.679, 0.857, 0.714 at learning_rate 0.003 and
0.857, 1.000, 0.857, 1.000 at the demo's 0.005 (JOB_OVERRIDES)."""
JOB_OVERRIDES = {
    "train.num_train_steps": str(NUM_STEPS),
    # the demo's batch (4 prompts x 8 completions): with test_cats.yaml's 16 rows one CI run in six barely learned
    # (training reward 0.06 -> 0.11 over 12 steps, greedy 0.071 -> 0.143)
    "train.batch_size": "32",
    "curriculum.default_sampling.n_prompts": "4",
    "optimizer.learning_rate": "0.005",  # the demo's: faster and steadier learning than test_cats.yaml's 0.003
    "evaluator": "false",
}
LESSONS = ("cats",)
MIN_GAIN = 0.2
"""Required gain in greedy mean reward on `cats`, policy 0 -> final policy (smallest measured, JOB_OVERRIDES: 0.79)."""


@dataclasses.dataclass(frozen=True)
class FinishedRun:
    config: Path
    run_root: Path


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> FinishedRun:
    """A finished cats job of NUM_STEPS steps (evaluator off: the evaluate step is what the tests run)."""
    base = tmp_path_factory.mktemp("evaluate-job")
    run_root = base / "run"
    config = job_config(base, str(run_root), **JOB_OVERRIDES)
    proc = run_job(config)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    store = RunStore(str(run_root))
    assert store.exists(layout.LEARNER_DONE)
    assert store.exists(layout.policy_marker(NUM_STEPS))
    return FinishedRun(config=config, run_root=run_root)


def fresh_copy(run: FinishedRun, dest: Path) -> Path:
    """A copy of the finished run root without evaluations (or evaluate metrics): evaluation starts from nothing."""
    shutil.copytree(run.run_root, dest)
    shutil.rmtree(dest / layout.EVALS, ignore_errors=True)
    shutil.rmtree(dest / layout.METRICS / "evaluate", ignore_errors=True)
    return dest


def evaluate_cmd(run: FinishedRun, run_root: Path, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "steps.run",
        "step",
        "evaluate",
        "--config_path",
        str(run.config),
        "--run_root",
        str(run_root),
        *args,
    ]


def evaluate(run: FinishedRun, run_root: Path, *args: str, timeout: float = 300) -> str:
    """Run the evaluate step to completion; returns its output (asserting exit status 0)."""
    proc = subprocess.run(evaluate_cmd(run, run_root, *args), cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return out


def committed_policy_steps(store: RunStore) -> list[int]:
    """Committed policy steps, from the run root listing and COMMITTED markers (not from the config)."""
    steps = []
    for p in store.list(layout.POLICIES):
        if p == layout.POLICY_LATEST:
            continue
        step = layout.parse_step(p)
        if store.exists(layout.policy_marker(step)):
            steps.append(step)
    return sorted(steps)


def expected_eval_files(steps: list[int]) -> set[str]:
    return {
        f(s, lesson) for s in steps for lesson in LESSONS for f in (layout.eval_rollouts_file, layout.eval_summary_file)
    }


def eval_files(store: RunStore) -> set[str]:
    """Every file under evals/ as the store lists it (temp files are invisible to every reader)."""
    return {f for d in store.list(layout.EVALS) for f in store.list(d)}


def snapshot(run_root: Path) -> dict[str, tuple[int, int, str]]:
    """{path under the run root: (mtime_ns, size, sha256)} of every file under evals/, temp files included."""
    out = {}
    for dirpath, _, names in os.walk(run_root / layout.EVALS):
        for name in names:
            full = Path(dirpath) / name
            st = full.stat()
            rel = full.relative_to(run_root).as_posix()
            out[rel] = (st.st_mtime_ns, st.st_size, hashlib.sha256(full.read_bytes()).hexdigest())
    return out


def read_summary(store: RunStore, step: int, lesson: str) -> EvalSummaryRow:
    """The one validated summary row of (step, lesson), checked against its rollouts file."""
    summary_rows = EVAL_SUMMARY.from_table(store.read_parquet(layout.eval_summary_file(step, lesson), EVAL_SUMMARY))
    assert len(summary_rows) == 1, (step, lesson, summary_rows)
    summary = summary_rows[0]
    EVAL_SUMMARY.validate_row(summary)
    assert summary.policy_step == step
    assert summary.lesson_id == lesson
    assert summary.eval_type == "eval"
    assert summary.source == layout.policy_dir(step)
    rows = EVAL_ROW.from_table(store.read_parquet(layout.eval_rollouts_file(step, lesson), EVAL_ROW))
    assert rows, (step, lesson)
    for row in rows:
        EVAL_ROW.validate_row(row)
        assert (row.policy_step, row.lesson_id, row.eval_type) == (step, lesson, "eval")
    assert len({r.rollout_id for r in rows}) == len(rows), "duplicate rollout ids in one eval file"
    assert summary.n_examples == len(rows)
    assert summary.mean_reward == pytest.approx(sum(r.episode_reward for r in rows) / len(rows))
    return summary


@dataclasses.dataclass(frozen=True)
class KilledThenCompleted:
    root: Path
    kept: dict[str, tuple[int, int, str]]
    """snapshot() of the summaries the killed run had committed, taken right after the kill"""
    metrics_before: set[str]
    """metrics files under metrics/evaluate/ right after the kill"""
    out: str
    """the completing rerun's output"""


@pytest.fixture(scope="module")
def killed_then_completed(finished_run: FinishedRun, tmp_path_factory: pytest.TempPathFactory) -> KilledThenCompleted:
    """A fresh copy whose `--all` evaluation was SIGKILLed once it had committed some summaries (not all), then
    completed by a rerun of `--all`. Read only: copy it to change it."""
    base = tmp_path_factory.mktemp("evaluate-killed")
    root = fresh_copy(finished_run, base / "run")
    store = RunStore(str(root))
    steps = committed_policy_steps(store)
    summaries = [layout.eval_summary_file(s, lesson) for s in steps for lesson in LESSONS]

    log_path = base / "killed.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            evaluate_cmd(finished_run, root, "--all", "true"),
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            deadline = time.monotonic() + 240
            while not any((root / p).exists() for p in summaries):
                assert proc.poll() is None, "evaluate exited before any summary was seen\n" + log_path.read_text()
                assert time.monotonic() < deadline, "no evaluation committed within 240 s\n" + log_path.read_text()
                time.sleep(0.01)
            os.killpg(proc.pid, signal.SIGKILL)
        finally:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    done_at_kill = [p for p in summaries if store.exists(p)]
    assert 0 < len(done_at_kill) < len(summaries), f"not killed mid-way: {len(done_at_kill)}/{len(summaries)}"
    kept = {p: v for p, v in snapshot(root).items() if p in done_at_kill}
    metrics_before = set(store.list(layout.join(layout.METRICS, "evaluate")))

    out = evaluate(finished_run, root, "--all", "true")
    return KilledThenCompleted(root=root, kept=kept, metrics_before=metrics_before, out=out)


@pytest.mark.slow
def test_evaluate_killed_midway_is_completed_by_a_rerun(killed_then_completed: KilledThenCompleted) -> None:
    run = killed_then_completed
    root, kept = run.root, run.kept
    store = RunStore(str(root))
    steps = committed_policy_steps(store)
    expected = expected_eval_files(steps)
    metrics_dir = layout.join(layout.METRICS, "evaluate")

    # the full set, exactly once each (no second copy under another name), every file valid, nothing quarantined
    assert eval_files(store) == expected
    for s in steps:
        for lesson in LESSONS:
            read_summary(store, s, lesson)
    assert store.quarantined() == set()
    assert store.list(layout.QUARANTINE) == []
    # the rerun evaluated exactly what the killed run had not committed, and left the committed summaries alone
    after = snapshot(root)
    assert {p: after[p] for p in kept} == kept
    evaluated = sorted(
        (r["policy_step"], r["lesson_id"])
        for f in sorted(set(store.list(metrics_dir)) - run.metrics_before)
        for r in map(json.loads, store.get(f).decode().splitlines())
    )
    missing = sorted(
        (s, lesson) for s in steps for lesson in LESSONS if layout.eval_summary_file(s, lesson) not in kept
    )
    assert evaluated == missing
    for s in steps:
        if all(layout.eval_summary_file(s, lesson) in kept for lesson in LESSONS):
            assert f"policy {s}: every lesson already evaluated" in run.out


@pytest.mark.slow
def test_evaluate_all_covers_every_committed_policy_then_skips_then_force_rewrites(
    killed_then_completed: KilledThenCompleted, finished_run: FinishedRun, tmp_path: Path
) -> None:
    """On a copy of the completed `--all` evaluation: a rerun writes nothing; `--force` scores every committed policy
    (listed from the run root) in one run, rewriting every file with the same greedy scores."""
    root = tmp_path / "run"
    shutil.copytree(killed_then_completed.root, root)
    store = RunStore(str(root))
    steps = committed_policy_steps(store)
    assert steps == list(range(steps[-1] + 1)) and steps[-1] >= NUM_STEPS, steps
    expected = expected_eval_files(steps)
    pairs = [(s, lsn) for s in steps for lsn in LESSONS]

    assert eval_files(store) == expected
    first = snapshot(root)
    assert set(first) == expected, "temp files or extra files left under evals/"
    summaries = {(s, lesson): read_summary(store, s, lesson) for s in steps for lesson in LESSONS}
    records = read_metrics(store, "evaluate")

    # a rerun writes nothing: same files, same bytes, same modification times, no new metrics, and it says so
    out = evaluate(finished_run, root, "--all", "true")
    assert snapshot(root) == first
    assert len(read_metrics(store, "evaluate")) == len(records)
    for s in steps:
        assert f"policy {s}: every lesson already evaluated" in out, out[-3000:]
    assert "rlpipe.evaluate: evaluated " not in out

    # --force rewrites every file (new files, newer summaries), with the same greedy scores; one metrics record each
    evaluate(finished_run, root, "--all", "true", "--force", "true")
    forced = snapshot(root)
    assert set(forced) == expected
    assert all(forced[p][0] != first[p][0] for p in expected), "some eval file was not rewritten by --force"
    seen = {json.dumps(r, sort_keys=True) for r in records}
    added = [r for r in read_metrics(store, "evaluate") if json.dumps(r, sort_keys=True) not in seen]
    assert len(read_metrics(store, "evaluate")) == len(records) + len(pairs)
    assert sorted((r["policy_step"], r["lesson_id"]) for r in added) == pairs
    for s in steps:
        for lesson in LESSONS:
            again = read_summary(store, s, lesson)
            before = summaries[s, lesson]
            assert again.timestamp > before.timestamp
            assert (again.n_examples, again.mean_reward, again.success_rate) == (
                before.n_examples,
                before.mean_reward,
                before.success_rate,
            ), f"greedy evaluation of policy {s} on {lesson} is not reproducible"


def make(target: str, timeout: float = 120, **variables: str) -> str:
    """The Makefile's `target` recipe line (tests/makefile.py) run to completion; its output (asserting exit 0)."""
    proc = subprocess.run(recipe_command(target, **variables), cwd=ROOT, env=make_env(), capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"make {target} failed:\n{out[-4000:]}"
    return out


@dataclasses.dataclass(frozen=True)
class MadeEvaluation:
    root: Path
    final: int
    hf: Path
    run_json: bytes
    """run.json's bytes right before `make evaluate`"""
    out: str
    """`make evaluate`'s output"""


@pytest.fixture(scope="module")
def made_evaluation(finished_run: FinishedRun, tmp_path_factory: pytest.TempPathFactory) -> MadeEvaluation:
    """On a fresh copy: `make export` writes the final policy S as an HF folder, then ONE `make evaluate` (no CONFIG:
    the config is the run's run.json) with `--hf_checkpoint DIR --steps 0,S --n_examples 7` (the comma form; every
    probe prompt once) scores the folder and policies 0 and S. Read only."""
    base = tmp_path_factory.mktemp("make-evaluate")
    root = fresh_copy(finished_run, base / "run")
    final = committed_policy_steps(RunStore(str(root)))[-1]
    hf = base / "hf-final"
    make("export", RUN=str(root), STEP=str(final), OUT=str(hf))
    run_json = (root / layout.RUN_CONFIG).read_bytes()
    args = f"--hf_checkpoint {hf} --steps 0,{final} --n_examples {len(PROBE_PROMPTS)}"
    out = make("evaluate", RUN=str(root), ARGS=args)
    return MadeEvaluation(root=root, final=final, hf=hf, run_json=run_json, out=out)


def own_eval_files(store: RunStore) -> set[str]:
    """eval_files() of the run's own policies (not of an external checkpoint)."""
    return {f for f in eval_files(store) if "external-" not in f}


@pytest.mark.slow
def test_later_policy_scores_higher_on_cats(made_evaluation: MadeEvaluation) -> None:
    """Evaluating two policies of the run: the trained one says "cat" more (greedy, every probe prompt once)."""
    store = RunStore(str(made_evaluation.root))
    final = made_evaluation.final
    assert own_eval_files(store) == expected_eval_files([0, final]), "--steps evaluated other policies"
    early = read_summary(store, 0, "cats")
    late = read_summary(store, final, "cats")
    assert early.n_examples == late.n_examples == len(PROBE_PROMPTS)
    assert early.temperature == late.temperature == 0.0
    assert late.mean_reward >= early.mean_reward + MIN_GAIN, (
        f"policy {final} mean reward {late.mean_reward:.3f} vs policy 0 {early.mean_reward:.3f}: gain below {MIN_GAIN}"
    )


@pytest.mark.slow
def test_make_evaluate_takes_the_config_from_run_json(made_evaluation: MadeEvaluation) -> None:
    """The run is not demo_cats.yaml's (JOB_OVERRIDES change contract fields): `make evaluate` evaluates it as it was
    trained, never compares with nor rewrites run.json; `--steps 0,S` (comma form) names the policies."""
    root, final, out = made_evaluation.root, made_evaluation.final, made_evaluation.out
    store = RunStore(str(root))
    assert own_eval_files(store) == expected_eval_files([0, final]), "--steps 0,S evaluated other policies"
    for s in (0, final):
        assert read_summary(store, s, "cats").n_examples == len(PROBE_PROMPTS)
    assert (root / layout.RUN_CONFIG).read_bytes() == made_evaluation.run_json, "make evaluate changed run.json"
    assert "allow_config_change" not in out and "differs from run.json" not in out, out[-3000:]


@pytest.mark.slow
def test_make_evaluate_hf_checkpoint_scores_an_exported_folder(made_evaluation: MadeEvaluation) -> None:
    """`make export` writes the final policy as an HF folder; `make evaluate ARGS="--hf_checkpoint DIR"` scores it
    (model shape from its config.json) under evals/external-<name>/, as the policy itself scores (greedy)."""
    root, final = made_evaluation.root, made_evaluation.final
    store = RunStore(str(root))
    name = made_evaluation.hf.name
    assert {f for f in eval_files(store) if f"external-{name}" in f} == {
        f(0, lesson, external=name) for lesson in LESSONS for f in (layout.eval_rollouts_file, layout.eval_summary_file)
    }
    rows = EVAL_SUMMARY.from_table(store.read_parquet(layout.eval_summary_file(0, "cats", external=name), EVAL_SUMMARY))
    assert len(rows) == 1
    external = rows[0]
    EVAL_SUMMARY.validate_row(external)
    assert external.source == name and external.n_examples == len(PROBE_PROMPTS)
    assert 0.0 <= external.mean_reward <= 1.0
    own = read_summary(store, final, "cats")
    # the exported folder holds the policy's weights: greedy, on the same examples, the same scores
    assert (external.mean_reward, external.success_rate) == pytest.approx((own.mean_reward, own.success_rate))
    assert (root / layout.RUN_CONFIG).read_bytes() == made_evaluation.run_json


@pytest.mark.parametrize("value", ["3-5", "[3;5]", "three"])
def test_evaluate_steps_of_another_form_is_one_line_giving_the_accepted_one(tmp_path: Path, value: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "steps.evaluate", "--store.run_root", str(tmp_path / "run"), "--steps", value],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "3,5" in lines[0] and "[3,5]" in lines[0], proc.stderr
    assert not (tmp_path / "run").exists()


def test_evaluate_steps_forms() -> None:
    from steps.evaluate import steps_flag_as_list

    for given, want in (("3,5", "[3,5]"), ("3, 5", "[3,5]"), ("[3,5]", "[3,5]"), ("[3, 5]", "[3,5]"), ("7", "[7]")):
        assert steps_flag_as_list(["--steps", given, "--all", "false"]) == ["--steps", want, "--all", "false"]
        assert steps_flag_as_list([f"--steps={given}"]) == [f"--steps={want}"]


@pytest.mark.slow
def test_follow_evaluates_each_target_once_and_with_force_once_more(finished_run: FinishedRun, tmp_path: Path) -> None:
    """Follow mode (the job's evaluator, `step evaluate` without targets) on a finished run evaluates each policy of
    interest (eval_frequency multiples and the final one) once and stops; with `--force true` it evaluates each of
    them once more and stops (it used to find the forced policies 'missing' again after every evaluation)."""
    root = fresh_copy(finished_run, tmp_path / "run")
    store = RunStore(str(root))
    evaluate(finished_run, root, timeout=240)
    first = sorted(r["policy_step"] for r in read_metrics(store, "evaluate"))
    assert first and first[-1] >= NUM_STEPS and len(set(first)) == len(first), first
    before = snapshot(root)

    out = evaluate(finished_run, root, "--force", "true", timeout=240)
    again = sorted(r["policy_step"] for r in read_metrics(store, "evaluate"))
    assert again == sorted(first * 2), again
    after = snapshot(root)
    assert set(after) == set(before) and all(after[p][0] != before[p][0] for p in before), "not every file rewritten"
    assert "evaluated; done" in out, out[-2000:]
