"""Step start-up: process start -> step ready to work, for every step program.

"Ready" means what each step does before its first unit of work: the step module imported, its config parsed
(the job YAML turned into the step's own config, as `steps.run` does), the model built (learner, rollout,
evaluate: random init from the job's ModelSpec, the cost of loading a policy of the same shape) and the first
poll of the run root (newest policy, newest batch slot). JIT compilation of the first step is not part of it
(the JAX compile cache covers restarts; see the learner and rollout benchmarks for step times).

Each measurement is a fresh `python -m bench.bench_startup --child STEP` process with the environment of a step
process (USE_TORCH=0, as `steps/__init__.py` sets for `python -m steps.*`), timed by the parent from spawn to
the child's READY line. "cold" is the first start in this run (the OS file cache may already be warm from
earlier runs), "warm" the median of the following starts.

With the local job backend's fork server (`backend.fork_server: true`, the default) a step process is forked
from a server that has imported the step programs once: each JAX step is also measured that way ("forked":
spawn request -> READY, the same child code, the server preloaded with every step module, as a job's is; the
server's own import is reported once as `fork server ready`).

    python -m bench.bench_startup                     # all steps, 3 starts each
    python -m bench.bench_startup --steps learn --starts 5 --json out.json
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

STEPS = ("learn", "make_batches", "rollout", "evaluate", "export", "run")
GOAL_S = 3.0
_STEP_KEY = {"learn": "learn", "make_batches": "batches", "rollout": "rollout", "evaluate": "evaluate"}


def child(step: str, config_path: str, run_root: str) -> None:
    """Reach `step`'s ready point, printing `READY <phase seconds as JSON>`."""
    t0 = time.perf_counter()
    phases: dict[str, float] = {}
    from steps.forkserver import import_step

    import_step(f"steps.{step}")  # the module and what its `main` imports (its HEAVY_MODULES), as a forked step has
    phases["import"] = time.perf_counter() - t0
    from pipeline.jobs.job import RLJob
    from pipeline.process.step_kind import StepKind
    from pipeline.store import run_state
    from pipeline.store.storage import RunStore
    from steps.run import parse_job, step_config

    job = RLJob(parse_job(["--config_path", config_path, "--store.run_root", run_root]))
    if step in _STEP_KEY:
        step_config(job, StepKind.from_cli(_STEP_KEY[step]), [])
    phases["config"] = time.perf_counter() - t0 - sum(phases.values())
    if step in ("learn", "rollout", "evaluate", "export"):
        from pipeline.environments.tokenizer import load_tokenizer
        from policy.model import build_model, model_vocab_size

        spec = job.config.model
        build_model(spec, model_vocab_size(load_tokenizer(spec.tokenizer)))
        phases["model"] = time.perf_counter() - t0 - sum(phases.values())
    store = RunStore(run_root)
    run_state.latest_policy_step(store)
    run_state.last_committed_slot(store)
    phases["first_poll"] = time.perf_counter() - t0 - sum(phases.values())
    print("READY " + json.dumps(phases), flush=True)


def measure(step: str, config_path: str, run_root: str) -> dict[str, Any]:
    """One start of `step` in a fresh process: wall seconds from spawn to READY, and the child's phases."""
    env = _env()
    cmd = [
        sys.executable,
        "-m",
        "bench.bench_startup",
        "--child",
        step,
        "--config",
        config_path,
        "--run_root",
        run_root,
    ]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - t0
    ready = [line for line in proc.stdout.splitlines() if line.startswith("READY ")]
    if proc.returncode != 0 or not ready:
        raise RuntimeError(f"step {step} did not get ready (exit {proc.returncode}): {proc.stderr[-2000:]}")
    return {"wall_s": wall, "phases": json.loads(ready[-1][len("READY ") :])}


