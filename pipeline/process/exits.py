"""The exit codes of every rlpipe process (step programs, the job runner), one meaning per code.

The job runner's restart policy reads them from here (`pipeline.jobs.runner`): `CONFIG` is never restarted,
`STORAGE_UNAVAILABLE` is restarted with backoff outside `max_restarts` for a bounded outage, anything else
non-zero is restarted with backoff up to `max_restarts` times.
"""

from __future__ import annotations

import enum


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
    STORAGE_UNAVAILABLE = 75
    """The run root's storage could not be reached (EX_TEMPFAIL): restarted with backoff for a bounded outage."""
    INTERRUPTED = 130
    """Stopped by the user (a second SIGINT/SIGTERM, or the job runner's Ctrl-C): 128 + SIGINT."""
