"""The exit codes of every rlpipe process (step programs, the job runner), one meaning per code.

The job runner's restart policy reads them from here (`pipeline.jobs.runner`): a code in `NEVER_RESTARTED` stops
the job at once with the step's one-line reason, `STORAGE_UNAVAILABLE` is restarted with backoff outside
`max_restarts` for a bounded outage, anything else non-zero is restarted with backoff up to `max_restarts` times.

Every step program ends an expected failure the same way, however it was started (`steps.cli.run_command`): one
stderr line `error: <LABELS[code]>: <what, naming the object or field>` and the code. The table is documented in
docs/reference/exit-codes.md.
"""

from __future__ import annotations

import enum
from typing import ClassVar


class Exit(enum.IntEnum):
    """A process exit status (an int: `sys.exit(Exit.CONFIG)`, `returncode == Exit.LEASE_HELD`)."""

    OK = 0
    """Done as configured."""
    FAILED = 1
    """An unexpected error (a traceback), or the job runner gave up on a step that failed too often."""
    CONFIG = 2
    """The configuration was refused (a bad value, an unknown flag, a drifted contract field): argparse's own
    code for a usage error. Fails the same way on every restart, so it is never restarted."""
    WATCHDOG = 3
    """A phase overran its watchdog timeout (`pipeline.process.watchdog`): a hung JAX or network call."""
    TIMEOUT = 4
    """A wait for the run root exceeded its bound (`pipeline.store.poll.WaitTimeout`; the BatchMaker's
    `train.max_batch_latency_s`)."""
    LEASE_LOST = 5
    """The process lost the lease it held (another holder took it over)."""
    LEASE_HELD = 6
    """Another live process holds the lease this one needs (a second BatchMaker on the same run root)."""
    DAMAGED_INPUT = 7
    """A committed object failed verification on read (its bytes differ from its commit record, a record is cut or
    of an unknown version) and no documented recovery rule applies: the message names the file and what differs.
    Fails the same way on every restart, so it is never restarted."""
    STORAGE_FAULT = 8
    """The run root's storage refused a write or a read for a reason a restart cannot fix: no space left
    (ENOSPC), read-only (EROFS), a path that should be a folder is a file. The message names the path (and the free
    space); never restarted: the same command completes the run once the cause is fixed."""
    NO_PROGRESS = 9
    """The step cannot make progress on its input as configured (every generation of a rollout worker fails the
    same way): the message names the cause. Never restarted."""
    REPLAY_MISMATCH = 10
    """`steps.replay` trained the committed batches from the checkpoint and the result is not bitwise equal to the
    run's committed policy: the line names the first differing tensor (every one is listed on stdout). Not a bug
    of replay, and not a job step's code."""
    LEARNING_CHECK = 11
    """`steps.demo` ran its job to the end but the run failed a learning check (end reward < 3 × start reward, or
    fewer than 3 of 7 probe prompts answered with "cat"): the line names the checks that failed."""
    STORAGE_UNAVAILABLE = 75
    """The run root's storage could not be reached (EX_TEMPFAIL): restarted with backoff for a bounded outage."""
    INTERRUPTED = 130
    """Stopped by the user (Ctrl-C: SIGINT; a second SIGINT/SIGTERM of a step with a clean stop of its own): 128 +
    SIGINT."""
    TERMINATED = 143
    """Stopped by SIGTERM (a scheduler's or a container's stop) where the program has no clean stop of its own:
    128 + SIGTERM."""


LABELS: dict[int, str] = {
    Exit.FAILED: "failed",
    Exit.CONFIG: "invalid config",
    Exit.WATCHDOG: "watchdog",
    Exit.TIMEOUT: "timed out",
    Exit.LEASE_LOST: "lease lost",
    Exit.LEASE_HELD: "lease held",
    Exit.DAMAGED_INPUT: "damaged input",
    Exit.STORAGE_FAULT: "storage fault",
    Exit.NO_PROGRESS: "no progress",
    Exit.REPLAY_MISMATCH: "replay mismatch",
    Exit.LEARNING_CHECK: "learning check failed",
    Exit.STORAGE_UNAVAILABLE: "storage unavailable",
    Exit.INTERRUPTED: "interrupted",
    Exit.TERMINATED: "terminated",
}
"""The word(s) after `error: ` in a step's one-line report of an expected failure with that exit code."""

NEVER_RESTARTED: frozenset[int] = frozenset({Exit.CONFIG, Exit.DAMAGED_INPUT, Exit.STORAGE_FAULT, Exit.NO_PROGRESS})
"""Exit codes the job runner never restarts: the same start would fail the same way; the job stops with the
step's one-line reason."""


class ExpectedFailure(Exception):
    """An expected failure of a step: every entry point ends it with one line (`str(error)`, which names the object
    or field) and `exit_code`, never a traceback. Subclasses set `exit_code`; raising one from deep inside a step
    (or chaining one as the cause of another error) is how a step reports such a failure."""

    exit_code: ClassVar[Exit] = Exit.FAILED


class PathError(Exception):
    """An error about one file or folder: its message is `<path>: <reason>`, and it keeps both. Mixed into the
    expected failures below and into the storage layer's `CorruptFileError`."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


class _PathFailure(PathError, ExpectedFailure):
    """An expected failure about one file or folder: the line is `<path>: <reason>`."""


class DamagedInputError(_PathFailure):
    """A committed object failed verification on read and cannot be recovered by a documented rule."""

    exit_code = Exit.DAMAGED_INPUT


class StorageFaultError(_PathFailure):
    """The run root's storage refused an operation for a reason a restart cannot fix (no space, read-only, a file
    where a folder must be); `path` is what was being written, `reason` says why (and the free space)."""

    exit_code = Exit.STORAGE_FAULT


class NoProgressError(ExpectedFailure):
    """A step cannot make progress on its input as configured."""

    exit_code = Exit.NO_PROGRESS


class ReplayMismatchError(ExpectedFailure):
    """`steps.replay`'s policy differs from the run's committed policy (the message names the first differing
    tensor)."""

    exit_code = Exit.REPLAY_MISMATCH


class LearningCheckError(ExpectedFailure):
    """`steps.demo`'s run did not pass its learning checks (the message names the failed checks)."""

    exit_code = Exit.LEARNING_CHECK
