"""`python -m pipeline.report RUN_ROOT [--out DIR]`: write the HTML report of a run (see `pipeline.report`)."""

from pipeline.report.cli import main

main()
