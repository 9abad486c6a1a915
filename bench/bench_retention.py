"""Run-root size with and without retention: the tiny cats job (`configs/test_cats.yaml`, small batch, no
evaluator) for `--steps` learner steps, run twice on fresh local run roots — retention off, then on (the job
runner collects every `--gc_every` slots and once at the end) — reporting bytes per top-level folder of each root.

    python -m bench.bench_retention --steps 100 --json runs/bench/retention.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def tree_bytes(root: Path) -> dict[str, int]:
    """Bytes of the files under each top-level folder of `root`, plus `total`."""
    out: dict[str, int] = {}
    for p in root.rglob("*"):
        if p.is_file():
            top = p.relative_to(root).parts[0]
            out[top] = out.get(top, 0) + p.stat().st_size
    out["total"] = sum(out.values())
    return out


def run(run_root: Path, steps: int, retention: bool, gc_every: int) -> dict[str, Any]:
    """One job on a fresh run root; its wall seconds and bytes."""
    cmd = [
        sys.executable, "-m", "steps.run", "--config_path", "configs/test_cats.yaml", "--run_root", str(run_root),
        f"--train.num_train_steps={steps}", "--evaluator=false", "--cadence.checkpoint_interval=10",
        f"--retention.enabled={str(retention).lower()}", f"--retention.gc_every_slots={gc_every}",
        "--retention.keep_policies=2", "--retention.keep_every=50", "--retention.data_window_slots=4",
    ]  # fmt: skip
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, timeout=3600)
    return {"retention": retention, "wall_s": time.perf_counter() - t0, "bytes": tree_bytes(run_root)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--gc_every", type=int, default=10)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="rlpipe-bench-retention-") as tmp:
        rows = [run(Path(tmp) / f"run-{on}", args.steps, on, args.gc_every) for on in (False, True)]
    off, on = rows[0]["bytes"], rows[1]["bytes"]
    print(f"run root after {args.steps} steps of the tiny cats job (bytes)")
    print(f"{'folder':<14}{'retention off':>16}{'retention on':>16}")
    for k in sorted(set(off) | set(on), key=lambda k: (k == "total", k)):
        print(f"{k:<14}{off.get(k, 0):>16,}{on.get(k, 0):>16,}")
    result = {"steps": args.steps, "rows": rows, "ratio_on_to_off": on["total"] / max(off["total"], 1)}
    print(f"retention on / off: {result['ratio_on_to_off']:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
