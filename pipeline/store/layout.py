"""Every path of a run root, as pure functions. The only module that knows these names.

All paths are relative to the run root and use '/'. Step numbers are zero-padded to
8 digits so lexicographic order is step order.

    run.json                                   resolved job config, written once
    policies/step-00000120/…                   sampler weights; COMMITTED (written last) commits it
    policies/LATEST                            hint: newest committed policy step
    checkpoints/step-00000120/…                full training state; COMMITTED commits it
    rollouts/step-00000120/<worker>-<seq>.parquet       rollout data (unique name, never rewritten)
    rollouts/step-00000120/<worker>-<seq>.ready.json    commit marker for that file
    batches/data/step-00000121-<attempt>.parquet        batch data (unique name)
    batches/log/step-00000121.json              commit of batch slot 121 (create-if-absent)
    batches/dropped/<…>.parquet                 rollouts dropped by the BatchMaker, with reasons
    curriculum/state-00000121.json             curriculum state after batch slot 121 (one writer)
    evals/step-00000120/<lesson>.parquet       evaluation rollouts; <lesson>.summary.parquet commits
    metrics/<step kind>/<worker>-<seq>.jsonl   metrics records (a `StepKind`'s value: learner, batchmaker, …)
    quarantine/<escaped path>.json             reason a file was set aside
    leases/<name>/…                            lease claims per epoch + renewals (pipeline.store.lease)
    control/STOP                               stop file: every follow-mode step exits cleanly
    control/LEARNER_DONE                       written once the learner trained train.num_train_steps
    logs/<step>/<attempt>.log                  output of one start of a step run by the job runner (its job name)
    lineage/slots-<first>-<last>-<attempt>.parquet  fates of the rollouts of slots first..last (retention)
    rescored/<name>/step-P/<worker>-<seq>.parquet  rollout file re-scored by `steps.rescore` (+ ready marker)
    gc/plan-<NNNNNNNN>.json                    what garbage-collection run N deletes (create-if-absent)
    gc/plan-<NNNNNNNN>.done.json               run N finished deleting
"""

from __future__ import annotations

import re

from pipeline.process.step_kind import StepKind

STEP_WIDTH = 8
RUN_CONFIG = "run.json"
STOP_FILE = "control/STOP"
LEARNER_DONE = "control/LEARNER_DONE"
COMMIT_MARKER = "COMMITTED"
READY_SUFFIX = ".ready.json"

_STEP_RE = re.compile(r"step-(\d{8})")
_NAME_RE = re.compile(r"^[A-Za-z0-9_.=+-]+$")


