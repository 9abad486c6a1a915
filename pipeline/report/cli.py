"""Command line of the report: `python -m pipeline.report RUN_ROOT [--out DIR]`."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence

from pipeline.report.page import build_report

DESCRIPTION = "One self-contained HTML report of a run, built from the run root alone (no tracker needed)."


def main(argv: Sequence[str] | None = None) -> None:
    """CLI: `python -m pipeline.report RUN_ROOT [--out DIR]`; prints the path of index.html."""
    parser = argparse.ArgumentParser(prog="python -m pipeline.report", description=DESCRIPTION)
    parser.add_argument("run_root", help="run root: local folder or fsspec URL (gs://bucket/run)")
    parser.add_argument("--out", default=None, help="output folder (default: <run_root>/report if local)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    print(build_report(args.run_root, args.out))
