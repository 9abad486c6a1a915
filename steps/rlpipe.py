"""`rlpipe COMMAND [flags …]`: one command for every program, with each program's own exit code.

    rlpipe run      --config_path configs/demo_cats.yaml --run_root runs/demo   # = python -m steps.run …
    rlpipe learn    --run_root runs/demo --max_steps 5                          # = python -m steps.run step learn …
    rlpipe evaluate --store.run_root runs/demo --all true                       # = python -m steps.evaluate …
    rlpipe report   runs/demo                                                   # = python -m pipeline.report …

Each command runs its program in this process, exactly as `python -m <module>` runs it (the module as `__main__`,
the same flags, the current folder first on the import path, the step process's environment defaults): its exit
code is the program's, from the one table (docs/reference/exit-codes.md), where `make` would report 2 for any
failed recipe. That is why a scheduler or a container calls `rlpipe` (`.venv/bin/rlpipe`) rather than a make
target. `rlpipe recipe [--name N]` runs the recipe's three programs one after another (SFT, the RL job, the
report), each as a child process, and ends with the code of the first that fails.

Nothing heavy is imported before the program is chosen; Ctrl-C (SIGINT) or SIGTERM before the program runs its own
code ends it with one line and 130 / 143 (`pipeline.process.interrupts`).
"""

from __future__ import annotations

import os
import runpy
import signal
import subprocess
import sys
from collections.abc import Sequence
from types import FrameType

COMMANDS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "run": ("steps.run", (), "a whole job: learner, BatchMaker, rollout workers, evaluator (make run)"),
    "rollout": ("steps.run", ("step", "rollout"), "one rollout worker of a job (make rollout)"),
    "batches": ("steps.run", ("step", "batches"), "the BatchMaker of a job (make batches)"),
    "learn": ("steps.run", ("step", "learn"), "the learner of a job (make learn)"),
    "evaluate": ("steps.evaluate", (), "evaluate policies of a run, config from run.json (make evaluate)"),
    "export": ("steps.export", (), "a committed policy as a Hugging Face folder (make export)"),
    "report": ("pipeline.report", (), "the HTML report of a run (make report)"),
    "replay": ("steps.replay", (), "re-train committed slots from a checkpoint and compare bitwise (make replay)"),
    "gc": ("steps.gc", (), "garbage-collect a run under its retention settings (make gc)"),
    "sft": ("steps.sft", (), "supervised fine-tuning: a policy an RL job starts from (make sft)"),
    "serve": ("steps.serve", (), "serve a committed policy over the generate endpoint (make serve)"),
    "rescore": ("steps.rescore", (), "re-score committed rollout files with a new scorer (make rescore)"),
    "demo": ("steps.demo", (), "the cats demo job, rewards, probes and report (make demo)"),
}
"""command -> (module run as `python -m <module>`, the arguments put before the user's, what it does)."""
RECIPE_HELP = "the real-task recipe: SFT, then the RL job, then its report (make recipe; --name basic_arithmetic)"
DEFAULT_RECIPE = "basic_arithmetic"


def usage() -> str:
    """The text of `rlpipe --help`."""
    lines = ["usage: rlpipe COMMAND [flags …]   (rlpipe COMMAND --help: the command's own flags)", "", "commands:"]
    rows = [(name, what) for name, (_, _, what) in COMMANDS.items()] + [("recipe", RECIPE_HELP)]
    lines += [f"  {name:<9} {what}" for name, what in rows]
    lines += [
        "",
        "The exit code is the program's own (docs/reference/exit-codes.md): 0 done, 2 invalid config,",
        "75 storage unavailable (retry later), 130/143 interrupted; `make` reports 2 for any of them.",
    ]
    return "\n".join(lines)


def resolve(command: str, args: Sequence[str]) -> tuple[str, list[str]]:
    """(the module `rlpipe COMMAND ARGS` runs, its command line); KeyError for an unknown command."""
    module, prefix, _ = COMMANDS[command]
    return module, [*prefix, *args]


def run_module(module: str, argv: Sequence[str]) -> int:
    """Run `module` as `python -m module argv` runs it, in this process; its exit code."""
    sys.argv = [module, *argv]
    cwd = os.getcwd()
    if cwd not in sys.path[:1]:
        sys.path.insert(0, cwd)  # as `python -m` does: modules of the current folder import (an environment class)
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        return _code(e.code)
    return 0


def _code(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)  # sys.exit("message"): Python prints it and exits 1
    return 1


def recipe(args: Sequence[str]) -> int:
    """`rlpipe recipe [--name N]`: `rlpipe sft --config_path configs/N_sft.yaml`, `rlpipe run --config_path
    configs/N.yaml`, `rlpipe report runs/N`, each a child process; the first non-zero code ends it."""
    import argparse

    parser = argparse.ArgumentParser(prog="rlpipe recipe", description=RECIPE_HELP)
    parser.add_argument("--name", default=DEFAULT_RECIPE, help="configs/<name>_sft.yaml and configs/<name>.yaml")
    name = parser.parse_args(list(args)).name
    phases = [
        ["sft", "--config_path", f"configs/{name}_sft.yaml"],
        ["run", "--config_path", f"configs/{name}.yaml"],
        ["report", f"runs/{name}"],
    ]
    for phase in phases:
        code = run_child([sys.executable, "-m", "steps.rlpipe", *phase])
        if code != 0:
            return code
    return 0


def run_child(command: list[str]) -> int:
    """Run `command` in a process group of its own and wait for it; SIGINT and SIGTERM that reach this process are
    passed on to it once (so a terminal's Ctrl-C reaches it exactly once). Its exit code (128 + the signal when a
    signal ended it)."""
    proc = subprocess.Popen(command, process_group=0)

    def forward(signum: int, frame: FrameType | None) -> None:
        if proc.poll() is None:
            proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = proc.wait()  # a signal runs `forward`, then the wait goes on until the child has ended
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 128 - code if code < 0 else code


def main(argv: Sequence[str] | None = None) -> int:
    """`rlpipe COMMAND [flags …]`; the exit code of the program COMMAND runs."""
    from pipeline.process.interrupts import end_process, exit_at_once_on_signals, exit_code, ignore_stop_signals

    exit_at_once_on_signals()
    code = dispatch(list(sys.argv[1:] if argv is None else argv))
    if code in (exit_code(signal.SIGINT), exit_code(signal.SIGTERM)):
        end_process(code)  # no interpreter teardown after a stop by a signal (see `end_process`)
    ignore_stop_signals()  # the code is decided: a late Ctrl-C must not turn it into a death by SIGINT
    return code


def dispatch(args: list[str]) -> int:
    """Run `rlpipe ARGS` in this process; its exit code."""
    from pipeline.process.interrupts import interrupted

    if not args or args[0] in ("-h", "--help", "help"):
        print(usage(), file=sys.stdout if args else sys.stderr)
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command != "recipe" and command not in COMMANDS:
        known = ", ".join([*COMMANDS, "recipe"])
        print(f"error: invalid config: rlpipe {command!r}: not a command; one of {known}", file=sys.stderr)
        return 2
    from steps import step_process_defaults

    step_process_defaults()
    try:
        if command == "recipe":
            return recipe(rest)
        return run_module(*resolve(command, rest))
    except KeyboardInterrupt:  # before the program's own handling took over
        return interrupted()


if __name__ == "__main__":
    sys.exit(main())
