"""Damaged inputs: every committed object is verified on read, and one damaged object never blocks the rest.

Each case is crafted on a copy of one real finished run root (the session's `default_job`: configs/test_cats.yaml,
6 learner steps) and run through the real step programs (`python -m steps.learn`, `steps.make_batches`,
`steps.rollout`, `steps.evaluate`, `pipeline.report`), checking the exit code (`pipeline.process.exits`), the one
`error: damaged input: …` line naming the file and the field, and that nothing valid was lost or used twice:

- a batch data file replaced by another slot's bytes, and a log entry whose `data_sha256` does not match its file:
  the learner never trains on them, sets the file aside and rebuilds the slot from its recorded inputs; the final
  parameters equal the uninterrupted run's, bitwise;
- a damaged batch whose inputs are gone: the learner stops, exit 7, naming the file and what differs;
- damaged commit records (a batch log entry cut mid-JSON, of a newer version, without its cursor; a policy
  COMMITTED cut or missing a field; run.json cut): exit 7, one line naming the file and the field; a checkpoint
  COMMITTED cut mid-JSON: set aside, the learner resumes from the older intact checkpoint;
- a curriculum state cut mid-JSON: set aside, the newest older intact state is used and the run goes on;
- a ready marker whose data file is gone: quarantined like any unreadable rollout, the BatchMaker builds its slots;
- `evaluate --all` with a truncated weights file: that policy is skipped with its reason, the others are evaluated,
  and the report lists what was quarantined or skipped.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import draccus
import numpy as np
import pytest
from jobs import ROOT, FinishedJob, policy_arrays
from jobs import TEST_CONFIG as JOB_CONFIG

from pipeline.batch_maker.rebuild import verified_batch
from pipeline.config import RLJobConfig
from pipeline.jobs.job import RLJob
from pipeline.process.exits import LABELS, Exit
from pipeline.store import layout
from pipeline.store.storage import RunStore
from schemas import ROLLOUT

NUM_STEPS = 6
"""configs/test_cats.yaml's learner steps (the `default_job` fixture)."""
DAMAGED = f"error: {LABELS[Exit.DAMAGED_INPUT]}: "


# ---------------------------------------------------------------------------------------------- helpers
def copy_run(job: FinishedJob, dest: Path) -> RunStore:
    """A copy of the finished run root (without its leases and logs) to damage."""
    shutil.copytree(job.root, dest, ignore=shutil.ignore_patterns("leases", "logs"))
    return RunStore(str(dest))


def step_config(root: Path, kind: str, tmp: Path) -> Path:
    """The config the job gives step `kind` on `root`, as a YAML file for `python -m steps.<module>`."""
    cfg = draccus.parse(RLJobConfig, config_path=str(JOB_CONFIG), args=[])
    cfg = dataclasses.replace(cfg, store=dataclasses.replace(cfg.store, run_root=str(root)))
    config = RLJob(cfg).to_worker_configs()[kind]
    path = tmp / f"{kind}.yaml"
    path.write_text(str(draccus.dump(config[0] if isinstance(config, list) else config)))
    return path


