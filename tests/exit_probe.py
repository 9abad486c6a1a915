"""A program that ends through `steps.cli.run_command` the way a step ends with the exit code its one argument
names: code 0 returned, every other code of the table as the failure a step raises for it (`FAILURES`; any other
code as an `ExpectedFailure` with that `exit_code`), Ctrl-C as KeyboardInterrupt; -1: Ctrl-C inside a garbage-collection
callback. `python -m exit_probe 7`; run
in-process by `steps.rlpipe.run_module` in tests/test_rlpipe.py."""

from __future__ import annotations

import errno
import sys

from pipeline.config import ConfigError
from pipeline.process.exits import DamagedInputError, Exit, ExpectedFailure, NoProgressError
from pipeline.store.committed import StorageUnavailableError
from pipeline.store.lease import LeaseHeldError, LeaseLostError
from pipeline.store.poll import WaitTimeout
from steps.cli import run_command

FAILURES: dict[int, BaseException] = {
    Exit.CONFIG: ConfigError("max_rollouts", -5, "must be >= 1 or null"),
    Exit.TIMEOUT: WaitTimeout("waited 3.0s (> train.max_batch_latency_s=3) for x"),
    Exit.LEASE_LOST: LeaseLostError("lease 'batchmaker' epoch 3 lost"),
    Exit.LEASE_HELD: LeaseHeldError("maker-A", 12.0, "batchmaker", 3),
    Exit.DAMAGED_INPUT: DamagedInputError("batches/data/step-1-x.parquet", "sha256 differs from its log entry"),
    Exit.STORAGE_FAULT: OSError(errno.EROFS, "Read-only file system", "/r/rollouts/step-0/w.parquet"),
    Exit.NO_PROGRESS: NoProgressError("lesson 'cats': nothing generated"),
    Exit.STORAGE_UNAVAILABLE: StorageUnavailableError("gs://b/run", "connection refused"),
    Exit.INTERRUPTED: KeyboardInterrupt(),
}
"""What a step raises for each code (8: the OSError of a write the storage refused, converted by `run_command`)."""


def interrupted_in_a_gc_callback() -> int:
    """Ctrl-C raised inside a garbage-collection callback (where JAX's runs), whose exception Python can only report;
    then a wait of up to 60 s that only a Ctrl-C delivered again ends early. 0 if it never came."""
    import gc
    import signal
    import threading

    def callback(phase: str, info: dict) -> None:
        if phase == "start":
            gc.callbacks.remove(callback)
            signal.raise_signal(signal.SIGINT)  # KeyboardInterrupt: raised here, in the callback

    gc.callbacks.append(callback)
    gc.collect()
    threading.Event().wait(60)
    return 0


def main(code: int) -> int:
    if code == -1:
        return interrupted_in_a_gc_callback()
    if code == Exit.OK:
        return 0
    if code in FAILURES:
        raise FAILURES[code]
    raise type("ProbeFailure", (ExpectedFailure,), {"exit_code": Exit(code)})(f"probe failure with code {code}")


if __name__ == "__main__":
    sys.exit(run_command(lambda args: int(args[0]), main))
