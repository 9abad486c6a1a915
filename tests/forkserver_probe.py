"""A program for tests/test_forkserver.py to start through the fork server (`-m forkserver_probe`, tests/ on
PYTHONPATH): `--marker PATH` creates that file as soon as it runs; then it writes what it sees as one JSON line to
stdout (and a line to stderr), sleeps `--sleep` seconds and exits with `--exit`. Like a step module it names a module
its `main` imports in `HEAVY_MODULES` (`colorsys`, which nothing else here imports): the fork server preloads it."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax

HEAVY_MODULES = ("colorsys",)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--marker")
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--exit", type=int, default=0)
    args = parser.parse_args()
    if args.marker:
        open(args.marker, "w").close()
    seen = {
        "heavy_preloaded": "colorsys" in sys.modules,  # before this process imports it itself
        "argv": sys.argv[1:],
        "cwd": os.getcwd(),
        "step": os.environ.get("RLPIPE_STEP"),
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "sid": os.getsid(0),
        "devices": jax.device_count(),
        "name": __name__,
    }
    print(json.dumps(seen), flush=True)
    print("probe stderr line", file=sys.stderr, flush=True)
    time.sleep(args.sleep)
    return args.exit


if __name__ == "__main__":
    sys.exit(main())
