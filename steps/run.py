"""Run a whole RL job, or one of its steps, from one job config.

Reads: a job config YAML (`configs/*.yaml`, an `RLJobConfig`). Writes: the run root, through the
steps it starts. Algorithm: validate the whole config before any process starts (lesson DAG,
environment classes, batch size vs prompts × generations, lengths, a lesson none of whose prompts fits the
sampler), write or check `run.json` (a step records the contract it runs with, its overrides included),
then supervise the steps (pipeline.jobs.runner).

    python -m steps.run --config_path configs/demo_cats.yaml --run_root runs/demo [--train.num_train_steps 5 …]
    python -m steps.run step learn   --config_path configs/demo_cats.yaml --run_root runs/demo --max_steps 5
    python -m steps.run step batches --config_path … --run_root … --max_batches 3
    python -m steps.run step rollout --config_path … --run_root … --worker_id w7 --max_rollouts 64
    python -m steps.run step evaluate --config_path … --run_root … --all true

`--run_root X` is shorthand for `--store.run_root X`. Without `--config_path`, a run root that holds run.json runs
the job config run.json records (its flags override it as they override a file: `rlpipe learn --run_root R
--max_steps 5`); one without run.json runs `--default_config_path F` when given (the make targets' default CONFIG).
A whole job holds the run root's job lease while it runs: a second job there is refused in one line, exit 6
(pipeline.jobs.runner). `step learn` and `step rollout` on a finished run end before importing JAX (steps.early).
Without `step`, every other flag overrides the job config
(draccus dotted flags); with `step NAME`, `--config_path` and `--store.*` describe the job and every other flag
overrides that step's config (see `python -m steps.<module> --help`), except a flag of a job field the step's
config does not have (`step learn --curriculum.lessons.cats.chat true`): it overrides the job config. A bad
config is one line on stderr naming the field and the value, exit code 2, before anything starts. So is a model
/ train / optimizer / loss / curriculum value that differs from the run root's run.json (unless
`--allow_config_change true`: then recorded in run.json's history), and `step evaluate` on a run root without
run.json. So is a run root that is a non-empty folder but not a run root (no run.json, and entries rlpipe does
not make): nothing is created there.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import logging
import os
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import draccus

from pipeline.config import ConfigError, RLJobConfig, dump_yaml
from pipeline.jobs.job import RLJob
from pipeline.jobs.job_lease import refuse_beside_a_live_job
from pipeline.process.step_kind import StepKind, cli_names
from pipeline.run_contract import ALLOW_CHANGE_FLAG, check_run_config, check_step_config, with_step_contract
from pipeline.store import layout
from pipeline.store.run_state import read_run_record
from pipeline.store.storage import RunStore, require_run, storage_options_from
from steps.cli import parse_bool, parse_config, run_command, step_main


@dataclass(frozen=True)
class Invocation:
    """A parsed command line: the job's draccus arguments and, for `step NAME`, the step and its overrides."""

    job_args: list[str]
    step: StepKind | None = None
    step_args: tuple[str, ...] = ()
    allow_config_change: bool = False
    """Accept contract fields that differ from run.json (recorded in its history) instead of refusing them."""
    default_config_path: str | None = None
    """The job config of a run root without run.json when `--config_path` is not given (make's CONFIG default)."""


def _add_job_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config_path", help="the job config YAML (an RLJobConfig); default: the one the run root's run.json records"
    )
    parser.add_argument("--run_root", "--store.run_root", dest="run_root", help="the run root (overrides the config)")
    parser.add_argument(
        "--store.storage_options",
        dest="storage_options",
        help='fsspec options of the run root (JSON: \'{"token": "anon"}\')',
    )
    parser.add_argument(
        "--default_config_path",
        help="the job config when --config_path is not given and the run root has no run.json yet (an existing run's "
        "job config is its run.json)",
    )
    parser.add_argument(
        ALLOW_CHANGE_FLAG,
        dest="allow_config_change",
        default="false",
        help="true: accept model/train/optimizer/loss/curriculum values that differ from run.json (recorded there)",
    )