def step_name(step: int) -> str:
    """`step-00000120` for 120. Raises ValueError on negative steps."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step-{step:0{STEP_WIDTH}d}"


def parse_step(name: str) -> int:
    """The step number in a name containing `step-NNNNNNNN`. Raises ValueError if none."""
    m = _STEP_RE.search(name)
    if m is None:
        raise ValueError(f"no step number in {name!r}")
    return int(m.group(1))


def check_component(value: str, what: str) -> str:
    """Return `value` if it is safe as one path component; raise ValueError naming it otherwise."""
    if not value or not _NAME_RE.fullmatch(value) or value in (".", ".."):
        raise ValueError(f"{what} {value!r} is not a safe name (letters, digits, _ . = + - only)")
    return value


def join(*parts: str) -> str:
    """Join relative path parts with '/'."""
    return "/".join(p.strip("/") for p in parts if p)


# policies -----------------------------------------------------------------------------
POLICIES = "policies"
POLICY_LATEST = "policies/LATEST"


def policy_dir(step: int) -> str:
    """Folder of the sampler weights for policy `step`."""
    return join(POLICIES, step_name(step))


def policy_marker(step: int) -> str:
    """Commit marker of policy `step` (written last)."""
    return join(policy_dir(step), COMMIT_MARKER)


# full training checkpoints -------------------------------------------------------------
CHECKPOINTS = "checkpoints"


def checkpoint_dir(step: int) -> str:
    """Folder of the full training state after learner step `step`."""
    return join(CHECKPOINTS, step_name(step))


def checkpoint_marker(step: int) -> str:
    """Commit marker of checkpoint `step` (written last)."""
    return join(checkpoint_dir(step), COMMIT_MARKER)


# rollouts ------------------------------------------------------------------------------
ROLLOUTS = "rollouts"


def rollout_step_dir(policy_step: int) -> str:
    """Folder of rollouts sampled from policy `policy_step`."""
    return join(ROLLOUTS, step_name(policy_step))


def rollout_file(policy_step: int, worker_id: str, seq: int) -> str:
    """Data file of one rollout write: `rollouts/step-P/<worker>-<seq>.parquet`."""
    check_component(worker_id, "worker_id")
    return join(rollout_step_dir(policy_step), f"{worker_id}-{seq:08d}.parquet")


def ready_marker(data_path: str) -> str:
    """Commit marker of a data file: the same name with `.ready.json` for `.parquet`."""
    if not data_path.endswith(".parquet"):
        raise ValueError(f"not a parquet data path: {data_path!r}")
    return data_path[: -len(".parquet")] + READY_SUFFIX


def data_of_marker(marker_path: str) -> str:
    """The data file a `.ready.json` marker commits."""
    if not marker_path.endswith(READY_SUFFIX):
        raise ValueError(f"not a ready marker: {marker_path!r}")
    return marker_path[: -len(READY_SUFFIX)] + ".parquet"


RESCORED = "rescored"


def rescored_file(name: str, source: str) -> str:
    """Where rescoring `name` writes its copy of rollout file `source` (`rollouts/step-P/<file>.parquet`):
    `rescored/<name>/step-P/<file>.parquet` (one new file per source file, so a rerun finds it committed)."""
    check_component(name, "rescoring name")
    parts = source.strip("/").split("/")
    if len(parts) != 3 or parts[0] != ROLLOUTS or not parts[2].endswith(".parquet"):
        raise ValueError(f"not a rollout data file: {source!r}")
    return join(RESCORED, name, parts[1], parts[2])


# batches -------------------------------------------------------------------------------
BATCH_LOG = "batches/log"
BATCH_DATA = "batches/data"
BATCH_DROPPED = "batches/dropped"


def batch_log_entry(step: int) -> str:
    """Commit object of batch slot `step` (created only if absent)."""
    return join(BATCH_LOG, f"{step_name(step)}.json")


def batch_data_file(step: int, attempt_id: str) -> str:
    """Data file of one attempt at batch slot `step` (unique name)."""
    check_component(attempt_id, "attempt_id")
    return join(BATCH_DATA, f"{step_name(step)}-{attempt_id}.parquet")


def dropped_file(step: int, attempt_id: str) -> str:
    """Rollouts dropped while building batch slot `step`, with reasons."""
    check_component(attempt_id, "attempt_id")
    return join(BATCH_DROPPED, f"{step_name(step)}-{attempt_id}.parquet")


# curriculum ----------------------------------------------------------------------------
CURRICULUM = "curriculum"


def curriculum_state(step: int) -> str:
    """Curriculum state published after batch slot `step`."""
    return join(CURRICULUM, f"state-{step:0{STEP_WIDTH}d}.json")


# evals ---------------------------------------------------------------------------------
EVALS = "evals"


def eval_dir(policy_step: int) -> str:
    """Folder of evaluations of policy `policy_step`."""
    return join(EVALS, step_name(policy_step))


def external_eval_dir(name: str) -> str:
    """Folder of evaluations of an external (e.g. Hugging Face) checkpoint named `name`."""
    return join(EVALS, f"external-{check_component(name, 'checkpoint name')}")


def eval_rollouts_file(policy_step: int, lesson_id: str, *, external: str | None = None) -> str:
    """Evaluation rollouts of one lesson at one policy step (or of an external checkpoint)."""
    check_component(lesson_id, "lesson_id")
    base = external_eval_dir(external) if external else eval_dir(policy_step)
    return join(base, f"{lesson_id}.parquet")


def eval_summary_file(policy_step: int, lesson_id: str, *, external: str | None = None) -> str:
    """Summary of one lesson's evaluation (written last: its presence commits the evaluation)."""
    check_component(lesson_id, "lesson_id")
    base = external_eval_dir(external) if external else eval_dir(policy_step)
    return join(base, f"{lesson_id}.summary.parquet")


# metrics, quarantine, leases -------------------------------------------------------------
METRICS = "metrics"
QUARANTINE = "quarantine"
LEASES = "leases"
PACING_CLAIMS = "pacing/claims"
"""Rollout workers' in-flight claims (`pipeline.rollout.pacing.Claim`): hints to pacing, never committed data."""


def metrics_dir(step_kind: StepKind | str) -> str:
    """`metrics/<step kind>/`: the metrics records of every process of one kind of step."""
    return join(METRICS, check_component(StepKind(step_kind), "step kind"))


def metrics_file(step_kind: StepKind | str, worker_id: str, seq: int) -> str:
    """One metrics record file of a step process."""
    check_component(worker_id, "worker_id")
    return join(metrics_dir(step_kind), f"{worker_id}-{seq:08d}.jsonl")


def quarantine_record(path: str) -> str:
    """Reason record for a quarantined file (path escaped into one component)."""
    return join(QUARANTINE, path.replace("/", "__") + ".json")


def lease_dir(name: str) -> str:
    """Folder of the lease named `name` (the BatchMaker's: `StepKind.BATCHMAKER`): claims per epoch and renewals."""
    check_component(name, "lease name")
    return join(LEASES, name)


LOGS = "logs"


def step_log(step: str, attempt: str) -> str:
    """`logs/<step>/<attempt>.log`: the output of one start (`attempt`, unique per start) of step `step` (its name
    in the job: `StepKind.job_name`, `rollout-<worker_id>` for a rollout worker)."""
    return f"{LOGS}/{check_component(step, 'step name')}/{check_component(attempt, 'attempt id')}.log"


# retention ------------------------------------------------------------------------------
LINEAGE = "lineage"
GC = "gc"


def lineage_file(first_slot: int, last_slot: int, attempt_id: str) -> str:
    """Lineage index of batch slots `first_slot..last_slot`, written before their data files are deleted."""
    check_component(attempt_id, "attempt_id")
    return join(LINEAGE, f"slots-{first_slot:0{STEP_WIDTH}d}-{last_slot:0{STEP_WIDTH}d}-{attempt_id}.parquet")


def gc_plan(run: int) -> str:
    """What garbage-collection run `run` deletes (written before its first deletion)."""
    return join(GC, f"plan-{run:0{STEP_WIDTH}d}.json")


def gc_done(run: int) -> str:
    """Written once garbage-collection run `run` has deleted everything its plan names."""
    return join(GC, f"plan-{run:0{STEP_WIDTH}d}.done.json")
