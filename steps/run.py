"""Run a whole RL job, or one of its steps, from one job config.

Reads: a job config YAML (`configs/*.yaml`, an `RLJobConfig`). Writes: the run root, through the
steps it starts. Algorithm: validate the whole config before any process starts (lesson DAG,
environment classes, batch size vs prompts × generations, lengths), write or check `run.json`,
then supervise the steps (pipeline.runner).

    python -m steps.run --config_path configs/demo_cats.yaml --run_root runs/demo
    python -m steps.run step learn   --config_path configs/demo_cats.yaml --run_root runs/demo --max_steps 5
    python -m steps.run step batches --config_path … --run_root … --max_batches 3
    python -m steps.run step rollout --config_path … --run_root … --worker_id w7 --max_rollouts 64
    python -m steps.run step evaluate --config_path … --run_root … --all true

`--run_root X` is shorthand for `--store.run_root X`. Extra flags of `step` apply to that step's
config (see `python -m steps.<module> --help`).
"""

from __future__ import annotations

import importlib
import logging
import sys
import tempfile
from pathlib import Path
from typing import Any

import draccus

from pipeline.config import ConfigError
from pipeline.job import RLJob, RLJobConfig, check_run_config

logger = logging.getLogger("rlpipe.run")

STEP_MODULES = {
    "learn": ("learner", "steps.learn"),
    "batches": ("batches", "steps.make_batches"),
    "rollout": ("rollout", "steps.rollout"),
    "evaluate": ("evaluate", "steps.evaluate"),
}


def _rewrite_run_root(args: list[str]) -> list[str]:
    out = []
    for a in args:
        if a == "--run_root":
            out.append("--store.run_root")
        elif a.startswith("--run_root="):
            out.append("--store.run_root=" + a.split("=", 1)[1])
        else:
            out.append(a)
    return out


def _split_job_args(args: list[str]) -> tuple[list[str], list[str]]:
    """Job-level args (config path and store) vs step-level overrides."""
    job, step = [], []
    i = 0
    while i < len(args):
        a = args[i]
        key = a.split("=", 1)[0]
        takes_value = "=" not in a and i + 1 < len(args)
        if key in ("--config_path",) or key.startswith("--store."):
            job.append(a)
            if takes_value:
                job.append(args[i + 1])
                i += 1
        else:
            step.append(a)
            if takes_value and not args[i + 1].startswith("--"):
                step.append(args[i + 1])
                i += 1
        i += 1
    return job, step


def parse_job(args: list[str]) -> RLJobConfig:
    """An RLJobConfig from CLI args (a config file plus overrides); ConfigError names a bad field."""
    return draccus.parse(RLJobConfig, args=args)


def run_step(step: str, args: list[str]) -> int:
    """Run one step of the job described by the config, with step-level overrides."""
    if step not in STEP_MODULES:
        raise SystemExit(f"unknown step {step!r}; one of {sorted(STEP_MODULES)}")
    key, module_name = STEP_MODULES[step]
    job_args, step_args = _split_job_args(args)
    job = RLJob(parse_job(job_args))
    from pipeline.storage import RunStore

    check_run_config(RunStore(job.config.store.run_root, job.config.store.storage_options), job.config)
    base: Any = job.to_worker_configs()[key]
    if isinstance(base, list):
        base = base[0]
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "step.yaml"
        path.write_text(draccus.dump(base))
        cfg = draccus.parse(type(base), config_path=str(path), args=step_args)
    module = importlib.import_module(module_name)
    result = module.main(cfg)
    return int(result or 0)


def main(argv: list[str] | None = None) -> int:
    """CLI entry point."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = _rewrite_run_root(list(sys.argv[1:] if argv is None else argv))
    try:
        if args and args[0] == "step":
            if len(args) < 2:
                raise SystemExit("usage: python -m steps.run step {learn,batches,rollout,evaluate} [args]")
            return run_step(args[1], args[2:])
        job = RLJob(parse_job(args))
        return job.run()
    except ConfigError as e:
        logger.error("invalid config: %s", e)
        return 2


if __name__ == "__main__":
    sys.exit(main())
