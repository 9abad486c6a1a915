"""`python tests/cpu_profile/report.py FILE`: the CPU of a profiled test run (see sitecustomize.py) per program and
per test file."""

from __future__ import annotations

import collections
import json
import sys
from typing import Any


def program(argv: list[str]) -> str:
    """A short name for a command line: the module of `-m` (with the step of `steps.run step X`), else the script."""
    if "-m" in argv:
        i = argv.index("-m")
        rest = argv[i + 1 :]
        return f"steps.run step {rest[2]}" if rest[:2] == ["steps.run", "step"] and len(rest) > 2 else rest[0]
    scripts = [a.rsplit("/", 1)[-1] for a in argv[1:] if a.endswith(".py")]
    return scripts[0] if scripts else ("python -c" if "-c" in argv else " ".join(argv[:2]))


def _read(path: str) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def main(path: str) -> None:
    """Print the per-program and per-test-file tables of the profile in `path`."""
    rows = _read(path)
    table: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for r in rows:
        c = table[program(r["argv"])]
        c["n"] += 1
        for key in ("cpu", "compile_s", "trace_s", "lower_s", "hits", "misses"):
            c[key] += r[key]
        c["pre_main_cpu"] += r.get("pre_main_cpu", r.get("main_cpu")) or 0
    total = sum(c["cpu"] for c in table.values())
    print(f"{len(rows)} processes exited normally, {total:.0f} s of CPU (their own)")
    header = ("program", "n", "CPU s", "pre-main", "compile", "trace", "hits", "miss")
    print("{:40s} {:>4s} {:>7s} {:>8s} {:>8s} {:>6s} {:>5s} {:>5s}".format(*header))
    for name, c in sorted(table.items(), key=lambda kv: -kv[1]["cpu"]):
        print(
            f"{name[:40]:40s} {c['n']:4d} {c['cpu']:7.1f} {c['pre_main_cpu']:8.1f} {c['compile_s']:8.1f} "
            f"{c['trace_s']:6.1f} {c['hits']:5d} {c['misses']:5d}"
        )
    try:
        tests = _read(f"{path}.tests")
    except FileNotFoundError:
        return
    files: collections.Counter[str] = collections.Counter()
    for t in tests:
        files[t["test"].split("::")[0]] += t["self_cpu"] + t["child_cpu"]
    own, children = sum(t["self_cpu"] for t in tests), sum(t["child_cpu"] for t in tests)
    print(f"\n{len(tests)} tests: {own:.0f} s of CPU in the pytest workers, {children:.0f} s in their child processes")
    for name, seconds in files.most_common(40):
        print(f"{seconds:8.1f}  {name}")


if __name__ == "__main__":
    main(sys.argv[1])
