"""`python tests/load/under_load.py [--burners N] [--max_hours H] -- COMMAND ...`: run COMMAND beside N processes
that each keep one core busy (default: as many as the machine has cores, i.e. twice the load of the command alone
on a machine it fills), and exit with COMMAND's exit code.

This is how the suite's timing flakes are found: `make test-loaded` runs `make test` this way. A test that passes
alone but fails here depends on timing (a race with a job, a deadline too short for a loaded machine) and is a
defect to fix at its cause. The burners are bounded: they stop when COMMAND ends, when this program dies, and after
`--max_hours` at the latest.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

BURNER = """
import os, sys, time
parent, deadline = int(sys.argv[1]), time.monotonic() + float(sys.argv[2])
n = 0
while time.monotonic() < deadline:
    n += 1
    if n % 200_000 == 0 and os.getppid() != parent:  # the program that started us is gone
        break
"""


def main(argv: list[str] | None = None) -> int:
    """Run the command beside the burners; its exit code."""
    args = sys.argv[1:] if argv is None else argv
    if "--" not in args:
        print("usage: under_load.py [--burners N] [--max_hours H] -- COMMAND ...", file=sys.stderr)
        return 2
    split = args.index("--")
    p = argparse.ArgumentParser()
    p.add_argument("--burners", type=int, default=os.cpu_count() or 2)
    p.add_argument("--max_hours", type=float, default=3.0)
    opts = p.parse_args(args[:split])
    command = args[split + 1 :]
    seconds = str(opts.max_hours * 3600)
    burners = [subprocess.Popen([sys.executable, "-c", BURNER, str(os.getpid()), seconds]) for _ in range(opts.burners)]
    print(f"under_load: {opts.burners} CPU burners beside: {' '.join(command)}", flush=True)
    t0 = time.monotonic()
    try:
        code = subprocess.call(command)
    finally:
        for b in burners:
            b.send_signal(signal.SIGKILL)
            b.wait()
    print(f"under_load: exit {code} after {time.monotonic() - t0:.0f} s", flush=True)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
