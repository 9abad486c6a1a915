"""One job per run root, and no job beside scheduled steps.

A whole job's runner holds the run root's job lease (`leases/job/`, `job_lease`: the lease machinery of
`pipeline.store.lease`, whose claims record host and process id). Scheduled steps (`rlpipe learn|rollout|batches`
started on their own, several side by side) do not take it, but a learner or BatchMaker must not run beside a job:
two learners or two BatchMakers on one run root would compete for the same slots (a rollout worker joining a live
job is a feature: `make rollout`). So:

- a learner or BatchMaker started on its own (not by a job runner: `RLPIPE_STEP` unset) on a run root whose job is
  alive is refused in one line naming the job's host, pid and start (`StepBesideJobError`, exit 6 "lease held");
- a job started on a run root where a scheduled BatchMaker holds the BatchMaker lease is refused the same way
  (`ScheduledStepsRunningError`); a job's own BatchMaker holds it under `batches@<host>-<runner pid>`, a
  scheduled one under `<host>-<pid>`.

Rollout workers (`rlpipe rollout`: joining a job), evaluation (`rlpipe evaluate`), retention (`rlpipe gc`) and the
read-only tools run beside a job as before.
"""

from __future__ import annotations

import os
import socket
import time
from typing import TYPE_CHECKING

from pipeline.process.interrupts import STEP_ENV
from pipeline.process.step_kind import StepKind
from pipeline.store.lease import Lease, LeaseHeldError

if TYPE_CHECKING:
    from pipeline.store.storage import RunStore

JOB_LEASE = "job"
"""The lease a job runner holds on its run root (`leases/job/`): one job per run root."""
JOB_LEASE_TTL_S = 60.0
"""How long after its last renewal the job lease of a job that died on another host lapses (the runner renews it
every `JOB_LEASE_TTL_S / 4`); a job that died on this host is taken over at once."""
TRAINING_PROGRAMS = ("steps.learn", "steps.make_batches")
"""The step programs that may not run on their own beside a live job: a second learner or BatchMaker would compete
for the job's slots. A rollout worker may (`make rollout` joins a running job: more samplers, nothing competes)."""
JOB_MAKER_PREFIX = f"{StepKind.BATCHMAKER.job_name}@"
"""How a job's own BatchMaker names itself in the BatchMaker lease (`<prefix><host>-<runner pid>`)."""


def job_lease(store: RunStore) -> Lease:
    """The job lease of `store`'s run root as this process's job runner holds it (holder `job@<host>-<pid>`)."""
    return Lease(store, JOB_LEASE, f"job@{socket.gethostname()}-{os.getpid()}", JOB_LEASE_TTL_S)


def _started(held: LeaseHeldError) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(held.claimed_at)) if held.claimed_at else "?"


class _HolderNamedError(LeaseHeldError):
    """A refusal that names a live lease holder in one line (`message`)."""

    def __init__(self, held: LeaseHeldError, message: str) -> None:
        super().__init__(held.holder, held.expires_in, held.name, held.epoch, host=held.host, pid=held.pid,
                         claimed_at=held.claimed_at)  # fmt: skip
        self.args = (message,)

    def __str__(self) -> str:
        return str(self.args[0])


class JobRunningError(_HolderNamedError):
    """Another job (its runner alive) holds the run root's job lease: one line naming its host, pid and start."""

    def __init__(self, held: LeaseHeldError, run_root: str) -> None:
        after = (
            f"{held.expires_in:.0f} s after its last renewal"
            if held.host not in ("", socket.gethostname())
            else "at once"
        )
        super().__init__(held, (
            f"another job is running on {run_root}: host {held.host or '?'}, pid {held.pid or '?'}, started "
            f"{_started(held)} (lease {held.name!r} epoch {held.epoch}); wait for it to end or stop it (Ctrl-C, or "
            f"kill {held.pid or 'its runner'}); the lease of a job that died is taken over {after}"
        ))  # fmt: skip


class StepBesideJobError(_HolderNamedError):
    """A learner or BatchMaker started on its own while a job runs on its run root: one line naming the job."""

    def __init__(self, held: LeaseHeldError, run_root: str, program: str) -> None:
        super().__init__(held, (
            f"a job is running on {run_root}: host {held.host or '?'}, pid {held.pid or '?'}, started "
            f"{_started(held)} (lease {held.name!r} epoch {held.epoch}); {program} started on its own would "
            f"compete with the job's own; run it after the job ends, or stop the job (kill {held.pid or 'its runner'})"
        ))  # fmt: skip


class ScheduledStepsRunningError(_HolderNamedError):
    """A job started while scheduled steps run on its run root (a scheduled BatchMaker holds its lease)."""

    def __init__(self, held: LeaseHeldError, run_root: str) -> None:
        super().__init__(held, (
            f"scheduled steps are running on {run_root}: a BatchMaker started on its own holds the BatchMaker "
            f"lease (host {held.host or '?'}, pid {held.pid or '?'}, since {_started(held)}); a job would compete "
            "with them; let them end (bounded steps stop on their own) or stop them, then start the job"
        ))  # fmt: skip


def refuse_beside_a_live_job(store: RunStore, program: str) -> None:
    """Raise StepBesideJobError when `program` is a learner or BatchMaker started on its own (not by a job runner) and
    a job is alive on `store`'s run root; nothing otherwise. Reads the lease only."""
    if program not in TRAINING_PROGRAMS or os.environ.get(STEP_ENV):
        return
    held = Lease(store, JOB_LEASE, "probe", JOB_LEASE_TTL_S).live_holder()
    if held is not None:
        raise StepBesideJobError(held, store.url, program)


def refuse_beside_scheduled_steps(store: RunStore) -> None:
    """Raise ScheduledStepsRunningError when a BatchMaker started on its own (a scheduled one, not a job's) holds
    `store`'s BatchMaker lease; nothing otherwise. Reads the lease only."""
    held = Lease(store, StepKind.BATCHMAKER, "probe", 1.0).live_holder()
    if held is not None and not held.holder.startswith(JOB_MAKER_PREFIX):
        raise ScheduledStepsRunningError(held, store.url)