def job_parser() -> argparse.ArgumentParser:
    """`python -m steps.run [job options] [--field value …]` (unknown flags are job config overrides)."""
    parser = argparse.ArgumentParser(prog="python -m steps.run", allow_abbrev=False, description=__doc__)
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    _add_job_options(parser)
    return parser


def step_parser() -> argparse.ArgumentParser:
    """`python -m steps.run step NAME [job options] [--field value …]` (unknown flags: step overrides)."""
    parser = argparse.ArgumentParser(prog="python -m steps.run step", allow_abbrev=False)
    parser.add_argument("step", choices=cli_names(), help="the step to run")
    _add_job_options(parser)
    return parser


def parse_args(argv: Sequence[str]) -> Invocation:
    """The invocation `argv` asks for (argparse errors exit 2 with argparse's message)."""
    args = list(argv)
    if args[:1] == ["step"]:
        ns, rest = step_parser().parse_known_args(args[1:])
        allow = parse_bool(ALLOW_CHANGE_FLAG, ns.allow_config_change)
        step = StepKind.from_cli(ns.step)
        return Invocation(job_args=_job_args(ns), step=step, step_args=tuple(rest), allow_config_change=allow,
                          default_config_path=ns.default_config_path)  # fmt: skip
    ns, rest = job_parser().parse_known_args(args)
    return Invocation(
        job_args=_job_args(ns) + rest,
        allow_config_change=parse_bool(ALLOW_CHANGE_FLAG, ns.allow_config_change),
        default_config_path=ns.default_config_path,
    )


def _job_args(ns: argparse.Namespace) -> list[str]:
    out = []
    for flag, value in (
        ("--config_path", ns.config_path),
        ("--store.run_root", ns.run_root),
        ("--store.storage_options", ns.storage_options),
    ):
        if value is not None:
            out += [flag, value]
    return out


def _flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value of `flag V` in draccus-style `args` (as `_job_args` writes them), else None."""
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
    return None


def with_job_config(invocation: Invocation, folder: str) -> Invocation:
    """The invocation with its job config named: `--config_path` as given; else, on a run root that holds run.json,
    the job config run.json records (written as YAML into `folder`), so a step started on an existing run without a
    config runs that run's job (its flags override it, as they override a file); else `--default_config_path`."""
    if _flag_value(invocation.job_args, "--config_path") is not None:
        return invocation
    run_root = _flag_value(invocation.job_args, "--store.run_root")
    path = invocation.default_config_path
    if run_root is not None:
        options = storage_options_from(_flag_value(invocation.job_args, "--store.storage_options"))
        store = RunStore(run_root, options or None)
        if not (store.is_local and os.path.isfile(store.root)) and store.exists(layout.RUN_CONFIG):
            path = os.path.join(folder, "run-json-config.yaml")
            with open(path, "w", encoding="utf-8") as f:
                f.write(dump_yaml(read_run_record(store)["config"]))
            logging.getLogger("rlpipe.run").info("job config: %s (no --config_path given)",
                                                 store.full_path(layout.RUN_CONFIG))  # fmt: skip
    if path is None:
        return invocation
    return dataclasses.replace(invocation, job_args=["--config_path", path, *invocation.job_args])


def parse_job(args: Sequence[str]) -> RLJobConfig:
    """An RLJobConfig from draccus args (a config file plus overrides); UsageError names a bad field."""
    return parse_config(RLJobConfig, args)


def step_config(job: RLJob, step: StepKind, overrides: Sequence[str]) -> Any:
    """The config of `step` the job gives, with the command line's step-level overrides applied."""
    base: Any = job.to_worker_configs()[step.job_name]
    if isinstance(base, list):
        base = base[0]
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "step.yaml"
        path.write_text(draccus.dump(base) or "")
        return parse_config(type(base), ["--config_path", str(path), *overrides])


