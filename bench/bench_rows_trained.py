"""The share of generated rollout rows that a run trained on: distinct rollout rows in committed batches / rollout
rows generated, read from a finished run root's committed files (what the report's "generated rows trained" row
shows), with the dropped rows per reason (stale, zero_variance, ...).

Runs the demo job itself (`configs/demo_cats.yaml`, or the smaller `configs/test_cats.yaml` with `--quick`) on
fresh run roots, `--demo_runs` times (default 5): the share depends on how early the asynchronous run solves the
task (its groups then have no reward spread), 60-96% between runs of the same code, so one run says little; the
figure is pooled over the runs (rows trained / rows generated, all runs), with each run's share beside it. Reads
the recipe's run root (`make recipe`, `runs/basic_arithmetic`) when one exists; the recipe takes minutes to run,
so it is not run here (the output says when there is none).

    .venv/bin/python -m bench.bench_rows_trained                       # the demo (5 runs), and the recipe's run if any
    .venv/bin/python -m bench.bench_rows_trained --demo '' --recipe runs/basic_arithmetic   # read one run only
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RECIPE_ROOT = "runs/basic_arithmetic"


def rows_trained(run_root: str) -> dict[str, Any]:
    """{generated, trained, fraction, trained_with_signal, dropped (rows per reason), eval (held-out success by
    policy step)} of a run root: generated = the rows its rollout workers committed (their write records), trained
    = distinct rollout rows in its committed batches (their lineage), trained_with_signal = those of them with a
    non-zero advantage (a slot filled without signal trains rows at advantage 0). Raises RuntimeError for a run
    root without both."""
    from pipeline.report import load_run
    from pipeline.report.sections import generation_rows

    data = load_run(run_root)
    rows = dict(generation_rows(data))
    generated = rows.get("rollout rows generated")
    if not generated or data.rollouts_used is None:
        raise RuntimeError(f"{run_root}: no rollout write records or no committed batches; did the run finish?")
    evals = {
        int(r["policy_step"]): float(r["success_rate"])
        for r in data.eval_summaries
        if not r.get("external") and r.get("success_rate") is not None
    }
    return {
        "run_root": run_root,
        "generated": int(generated),
        "trained": int(data.rollouts_used),
        "fraction": data.rollouts_used / generated,
        "trained_with_signal": data.rollouts_used_with_signal,
        "dropped": dict(data.dropped_by_reason),
        "eval_success": dict(sorted(evals.items())),
    }


def run_demo(run_root: str, quick: bool) -> None:
    """The demo job (`steps.run`) on a fresh `run_root`, as `make demo` runs it; raises if it fails."""
    config = "configs/test_cats.yaml" if quick else "configs/demo_cats.yaml"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "steps.run", "--config_path", config, "--run_root", run_root]
    subprocess.run(cmd, check=True, cwd=REPO, env=env, timeout=1800, stdout=subprocess.DEVNULL)


def pooled(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The figures of several runs of one job as one: rows generated, trained and dropped summed over `runs`,
    `fraction` = trained / generated of the sums, `runs`: each run's fraction, and `final_success`: each run's
    last evaluation's success rate (None without one), in order."""
    generated = sum(r["generated"] for r in runs)
    trained = sum(r["trained"] for r in runs)
    signal = [r.get("trained_with_signal") for r in runs]
    dropped: dict[str, int] = {}
    for r in runs:
        for k, v in r["dropped"].items():
            dropped[k] = dropped.get(k, 0) + int(v)
    return {
        "run_root": f"{len(runs)} fresh run roots",
        "generated": generated,
        "trained": trained,
        "fraction": trained / generated,
        "trained_with_signal": None if None in signal else sum(int(x) for x in signal if x is not None),
        "dropped": dropped,
        "runs": [r["fraction"] for r in runs],
        "final_success": [next(reversed(r["eval_success"].values()), None) for r in runs],
    }


def line(name: str, fig: dict[str, Any] | None, why: str = "") -> str:
    """One printed line of a run's figures (or why there are none)."""
    if fig is None:
        return f"{name}: {why}"
    dropped = ", ".join(f"{k} {v:,}" for k, v in sorted(fig["dropped"].items())) or "none"
    runs = fig.get("runs") or []
    each = f", {len(runs)} runs: " + " ".join(f"{f:.1%}" for f in runs) if len(runs) > 1 else ""
    if len(runs) > 1 and any(s is not None for s in fig.get("final_success") or []):
        each += "; last evaluation's success: " + " ".join(
            "-" if s is None else f"{s:.2f}" for s in fig["final_success"]
        )
    signal = fig.get("trained_with_signal")
    with_signal = "" if signal is None else f", {signal / fig['generated']:.1%} with signal (advantage ≠ 0)"
    return (
        f"{name}: {fig['trained']:,} of {fig['generated']:,} generated rows trained = {fig['fraction']:.1%}"
        f"{with_signal} (dropped: {dropped}{each}) [{fig['run_root']}]"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--demo", default="run", help="'run': run the demo (--demo_runs times); a path: read it; '': skip")
    ap.add_argument("--recipe", default=RECIPE_ROOT, help="the recipe's run root, read if it exists ('': skip)")
    ap.add_argument("--quick", action="store_true", help="run the smaller test_cats job instead of the demo")
    ap.add_argument("--demo_runs", type=int, default=5, help="demo runs pooled into the figure (with --demo run)")
    ap.add_argument("--json", default="", help="write the figures here")
    args = ap.parse_args(argv)
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="rlpipe-rows-trained-") as tmp:
        if args.demo == "run":
            runs = []
            for i in range(max(1, args.demo_runs)):
                root = str(Path(tmp) / f"demo-{i}")
                run_demo(root, args.quick)
                runs.append(rows_trained(root))
                print(line(f"demo run {i + 1}", runs[-1]), flush=True)
            out["demo"] = pooled(runs)
        elif args.demo:
            out["demo"] = rows_trained(args.demo)
        if args.demo:
            out["demo"]["config"] = "configs/test_cats.yaml" if args.quick else "configs/demo_cats.yaml"
            print(line("demo", out["demo"]))
    if args.recipe:
        recipe = REPO / args.recipe if not Path(args.recipe).is_absolute() else Path(args.recipe)
        if (recipe / "batches").is_dir():
            out["recipe"] = rows_trained(str(recipe))
            print(line("recipe", out["recipe"]))
        else:
            print(line("recipe", None, f"no finished run at {args.recipe} (run `make recipe` first); not measured"))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
