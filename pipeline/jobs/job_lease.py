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

`JobLeaseKeeper` is the runner's side: it claims the lease before the first step starts, renews it while the runner
supervises and releases it after the last step stopped.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import TYPE_CHECKING

from pipeline.process.exits import StorageFaultError
from pipeline.process.interrupts import STEP_ENV
from pipeline.process.step_kind import StepKind
from pipeline.store.committed import StorageError, StorageUnavailableError
from pipeline.store.lease import Lease, LeaseHeldError, LeaseLostError

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
LEASE_STORAGE_ERRORS: tuple[type[BaseException], ...] = (
    StorageUnavailableError,
    StorageFaultError,
    StorageError,
    OSError,
)
"""What renewing or releasing the job lease survives (logged; the next renewal retries): the run root's storage
out of reach, full or read-only, a damaged lease record, an I/O error. The lease is advisory (commits are
create-if-absent) and the steps meet the same fault themselves. Anything else is a bug and ends the job."""

logger = logging.getLogger("pipeline.jobs.runner")
"""The job runner's logger: `JobLeaseKeeper`'s lines read `pipeline.jobs.runner` like the runner's others."""


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


class JobLeaseKeeper:
    """The run root's job lease as a job runner keeps it: `take` before its first step starts, `renew` every
    supervision tick (a renewal is due every `JOB_LEASE_TTL_S / 4`), `release` after its last step stopped."""

    def __init__(self, store: RunStore, run_root: str) -> None:
        self.store = store
        self.run_root = run_root
        self.lease: Lease | None = None
        """The lease while it is held (None: not taken, released, or lost)."""
        self._due = 0.0

    def take(self) -> None:
        """Claim the run root's job lease; JobRunningError (exit 6) when another job holds it,
        ScheduledStepsRunningError (exit 6) when a scheduled BatchMaker runs there. A run root whose storage
        refuses the claim for good (full, read-only) is left to the steps, which report the fault."""
        lease = job_lease(self.store)
        try:
            refuse_beside_scheduled_steps(self.store)
            lease.acquire(take_over_own=True)  # own: this host and pid, a restarted container's runner
        except ScheduledStepsRunningError:
            raise
        except LeaseHeldError as held:
            raise JobRunningError(held, self.run_root) from None
        except (StorageFaultError, StorageError) as e:
            # a storage fault a restart cannot fix (full, read-only, a damaged object): the lease is advisory
            # (commits are create-if-absent), so the job starts and its steps name the fault; a transient outage
            # (StorageUnavailableError) propagates, and anything else is a bug and is not swallowed
            logger.warning("job lease not taken (%s); starting without it", e)
            return
        self.lease = lease
        self._due = time.monotonic() + JOB_LEASE_TTL_S / 4

    def renew(self, now: float) -> bool:
        """Renew the job lease when due; False when another job took the run root over (the job stops: exit 5)."""
        if self.lease is None or now < self._due:
            return True
        self._due = now + JOB_LEASE_TTL_S / 4
        try:
            self.lease.renew()
            return True
        except LeaseLostError as lost:  # expired (a long storage outage) or taken over: claim it again if free
            again = job_lease(self.store)
            try:
                again.acquire(take_over_own=True)
            except LeaseHeldError as held:
                logger.error("%s; %s: stopping this job", lost, JobRunningError(held, self.run_root))
                self.lease = None
                return False
            except LEASE_STORAGE_ERRORS as e:
                logger.warning("job lease not renewed (%s)", e)
                return True
            logger.warning("%s; claimed it again (epoch %d)", lost, again.epoch)
            self.lease = again
            return True
        except LEASE_STORAGE_ERRORS as e:  # an outage, a full run root: the steps see it too; the next renewal retries
            logger.warning("job lease not renewed (%s)", e)
            return True

    def release(self) -> None:
        """Give the lease up (a storage fault is logged: a dead holder's lease on this host is taken over anyway)."""
        if self.lease is None:
            return
        try:
            self.lease.release()
        except LEASE_STORAGE_ERRORS as e:
            logger.warning("job lease not released (%s)", e)
        self.lease = None