READ_ONLY_STEPS = frozenset({StepKind.EVALUATE})
"""Steps that only read a run: refused on a run root without run.json (nothing is created)."""
RUN_ROOT_ENTRIES = frozenset(
    {layout.RUN_CONFIG, "control", layout.POLICIES, layout.CHECKPOINTS, layout.ROLLOUTS, "batches", layout.CURRICULUM,
     layout.EVALS, layout.METRICS, layout.QUARANTINE, layout.LEASES, layout.LOGS, layout.LINEAGE, layout.GC,
     layout.RESCORED, "report"}
)  # fmt: skip
"""The top-level names rlpipe makes in a run root (`pipeline.store.layout`, and the report's folder)."""


def refuse_foreign_folder(store: RunStore) -> None:
    """Refuse (ConfigError naming `store.run_root`; nothing created) a run root that is a file, or a non-empty
    folder that is not a run root: no run.json and an entry rlpipe does not make (hidden `.*` entries aside).
    An absent or empty folder, or one made by rlpipe, is accepted."""
    if store.is_local and os.path.isfile(store.root):
        raise ConfigError("store.run_root", store.url, "is a file, not a folder")
    if store.exists(layout.RUN_CONFIG):
        return
    names = [rel.rsplit("/", 1)[-1] for rel in store.list("")]
    foreign = [n for n in names if n not in RUN_ROOT_ENTRIES and not n.startswith(".")]
    if foreign:
        shown = ", ".join(foreign[:5]) + (", …" if len(foreign) > 5 else "")
        raise ConfigError(
            "store.run_root",
            store.url,
            f"is a non-empty folder that is not a run root (no {layout.RUN_CONFIG}; holds {shown}): "
            "name a new or empty folder, or an existing run root",
        )


def split_step_args(job: RLJob, step: StepKind, args: Sequence[str]) -> tuple[list[str], list[str]]:
    """(the flags of job fields that `step`'s config does not have, the step's own overrides), in their order.
    The first override the job config: `step learn --curriculum.lessons.<id>.chat true` changes the job's lesson
    (an unknown id is refused naming the known ones; a change is checked against run.json) instead of being an
    unrecognized argument of the learner's config."""
    base: Any = job.to_worker_configs()[step.job_name]
    if isinstance(base, list):
        base = base[0]
    step_fields = {f.name for f in dataclasses.fields(base)}
    job_only = {f.name for f in dataclasses.fields(RLJobConfig)} - step_fields
    to_job: list[str] = []
    to_step: list[str] = []
    i = 0
    while i < len(args):
        arg = args[i]
        flag = arg.startswith("--")
        count = 2 if flag and "=" not in arg and i + 1 < len(args) and not args[i + 1].startswith("--") else 1
        top = arg[2:].split("=", 1)[0].split(".", 1)[0] if flag else ""
        (to_job if top in job_only else to_step).extend(args[i : i + count])
        i += count
    return to_job, to_step


def run_step(job: RLJob, step: StepKind, overrides: Sequence[str]) -> int:
    """Run one step of the job; returns the step program's exit code.

    First, with nothing started: a read-only step refuses a run root without run.json (MissingRunError); any
    other step writes run.json if absent; the step's config (job config plus the step-level overrides) is refused
    when a contract field differs from run.json, unless the job allows config changes."""
    config = step_config(job, step, overrides)
    store = RunStore(job.config.store.run_root, job.config.store.storage_options or None)
    module_name = step.module
    if step in READ_ONLY_STEPS:
        require_run(store)
    else:
        refuse_foreign_folder(store)
        # run.json records the contract the step runs with: the job config with the step-level overrides applied
        check_run_config(store, with_step_contract(job.config, config), allow_change=job.allow_config_change,
                         by=module_name)  # fmt: skip
    check_step_config(store, config, by=module_name, allow_change=job.allow_config_change)
    refuse_beside_a_live_job(store, module_name)  # a scheduled training step beside a live job: exit 6, one line
    # A step module imports light modules only; a scheduled step on a finished run ends in its EARLY_EXIT
    # (`steps.early`), before its HEAVY_MODULES (JAX) are imported (`steps.cli.step_main`), as its own program does.
    module = importlib.import_module(module_name)
    program = step_main(module.main, getattr(module, "HEAVY_MODULES", ()), getattr(module, "EARLY_EXIT", None))
    return program(config)


