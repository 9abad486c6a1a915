"""Command line of the report: `python -m pipeline.report RUN_ROOT [--out DIR]`."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import NoReturn

from pipeline.config import ConfigError
from pipeline.process.exits import LABELS, Exit, StorageFaultError
from pipeline.process.interrupts import interrupted, stop_signals
from pipeline.report.page import build_report
from pipeline.store.faults import storage_fault
from pipeline.store.storage import StorageUnavailableError, existing_run_root

DESCRIPTION = "One self-contained HTML report of a run, built from the run root alone (no tracker needed)."


class _Parser(argparse.ArgumentParser):
    """argparse with the one error shape of every rlpipe program: a bad or missing argument is one stderr line
    `error: invalid config: …` and exit code 2 (argparse prints its usage first)."""

    def error(self, message: str) -> NoReturn:
        self.exit(Exit.CONFIG, f"error: {LABELS[Exit.CONFIG]}: {message} (see {self.prog} --help)\n")


def main(argv: Sequence[str] | None = None) -> None:
    """CLI: `python -m pipeline.report RUN_ROOT [--out DIR]`; prints the path of index.html. Every expected failure
    is one stderr line `error: <label>: …` with its exit code (docs/reference/exit-codes.md)."""
    parser = _Parser(prog="python -m pipeline.report", description=DESCRIPTION)
    parser.add_argument("run_root", help="run root: local folder or fsspec URL (gs://bucket/run)")
    parser.add_argument(
        "--out", default=None, help="output folder or URL (default: <run_root>/report, also on a remote run root)"
    )
    parser.add_argument(
        "--store.storage_options", dest="storage_options", help='fsspec options (JSON: \'{"token": "anon"}\')'
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    with stop_signals():  # Ctrl-C: one line, 130; SIGTERM: one line, 143
        try:
            run(parser, args)
        except KeyboardInterrupt:
            sys.exit(interrupted())


def run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Check the run root, write the report, print where; every expected failure is one line and its code."""
    try:  # a typo'd run root: one line, exit code 2, nothing created
        options = existing_run_root(args.run_root, args.storage_options)
    except ConfigError as e:
        parser.exit(Exit.CONFIG, f"error: {LABELS[Exit.CONFIG]}: {e}\n")
    except StorageUnavailableError as e:  # the endpoint refuses connections, or its name cannot be resolved now
        parser.exit(Exit.STORAGE_UNAVAILABLE, f"error: {e}\n")
    try:
        print(build_report(args.run_root, args.out, options))
    except StorageUnavailableError as e:
        parser.exit(Exit.STORAGE_UNAVAILABLE, f"error: {e}\n")
    except (OSError, StorageFaultError) as e:  # the report's folder refuses the write for good (read-only, full)
        fault = _storage_fault(e)
        if fault is None:
            raise
        hint = "write the report elsewhere with --out DIR"
        parser.exit(fault.exit_code, f"error: {LABELS[fault.exit_code]}: {fault}; {hint}\n")


def _storage_fault(error: BaseException) -> StorageFaultError | None:
    """The storage fault `error` is, or was caused by (a refused write: read-only, full, permission denied)."""
    current: BaseException | None = error
    while current is not None:
        if isinstance(current, StorageFaultError):
            return current
        if isinstance(current, OSError) and current.filename:
            fault = storage_fault(str(current.filename), current)
            if fault is not None:
                return fault
        current = current.__cause__ or current.__context__
    return None