def _env() -> dict[str, str]:
    env = {**os.environ, "USE_TORCH": "0", "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


def measure_forked(server: Any, step: str, config_path: str, run_root: str, log: Path) -> dict[str, Any]:
    """One start of `step` forked by `server` (a `ForkServer`): wall seconds from the request to READY."""
    t0 = time.perf_counter()
    with open(log, "wb") as f:
        argv = ["--child", step, "--config", config_path, "--run_root", run_root]
        proc = server.spawn("bench.bench_startup", argv, _env(), f.fileno())
    if proc is None:
        raise RuntimeError(f"the fork server could not start {step}: {server.disabled}")
    rc = proc.wait(timeout=600)
    wall = time.perf_counter() - t0
    ready = [line for line in log.read_text().splitlines() if line.startswith("READY ")]
    if rc != 0 or not ready:
        raise RuntimeError(f"forked step {step} did not get ready (exit {rc}): {log.read_text()[-2000:]}")
    return {"wall_s": wall, "phases": json.loads(ready[-1][len("READY ") :])}


def run(steps: list[str], starts: int, config_path: str, forked: bool = True) -> list[dict[str, Any]]:
    """`starts` starts of each step, interleaved across steps; one row per step, and (`forked`) one per JAX
    step started by a fork server."""
    from pipeline.jobs.launchers.forkserver import ForkServer

    samples: dict[str, list[dict[str, Any]]] = {s: [] for s in steps}
    jax_steps = [s for s in steps if s in ("learn", "rollout", "evaluate")] if forked else []
    with tempfile.TemporaryDirectory(prefix="rlpipe-startup-") as tmp:
        for _ in range(starts):
            for s in steps:
                samples[s].append(measure(s, config_path, str(Path(tmp) / "run")))
        if jax_steps:
            server = ForkServer([f"steps.{s}" for s in jax_steps] + ["bench.bench_startup"], _env())
            t0 = time.perf_counter()
            server.start()
            try:
                if not server.wait_ready():
                    raise RuntimeError(f"the fork server did not get ready: {server.disabled}")
                ready_s = time.perf_counter() - t0
                for _ in range(starts):
                    for s in jax_steps:
                        m = measure_forked(server, s, config_path, str(Path(tmp) / "run"), Path(tmp) / "f.log")
                        samples.setdefault(f"{s} (forked)", []).append(m)
            finally:
                server.close()
            print(f"fork server ready (imports of {', '.join(jax_steps)}) in {ready_s:.2f} s")
    rows = []
    for s in samples:
        walls = [m["wall_s"] for m in samples[s]]
        warm = walls[1:] or walls
        rows.append(
            {
                "step": s,
                "cold_s": walls[0],
                "warm_s": statistics.median(warm),
                "phases_warm": {
                    k: statistics.median(m["phases"][k] for m in samples[s][1:] or samples[s])
                    for k in samples[s][0]["phases"]
                },
                "goal_s": GOAL_S,
            }
        )
    return rows


def print_table(rows: list[dict[str, Any]], machine: str) -> None:
    print(f"\nstep start (process start -> ready to work), machine: {machine}; goal <= {GOAL_S:.0f} s")
    print(f"{'step':<14}{'cold s':>8}{'warm s':>8}  warm phases (s)")
    for r in rows:
        ph = ", ".join(f"{k} {v:.2f}" for k, v in r["phases_warm"].items())
        print(f"{r['step']:<14}{r['cold_s']:>8.2f}{r['warm_s']:>8.2f}  {ph}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", default=",".join(STEPS))
    ap.add_argument("--starts", type=int, default=3, help="starts per step (the first is reported as cold)")
    ap.add_argument("--config", default="configs/test_cats.yaml", help="the job config the steps are built from")
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--run_root", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.child, args.config, args.run_root)
        return 0
    steps = [s for s in args.steps.split(",") if s]
    unknown = [s for s in steps if s not in STEPS]
    if unknown:
        ap.error(f"--steps: unknown {unknown}; choose from {STEPS}")
    machine = machine_name()
    rows = run(steps, args.starts, args.config)
    print_table(rows, machine)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": machine, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
