"""Command line of the report: `python -m pipeline.report RUN_ROOT [--out DIR]`."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence

from pipeline.config import ConfigError
from pipeline.process.exits import Exit
from pipeline.report.page import build_report
from pipeline.store.storage import StorageUnavailableError, existing_run_root

DESCRIPTION = "One self-contained HTML report of a run, built from the run root alone (no tracker needed)."


def main(argv: Sequence[str] | None = None) -> None:
    """CLI: `python -m pipeline.report RUN_ROOT [--out DIR]`; prints the path of index.html."""
    parser = argparse.ArgumentParser(prog="python -m pipeline.report", description=DESCRIPTION)
    parser.add_argument("run_root", help="run root: local folder or fsspec URL (gs://bucket/run)")
    parser.add_argument(
        "--out", default=None, help="output folder or URL (default: <run_root>/report, also on a remote run root)"
    )
    parser.add_argument(
        "--store.storage_options", dest="storage_options", help='fsspec options (JSON: \'{"token": "anon"}\')'
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:  # a typo'd run root: one line, exit code 2, nothing created
        options = existing_run_root(args.run_root, args.storage_options)
    except ConfigError as e:
        parser.exit(Exit.CONFIG, f"error: {e}\n")
    except StorageUnavailableError as e:  # the endpoint refuses connections, or its name cannot be resolved now
        parser.exit(Exit.STORAGE_UNAVAILABLE, f"error: {e}\n")
    try:
        print(build_report(args.run_root, args.out, options))
    except StorageUnavailableError as e:
        parser.exit(Exit.STORAGE_UNAVAILABLE, f"error: {e}\n")