def check_prompts(job: RLJob) -> None:
    """Refuse (ConfigError naming the sequence-length field and the lesson; exit 2, nothing started) a job with a
    lesson none of whose prompts fits the sampler: the rollout worker's own start-up check
    (`pipeline.environments.start_checks.check_lessons`) on the job's rollout config, run once before any process starts
    (it needs the tokenizer and the environments, hence here and not in `validate_job`, which imports neither).
    A built-in tokenizer without chat lessons is checked through `BuiltinTokenizer` (the same ids, no transformers
    import: about 0.5 CPU-s less at a job start)."""
    from pipeline.environments.start_checks import check_lessons
    from pipeline.environments.tokenizer import BUILTIN_SPECS, BuiltinTokenizer, load_tokenizer

    configs = job.to_worker_configs()[StepKind.ROLLOUT.job_name]
    config = configs[0] if isinstance(configs, list) and configs else configs
    if not config:
        return
    spec = config.model.tokenizer
    chat = any(lesson.chat for lesson in config.curriculum.lessons.values())  # chat prompts need the template
    check_lessons(config, BuiltinTokenizer(spec) if spec in BUILTIN_SPECS and not chat else load_tokenizer(spec))


def main(invocation: Invocation) -> int:
    """Run the job (or the one step) the invocation names; returns the process exit code."""
    with tempfile.TemporaryDirectory(prefix="rlpipe-run-") as folder:
        return run_invocation(with_job_config(invocation, folder))


def run_invocation(invocation: Invocation) -> int:
    """Run the job (or the one step) of an invocation whose job config is named (`with_job_config`)."""
    job = RLJob(parse_job(invocation.job_args), allow_config_change=invocation.allow_config_change)
    if invocation.step is not None:
        job_flags, step_flags = split_step_args(job, invocation.step, invocation.step_args)
        if job_flags:  # e.g. `step learn --curriculum.lessons.cats.chat true`: a job field the learner has not
            job = RLJob(
                parse_job([*invocation.job_args, *job_flags]), allow_config_change=invocation.allow_config_change
            )
        return run_step(job, invocation.step, step_flags)
    from pipeline.jobs.runner import JobRunner

    check_prompts(job)
    store = RunStore(job.config.store.run_root, job.config.store.storage_options or None)
    refuse_foreign_folder(store)
    rc = JobRunner(job).run()  # first the job lease: a second job on a live run root is one line, exit 6
    log_summary(store, job.config.store.run_root)
    return rc


def log_summary(store: RunStore, run_root: str) -> None:
    """The job's closing lines: first and last batch reward, the last evaluation, the `make report` command
    (`pipeline.jobs.progress.summary_lines`); a run root that cannot be read only loses the summary."""
    import logging

    from pipeline.jobs.progress import summary_lines

    log = logging.getLogger("pipeline.jobs.runner")
    try:
        lines = summary_lines(store, run_root)
    except Exception as e:  # the summary is a courtesy: the run root holds everything
        log.warning("no summary: cannot read %s (%s)", run_root, e)
        return
    for line in lines:
        log.info("%s", line)


def cli(argv: Sequence[str] | None = None) -> int:
    """`python -m steps.run …` (see the module docstring); returns the exit code."""
    return run_command(parse_args, main, argv)


if __name__ == "__main__":
    sys.exit(cli())