def run(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


def damaged_line(proc: subprocess.CompletedProcess[str]) -> str:
    """The one `error: damaged input: …` line of a program that ended with exit code 7 (no traceback)."""
    assert proc.returncode == Exit.DAMAGED_INPUT, f"rc={proc.returncode}\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1 and lines[0].startswith(DAMAGED), proc.stderr[-3000:]
    return lines[0]


def forget_training_after(root: Path, step: int) -> None:
    """Remove the learner's output after `step` (policies, checkpoints, LEARNER_DONE), as if it stopped there."""
    for folder in ("policies", "checkpoints"):
        for d in (root / folder).glob("step-*"):
            if layout.parse_step(d.name) > step:
                shutil.rmtree(d)
    for f in (layout.LEARNER_DONE, layout.POLICY_LATEST):
        (root / f).unlink(missing_ok=True)


def rewrite_json(root: Path, rel: str, edit: Any) -> None:
    path = root / rel
    obj = json.loads(path.read_text())
    path.write_text(json.dumps(edit(obj)))


def cut(root: Path, rel: str) -> None:
    """Cut a JSON file mid-way (what a full disk or a torn copy leaves)."""
    path = root / rel
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def uses_of_verified_batches(store: RunStore, train: Any) -> collections.Counter[str]:
    """How many committed batches use each rollout, as the learner reads them (verified, or rebuilt)."""
    uses: collections.Counter[str] = collections.Counter()
    for slot in range(1, NUM_STEPS + 1):
        table = verified_batch(store, store.read_log_entry(slot), train)
        for ids in table.column("rollout_ids").to_pylist():
            uses.update(ids)
    return uses


def learner_train(store: RunStore) -> Any:
    from pipeline.jobs.job import recorded_step_config
    from pipeline.process.step_kind import StepKind

    return recorded_step_config(store, StepKind.LEARNER).train


# ---------------------------------------------------------------------------------------------- batches
@pytest.mark.slow
def test_learner_rebuilds_damaged_batches_and_ends_as_the_uninterrupted_run(
    default_job: FinishedJob, tmp_path: Path
) -> None:
    """Slot 1's data file holds slot 2's bytes; slot 3's log entry has a data_sha256 its file does not match. The
    learner trains on neither: both files are quarantined with their reasons, each slot is rebuilt from its
    recorded inputs, and policy 6 equals, bitwise, the one the uninterrupted job published."""
    root = tmp_path / "run"
    store = copy_run(default_job, root)
    forget_training_after(root, 0)
    one, two, three = (store.read_log_entry(s) for s in (1, 2, 3))
    shutil.copyfile(root / two.data_file, root / one.data_file)
    rewrite_json(root, layout.batch_log_entry(3), lambda e: {**e, "data_sha256": "0" * 64})

    proc = run("steps.learn", "--config_path", str(step_config(root, "learner", tmp_path)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert store.exists(layout.LEARNER_DONE)
    rebuilt = [ln for ln in proc.stderr.splitlines() if "rebuilt from its recorded inputs" in ln]
    assert len(rebuilt) == 2, proc.stderr[-3000:]
    assert one.data_file in rebuilt[0] and "size" in rebuilt[0] and "identical to the committed digest" in rebuilt[0]
    assert three.data_file in rebuilt[1] and "data_sha256" in rebuilt[1]
    assert store.quarantined() == {one.data_file, three.data_file}
    reason = store.get_json(layout.quarantine_record(one.data_file))["reason"]
    assert "data_size" in reason and layout.batch_log_entry(1) in reason, reason

    original = RunStore(str(default_job.root))
    for a, b in zip(policy_arrays(original, NUM_STEPS), policy_arrays(store, NUM_STEPS), strict=True):
        assert np.array_equal(a, b)
    # exactly once: what the learner read (rebuilt slots included) uses every rollout at most once, as the job did
    train = learner_train(store)
    uses = uses_of_verified_batches(store, train)
    assert uses == uses_of_verified_batches(original, train)
    assert max(uses.values()) == 1


@pytest.mark.slow
def test_a_damaged_batch_that_cannot_be_rebuilt_stops_the_learner(default_job: FinishedJob, tmp_path: Path) -> None:
    """Slot 2's data file is truncated and one of its input rollout files is gone (retention): the learner trains
    slot 1, then stops before slot 2 with one line naming the file and what differs, exit code 7."""
    root = tmp_path / "run"
    store = copy_run(default_job, root)
    forget_training_after(root, 0)
    entry = store.read_log_entry(2)
    data = (root / entry.data_file).read_bytes()
    (root / entry.data_file).write_bytes(data[: len(data) // 2])
    gone = entry.ingested_files[0]
    (root / layout.ready_marker(gone)).unlink()
    (root / gone).unlink()

    line = damaged_line(run("steps.learn", "--config_path", str(step_config(root, "learner", tmp_path))))
    assert entry.data_file in line and "data_size" in line and gone in line and "not rebuilt" in line, line
    assert store.exists(layout.policy_marker(1)) and not store.exists(layout.policy_marker(2))
    assert store.is_quarantined(entry.data_file)


# ---------------------------------------------------------------------------------------------- commit records
@pytest.mark.slow
def test_damaged_commit_records_end_in_one_line_naming_the_file_and_field(
    default_job: FinishedJob, tmp_path: Path
) -> None:
    """Batch log entries (cut, newer version, no cursor), a policy COMMITTED (cut, a field missing) and run.json
    (cut), each read by the program that needs it: exit 7, one line naming the file and the field, nothing trained
    or built past it. A cut checkpoint COMMITTED is recovered from: the learner sets it aside and resumes from the
    newest older intact checkpoint."""
    # the BatchMaker resumes from the newest log entry: cut mid-JSON, then without its cursor
    root = tmp_path / "batches"
    copy_run(default_job, root)
    batches = str(step_config(root, "batches", tmp_path))
    newest = layout.batch_log_entry(NUM_STEPS)
    original = (root / newest).read_bytes()
    cut(root, newest)
    line = damaged_line(run("steps.make_batches", "--config_path", batches))
    assert newest in line and "'<json>'" in line, line
    (root / newest).write_bytes(original)
    rewrite_json(root, newest, lambda e: {k: v for k, v in e.items() if k != "cursor"})
    line = damaged_line(run("steps.make_batches", "--config_path", batches))
    assert newest in line and "field 'cursor': missing" in line, line

    # the learner: checkpoint 6's COMMITTED is cut, so it falls back to checkpoint 4 (setting 6 aside), and reads
    # slot 5's entry, of a newer version
    root = tmp_path / "learner"
    store = copy_run(default_job, root)
    forget_training_after(root, 4)
    shutil.copytree(default_job.root / layout.checkpoint_dir(NUM_STEPS), root / layout.checkpoint_dir(NUM_STEPS))
    cut(root, layout.checkpoint_marker(NUM_STEPS))
    assert (root / layout.checkpoint_marker(4)).exists()
    rewrite_json(root, layout.batch_log_entry(5), lambda e: {**e, "version": 99})
    learner = str(step_config(root, "learner", tmp_path))
    proc = run("steps.learn", "--config_path", learner)
    line = damaged_line(proc)
    assert layout.batch_log_entry(5) in line and "'version'" in line and "newer" in line, line
    assert not store.exists(layout.policy_marker(5))
    assert f"checkpoint {NUM_STEPS} unusable, trying an older one" in proc.stderr
    assert "resuming from checkpoint 4" in proc.stderr
    reason = store.get_json(layout.quarantine_record(layout.checkpoint_dir(NUM_STEPS)))["reason"]
    assert layout.checkpoint_marker(NUM_STEPS) in reason and "'<json>'" in reason, reason
    # ... and, the entry restored, the COMMITTED of the policy it resumes from missing a field: never carried on
    shutil.copyfile(default_job.root / layout.batch_log_entry(5), root / layout.batch_log_entry(5))
    rewrite_json(root, layout.policy_marker(4), lambda m: {k: v for k, v in m.items() if k != "files"})
    line = damaged_line(run("steps.learn", "--config_path", learner))
    assert layout.policy_marker(4) in line and "'files'" in line, line
    assert not store.exists(layout.policy_marker(5))

    # a rollout worker loading the newest policy, whose COMMITTED is cut mid-JSON: it sets that policy aside
    # (quarantined with the reason) and falls back to the newest older intact one (tests/test_worker_policy_fallback)
    root = tmp_path / "rollout"
    store = copy_run(default_job, root)
    cut(root, layout.policy_marker(NUM_STEPS))
    (root / layout.STOP_FILE).unlink(missing_ok=True)
    proc = run("steps.rollout", "--config_path", str(step_config(root, "rollout", tmp_path)), "--follow", "false",
               "--max_rollouts", "16")  # fmt: skip
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"policy {NUM_STEPS} is damaged and set aside" in proc.stderr, proc.stderr[-3000:]
    reason = store.get_json(layout.quarantine_record(layout.policy_marker(NUM_STEPS)))["reason"]
    assert "'<json>'" in reason, reason

    # run.json cut mid-JSON: refused by every step at its start, naming the file
    root = tmp_path / "runjson"
    copy_run(default_job, root)
    cut(root, layout.RUN_CONFIG)
    line = damaged_line(run("steps.make_batches", "--config_path", str(step_config(root, "batches", tmp_path))))
    assert f"{layout.RUN_CONFIG}: field '<json>': not valid JSON" in line, line


# ------------------------------------------------------------------------------------ one never blocks the rest
@pytest.mark.slow
def test_a_ready_marker_without_data_and_a_cut_curriculum_state_do_not_block_the_batchmaker(
    default_job: FinishedJob, tmp_path: Path
) -> None:
    """Slots 4..6 are lost and slots 4 and 5 built again by a restarted BatchMaker: a committed rollout file that
    sorts before every file slot 4 read has lost its data (its ready marker stays) and the newest curriculum state
    is cut mid-JSON. The file is quarantined with its reason (listed in slot 4's `quarantined_files`), the state set
    aside and folded again from the committed files, both slots committed, and no rollout used twice. (Two slots,
    bounded, from the files that filled the original 4 and 5. The lost file is one more file, not one of theirs:
    without the rows of one of those the new slot 4 needs spare rows of policy <= 3, which the job need not have
    left, pacing generating little more than the slots use, and a BatchMaker rightly waits for them; a run under
    twice CI's load once had none.)"""
    root = tmp_path / "run"
    store = copy_run(default_job, root)
    first = store.read_log_entry(4).ingested_files[0]
    folder, name = first.rsplit("/", 1)
    gone = f"{folder}/0lost{name}"  # sorts first in its folder: read for slot 4 before the files it used
    marker = {**store.get_json(layout.ready_marker(first)), "file": gone, "attempt_id": uuid.uuid4().hex}
    (root / layout.ready_marker(gone)).write_text(json.dumps(marker))
    for slot in range(4, NUM_STEPS + 1):
        entry = store.read_log_entry(slot)
        for rel in (layout.batch_log_entry(slot), entry.data_file, entry.dropped_file):
            if rel is not None:
                (root / rel).unlink()
        if slot > 4:
            (root / layout.curriculum_state(slot)).unlink()
    cut(root, layout.curriculum_state(4))

    rebuilt = 5
    config = str(step_config(root, "batches", tmp_path))
    proc = run("steps.make_batches", "--config_path", config, "--max_batches", str(rebuilt - 3))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "MissingDataError" not in proc.stderr and "Traceback" not in proc.stderr
    reason = store.get_json(layout.quarantine_record(gone))["reason"]
    assert "data file missing" in reason, reason
    assert gone in store.read_log_entry(4).quarantined_files
    assert store.is_quarantined(layout.curriculum_state(4))
    assert any("curriculum" in ln and layout.curriculum_state(4) in ln for ln in proc.stderr.splitlines())
    assert store.exists(layout.curriculum_state(rebuilt)) and not store.exists(layout.batch_log_entry(rebuilt + 1))
    uses: collections.Counter[str] = collections.Counter()
    for slot in range(1, rebuilt + 1):
        table = verified_batch(store, store.read_log_entry(slot), None)  # every file matches its entry
        uses.update(i for ids in table.column("rollout_ids").to_pylist() for i in ids)
    assert max(uses.values()) == 1
    missing = store.read_marker(gone)
    assert missing.rows > 0 and store.read_committed(gone, ROLLOUT) is None


@pytest.mark.slow
def test_evaluate_all_skips_a_damaged_policy_and_the_report_lists_it(default_job: FinishedJob, tmp_path: Path) -> None:
    """Policy 4's weights file is truncated (the job evaluated 0, 3 and 6): `evaluate --all` skips it with its
    reason and evaluates 1, 2 and 5 (exit 0); naming it with `--steps` is exit 7; the report lists it."""
    root = tmp_path / "run"
    store = copy_run(default_job, root)
    folder = root / layout.policy_dir(4)
    (weights,) = folder.glob("weights-*.safetensors")
    weights.write_bytes(weights.read_bytes()[:1000])
    rel = f"{layout.policy_dir(4)}/{weights.name}"

    proc = run("steps.evaluate", "--store.run_root", str(root), "--all", "true", "--n_examples", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    for step in (1, 2, 5):
        assert store.exists(layout.eval_summary_file(step, "cats")), step
    assert not store.exists(layout.eval_summary_file(4, "cats"))
    assert "size/crc32c differ" in store.get_json(layout.quarantine_record(rel))["reason"]
    assert any("skipped" in ln and rel in ln for ln in proc.stderr.splitlines()), proc.stderr[-3000:]

    line = damaged_line(run("steps.evaluate", "--store.run_root", str(root), "--steps", "4"))
    assert rel in line and "size/crc32c differ" in line, line

    report = run("pipeline.report", str(root), "--out", str(tmp_path / "report"))
    assert report.returncode == 0, report.stderr[-3000:]
    page = (tmp_path / "report" / "index.html").read_text()
    assert rel in page and "policy (skipped)" in page and "size/crc32c differ" in page
