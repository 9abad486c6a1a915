"""The import set of every step program: no `datasets`, `pandas`, `ray` or `torch` in a step process.

levanter's package `__init__` files import all of these (~10 s per process); `policy/_imports.py` makes levanter's
packages lazy so a step loads only the levanter submodules it uses. Each check runs in a fresh interpreter, the
way the job runner starts a step (`python -m steps.<name>`). `ray` is imported by `steps.run` only when the job's
backend is Ray, and then only when the job starts, so no import-time check allows it.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN = ("datasets", "pandas", "ray", "torch")
STEPS = ("learn", "make_batches", "rollout", "sft", "evaluate", "export", "run")

# The policy and levanter modules the steps import lazily, inside `main` (model build and load, the
# inference backends, the trackers, the HF converter).
RUNTIME_MODULES = (
    "policy.model",
    "policy.learner",
    "policy.rollout_manager",
    "pipeline.rollout.worker",
    "policy.inference.dense",
    "policy.inference.levanter_engine",
    "policy.inference.openai",
    "policy.trackers",
    "levanter.compat.hf_checkpoints",
    "levanter.inference.engine",
    "levanter.inference.jit_scheduler",
    "levanter.tracker.json_logger",
    "levanter.tracker.tensorboard",
)


def _env() -> dict[str, str]:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "HF_HUB_OFFLINE": "1"}
    env.pop("USE_TORCH", None)  # the step package sets it for a step process; the check must see its own setting
    env.pop("PYTHONPATH", None)
    return env


def _imported_modules(stderr: str) -> set[str]:
    """Top-level package names from `python -X importtime` output."""
    names = set()
    for line in stderr.splitlines():
        if line.startswith("import time:") and "|" in line:
            name = line.rsplit("|", 1)[1].strip()
            if name and name != "imported package":
                names.add(name.split(".")[0])
    return names


@pytest.mark.parametrize("step", STEPS)
def test_step_process_imports_no_heavy_package(step: str) -> None:
    """`python -m steps.<step> --help` (module imported, config parsed) imports none of FORBIDDEN."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", f"steps.{step}", "--help"],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    imported = _imported_modules(proc.stderr)
    assert "steps" in imported and "pipeline" in imported, "importtime output not parsed"
    assert not imported & set(FORBIDDEN), f"steps.{step} imported {sorted(imported & set(FORBIDDEN))}"


HEAVY_STEPS = ("learn", "rollout", "sft", "evaluate", "replay")
"""Step programs whose `main` imports JAX: each names what it imports in `HEAVY_MODULES` (`steps.cli.step_main`)."""


def imported_in_functions(step: str) -> set[str]:
    """The `policy.*` and `pipeline.*` modules that functions of `steps/<step>.py` import (not its top level)."""
    tree = ast.parse((ROOT / "steps" / f"{step}.py").read_text())
    names: set[str] = set()
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
                names.update(f"{node.module}.{a.name}" for a in node.names if node.module == "policy")
            elif isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
    return {n for n in names if n.split(".")[0] in ("policy", "pipeline")}


def test_runtime_modules_import_no_heavy_package() -> None:
    """A step module imports no JAX at its top (its config is checked first); its `HEAVY_MODULES` load every module
    its functions import (the fork server preloads them: a forked step imports none itself); and every module a step
    imports while it works (model, backends, trackers) imports none of FORBIDDEN.

    Run with the environment a step process has (`steps/__init__.py` sets USE_TORCH=0 for `python -m steps.*`,
    which stops transformers from importing torch).
    """
    steps = [f"steps.{s}" for s in HEAVY_STEPS]
    code = (
        "import importlib, json, sys\n"
        + "".join(f"import {name}\n" for name in steps)
        + "light = 'jax' not in sys.modules\n"
        + f"for step in {steps!r}:\n"
        + "    for m in sys.modules[step].HEAVY_MODULES:\n"
        + "        importlib.import_module(m)\n"
        + "loaded = sorted(sys.modules)\n"
        + "".join(f"import {name}\n" for name in RUNTIME_MODULES)
        + f"print(json.dumps([light, loaded, sorted(set({FORBIDDEN!r}) & {{m.split('.')[0] for m in sys.modules}})]))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**_env(), "USE_TORCH": "0"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    light, loaded, forbidden = json.loads(proc.stdout.strip().splitlines()[-1])
    assert light, "a step module imported JAX at its top"
    assert "jax" in loaded
    for step in HEAVY_STEPS:
        missing = imported_in_functions(step) - set(loaded)
        assert not missing, f"steps.{step}: its functions import {sorted(missing)}, not in its HEAVY_MODULES"
    assert forbidden == [], forbidden


def test_lazy_levanter_keeps_package_names() -> None:
    """The names levanter's `__init__` files export stay reachable, and importing them loads the real modules."""
    code = (
        "import policy, levanter, sys\n"
        "assert levanter.__version__ == '1.2', levanter.__version__\n"
        "assert 'datasets' not in sys.modules\n"
        "from levanter.tracker import current_tracker\n"
        "assert levanter.current_tracker is current_tracker\n"
        "from levanter.data import DataLoader\n"
        "from levanter.data.loader import DataLoader as D2\n"
        "assert DataLoader is D2\n"
        "assert 'datasets' not in sys.modules\n"
        "from levanter.data import datasource_from_hf\n"
        "assert 'datasets' in sys.modules\n"
        "import levanter.models.llama as llama\n"
        "assert levanter.models.llama is llama\n"
        "print('ok')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env={**_env(), "USE_TORCH": "0"}, capture_output=True, text=True
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
