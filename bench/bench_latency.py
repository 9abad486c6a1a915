"""Per-step latency of the whole pipeline: runs a short job and prints where each learner step's wall time goes.

Runs `python -m steps.run` on a fresh run root with a job config (default: the cats demo), then reads the
learner's metrics records (`hops`, `step_s`; see `pipeline.telemetry.hops`) and prints the median seconds per hop and
wall seconds per learner step at steady state (after the first step, which is mostly compilation), two ways:
the median of `step_s`, and the span from the end of step 2 to the last step divided by the steps in it.

    python -m bench.bench_latency [--config configs/demo_cats.yaml] [--steps 20] [--json out.json]
    python -m bench.bench_latency --trl_setting [--steps 30]

`--trl_setting` runs the job at TRL's cats setting instead, the rlpipe side of `bench.bench_trl` at its tiny size
(4 layers, 4 prompts x 4 samples = batch 16, lr 1e-3, rows as long as the task needs, no evaluator, bfloat16
policies: `bench.bench_trl.rlpipe_overrides`), 30 learner steps unless `--steps`. Steady state is steps 3 to the
last (step 1 compiles the learner, step 2 follows it): the mean (the span's wall seconds over its steps: what a
run pays, a mid-run compile included) and the median wall per learner step, the slowest step, and the mean
seconds of each hop over the same steps (they add up to the mean step).

Goal: <= 0.2 s wall per learner step on the tiny cats task. The figure depends on the machine's load
(it runs 4-5 JAX processes): the machine name and the load average at the run's start and end are printed with it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import machine_name
from pipeline.telemetry.hops import HOPS

GOAL_S_PER_STEP = 0.2


TRL_SETTING_STEPS = 30
"""Learner steps of a `--trl_setting` run without `--steps`: 28 steady steps after the two start-up ones."""


def trl_setting_args(run_root: str, steps: int) -> list[str]:
    """The job's command-line overrides at TRL's cats setting: the rlpipe run of `bench.bench_trl` at its tiny size."""
    from bench.bench_trl import PUBLISH_DTYPE, rlpipe_overrides

    return [*rlpipe_overrides("tiny", steps, run_root), "--model.publish_dtype", PUBLISH_DTYPE]


def run_job(config: str, run_root: str, steps: int | None, trl_setting: bool = False) -> float:
    """Run the job to the end (`trl_setting`: at TRL's cats setting, `trl_setting_args`); returns its wall seconds."""
    if trl_setting:
        cmd = [sys.executable, "-m", "steps.run", *trl_setting_args(run_root, steps or TRL_SETTING_STEPS)]
    else:
        cmd = [sys.executable, "-m", "steps.run", "--config_path", config, "--run_root", run_root]
        if steps is not None:
            cmd += ["--train.num_train_steps", str(steps)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, timeout=3600, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def latency_figures(run_root: str) -> dict[str, Any]:
    """Median hops, median step_s and steady-state wall s/step of a finished run (from its metrics alone)."""
    from pipeline.report import load_run
    from pipeline.report.latency import latency_summary

    data = load_run(run_root)
    learner = sorted(
        (r for r in data.metrics.get("learner", []) if "hops" in r and "step" in r), key=lambda r: r["step"]
    )
    if len(learner) < 3:
        raise RuntimeError(f"{run_root}: fewer than 3 learner records with hops")
    summary = latency_summary(data)
    span = learner[-1]["step_ended_at"] - learner[1]["step_ended_at"]
    steady = learner[2:]
    return {
        "steps": len(learner),
        "median_step_s": summary["step_s"],
        "steady_s_per_step": span / (len(learner) - 2),
        "steady_median_step_s": statistics.median(float(r["step_s"]) for r in steady),
        "steady_max_step_s": max(float(r["step_s"]) for r in steady),
        "median_train_s": statistics.median(float(r["train_s"]) for r in learner[1:]),
        "hops_median_s": summary["hops"],
        "hops_mean_s": {h: statistics.mean(float(r["hops"].get(h, 0.0)) for r in steady) for h in HOPS},
    }


def print_figures(fig: dict[str, Any]) -> None:
    print(f"per-step latency ({fig['config']}, {fig['steps']} learner steps, wall {fig['wall_s']:.0f} s)")
    load = fig.get("load_avg") or []
    print(f"machine: {fig['machine']}; 1-min load average at the run's start -> end: {' -> '.join(map(str, load))}")
    means = fig.get("hops_mean_s") or {}
    for hop, s in fig["hops_median_s"].items():
        mean = f", {means[hop] * 1000:8.1f} ms mean from step 3" if hop in means else ""
        print(f"  {hop:<16} {s * 1000:8.1f} ms median{mean}")
    print(f"  {'step (median)':<16} {fig['median_step_s'] * 1000:8.1f} ms")
    print(
        f"wall s per learner step at steady state (steps 3-{fig['steps']}): mean {fig['steady_s_per_step']:.3f}, "
        f"median {fig['steady_median_step_s']:.3f}, slowest {fig['steady_max_step_s']:.3f} "
        f"(goal <= {GOAL_S_PER_STEP})"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/demo_cats.yaml")
    ap.add_argument("--steps", type=int, default=None, help="train.num_train_steps (default: the config's)")
    ap.add_argument("--run_root", default=None, help="where to run (default: a fresh temporary folder)")
    ap.add_argument("--trl_setting", action="store_true", help="run at TRL's cats setting (see above)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    config = "TRL's cats setting (bench.bench_trl, tiny)" if args.trl_setting else args.config
    with tempfile.TemporaryDirectory(prefix="rlpipe-latency-") as tmp:
        run_root = args.run_root or str(Path(tmp) / "run")
        load0 = os.getloadavg()[0]
        wall = run_job(args.config, run_root, args.steps, args.trl_setting)
        load = [round(load0, 2), round(os.getloadavg()[0], 2)]
        fig = {"config": config, "wall_s": wall, "machine": machine_name(), "load_avg": load}
        fig.update(latency_figures(run_root))
    print_figures(fig)
    if args.json:
        Path(args.json).write_text(json.dumps(fig, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
