"""The Makefile's recipes as commands a test can run without `make` (whose targets depend on `setup`, which
re-syncs the environment): a target's recipe line with make's variables substituted, and the environment the
Makefile exports."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAKEFILE = REPO / "Makefile"


def makefile_defaults() -> dict[str, str]:
    """Every `NAME ?= value` of the Makefile (a variable's default when make is not given it)."""
    return dict(re.findall(r"^(\w+) \?= ?(.*)$", MAKEFILE.read_text(), re.M))


def recipe_command(target: str, **variables: str) -> list[str]:
    """Target `target`'s one-line recipe as argv, with `$(VAR)` set from `variables` as given on make's command line
    (PY: this interpreter, VENV: its environment, unset ones their `?=` default or empty), `$(if $(V),…)` kept only
    when V is set, `$(if $(V),,$(error …))` (a required variable) asserted set, and JOB_CONFIG as the Makefile
    computes it (`--config_path CONFIG` when CONFIG is given, else `--default_config_path` and CONFIG's default)."""
    m = re.search(rf"^{re.escape(target)}:.*\n\t(.+)$", MAKEFILE.read_text(), re.M)
    assert m is not None, f"the Makefile has no one-line recipe for {target!r}"
    defaults = makefile_defaults()
    values = {**defaults, "PY": sys.executable, "VENV": str(Path(sys.executable).parent.parent), "ARGS": "",
              **variables}  # fmt: skip
    flag = "--config_path" if "CONFIG" in variables else "--default_config_path"
    values["JOB_CONFIG"] = f"{flag} {shlex.quote(values['CONFIG'])}"
    line = m.group(1)
    for name in re.findall(r"\$\(if \$\((\w+)\),,\$\(error \$\(\w+\)\)\)", line):
        assert values.get(name), f"make {target} needs {name}"
    line = re.sub(r"\$\(if \$\((\w+)\),,\$\(error \$\(\w+\)\)\)", "", line)
    line = re.sub(r"\$\(if \$\((\w+)\),(.*?\$\(\1\))\)", lambda g: g.group(2) if values.get(g.group(1)) else "",
                  line)  # fmt: skip
    line = re.sub(r"\$\((\w+)\)", lambda g: values.get(g.group(1), ""), line)
    # ARGS is spliced as make splices it: its words are split by the shell
    return shlex.split(line)


def make_env() -> dict[str, str]:
    """This process's environment plus every `export NAME := value` / `?=` of the Makefile (`?=` only when unset)."""
    env = dict(os.environ)
    for name, op, value in re.findall(r"^export (\w+) (:=|\?=) ?(.*)$", MAKEFILE.read_text(), re.M):
        value = value.replace("$(CURDIR)", str(REPO)).strip()
        if op == ":=" or name not in env:
            env[name] = value
    return env


def wait_all(procs: dict[str, subprocess.Popen[bytes]], logs: dict[str, Path], timeout_s: float) -> dict[str, str]:
    """Wait for every process (killing one that outlives `timeout_s`); the log tail of each that did not exit 0."""
    errors = {}
    for name, proc in procs.items():
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.returncode != 0:
            errors[name] = logs[name].read_text()[-3000:]
    return errors
