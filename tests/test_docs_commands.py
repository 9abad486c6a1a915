"""Every command of the docs' shell blocks runs as written, in a fresh shell.

The fenced `bash` blocks of README.md and docs/**/*.md (docs/reference/configuration.md is generated and holds
none) are read; each `make …`, `python -m steps.…` and `python -m pipeline.…` line is checked:

- the rule the README states once ("Commands outside make"): a block with a `python -m` line first activates the
  project's environment (`source .venv/bin/activate`), so it runs in a fresh shell;
- resolved, in this process: a make target exists in the Makefile; a module exists and the line's flags parse
  (the step's config parsed by draccus, as the program does, with the block's shell variables filled in);
- run literally (slow: processes): `env -i HOME=… PATH=/usr/bin:/bin bash -c '<the block's setup>; <command>'`
  from the repo root, bounded — `--help` of every module the blocks name, and the cheap `python -m
  pipeline.report` line on a small run root made here;
- a step process started with JAX_PLATFORMS unset logs no libtpu / TPU line (steps/__init__.py's default).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import re
import shlex
import subprocess
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
GENERATED = REPO / "docs" / "reference" / "configuration.md"
PAGES = [REPO / "README.md", *sorted(p for p in (REPO / "docs").rglob("*.md") if p != GENERATED)]
ACTIVATE = "source .venv/bin/activate"
FRESH_SHELL_S = 60
FENCE = re.compile(r"^[ \t]*```(?:bash|sh|shell|console)\n(.*?)^[ \t]*```", re.S | re.M)
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
PLACEHOLDERS = {"N": "1"}
"""Shell variables a block uses without setting (a scheduler's job number)."""


@dataclass(frozen=True)
class Command:
    page: str
    setup: tuple[str, ...]
    """The block's lines before its commands: activation, variable assignments, exports."""
    line: str

    @property
    def words(self) -> list[str]:
        """The command's words, the block's variables (and PLACEHOLDERS) filled in."""
        variables = dict(PLACEHOLDERS)
        for line in self.setup:
            for part in line.split(";"):
                words = shlex.split(part, comments=True)
                words = words[1:] if words[:1] == ["export"] else words
                for w in words:
                    if ASSIGNMENT.match(w):
                        name, _, value = w.partition("=")
                        variables[name] = value
        out = []
        for w in shlex.split(self.line, comments=True):
            for name, value in variables.items():
                w = w.replace(f"${name}", value)
            out.append(w)
        return out

    def __str__(self) -> str:
        return f"{self.page}: {self.line.split('#')[0].strip()}"


def documented_commands() -> list[Command]:
    """Every `make …` / `python -m steps.…` / `python -m pipeline.…` line of the docs' fenced shell blocks."""
    out = []
    for page in PAGES:
        for block in FENCE.findall(page.read_text()):
            setup: list[str] = []
            for line in textwrap.dedent(block).splitlines():
                stripped = line.strip()
                if not stripped or stripped.startswith("#"):
                    continue
                if re.match(r"(make |python -m (steps|pipeline)\.|rlpipe )", stripped):
                    out.append(Command(str(page.relative_to(REPO)), tuple(setup), stripped))
                elif stripped.startswith(("source ", "export ")) or ASSIGNMENT.match(stripped):
                    setup.append(stripped)
    return out


COMMANDS = documented_commands()
PYTHON_COMMANDS = [c for c in COMMANDS if c.line.startswith("python -m ")]
MAKE_COMMANDS = [c for c in COMMANDS if c.line.startswith("make ")]
RLPIPE_COMMANDS = [c for c in COMMANDS if c.line.startswith("rlpipe ")]


def test_the_docs_have_commands_of_both_kinds() -> None:
    assert len(PYTHON_COMMANDS) >= 6 and len(MAKE_COMMANDS) >= 3, [str(c) for c in COMMANDS]


@pytest.mark.parametrize("command", PYTHON_COMMANDS + RLPIPE_COMMANDS, ids=str)
def test_a_python_command_first_activates_the_environment(command: Command) -> None:
    assert any(s.split("#")[0].strip() == ACTIVATE for s in command.setup), (
        f"{command}: the block does not start with `{ACTIVATE}` (README: commands outside make)"
    )


def makefile_targets() -> set[str]:
    return set(re.findall(r"^([a-zA-Z_-]+):", (REPO / "Makefile").read_text(), re.M))


@pytest.mark.parametrize("command", MAKE_COMMANDS, ids=str)
def test_a_make_command_names_existing_targets(command: Command) -> None:
    words = command.words
    parts: list[list[str]] = [[]]
    for w in words:
        parts.append([]) if w == "&&" else parts[-1].append(w)
    targets = makefile_targets()
    for part in parts:
        assert part[:1] == ["make"], f"{command}: {part}"
        named = [w for w in part[1:] if "=" not in w and not w.startswith("-")]
        assert named and set(named) <= targets, f"{command}: no Makefile target {set(named) - targets}"


def parse_only(module: str, argv: list[str], monkeypatch: pytest.MonkeyPatch) -> Any:
    """What `python -m module argv` parses its command line into, without running the program: the
    programs' `main` (and the run.json check, which reads the run root) replaced by a recorder."""
    import steps.cli

    if module == "steps.run":
        from pipeline.jobs.job import RLJob
        from steps import run

        invocation = run.parse_args(argv)
        job = run.parse_job(invocation.job_args)
        if invocation.step is None:
            return RLJob(job)
        return run.step_config(RLJob(job), invocation.step, invocation.step_args)
    if module == "pipeline.report":
        import pipeline.report.cli as report_cli

        seen: list[tuple[Any, ...]] = []
        monkeypatch.setattr(report_cli, "existing_run_root", lambda root, options: {})
        monkeypatch.setattr(report_cli, "build_report", lambda *a: seen.append(a) or "index.html")
        report_cli.main(argv)
        return seen[0]
    parsed: list[Any] = []

    def run_command(parse: Any, main: Any, argv: Any = None, **_: Any) -> int:
        _, args = steps.cli.pop_log_level(argv)
        parsed.append(parse(args))
        return 0

    monkeypatch.setattr(steps.cli, "run_command", run_command)
    monkeypatch.setattr(steps.cli, "check_against_run", lambda *a: None)
    program = importlib.import_module(module)
    assert program.cli(argv) == 0 and parsed, f"{module} parsed nothing"
    return parsed[0]


@pytest.mark.parametrize("command", PYTHON_COMMANDS, ids=str)
def test_a_python_command_names_a_module_and_its_flags_parse(command: Command, monkeypatch: pytest.MonkeyPatch) -> None:
    words = command.words
    assert words[:2] == ["python", "-m"], command
    module = words[2]
    assert importlib.util.find_spec(module) is not None, f"{command}: no module {module}"
    monkeypatch.chdir(REPO)
    assert parse_only(module, words[3:], monkeypatch) is not None


@pytest.mark.parametrize("command", RLPIPE_COMMANDS, ids=str)
def test_an_rlpipe_command_names_a_command_and_its_flags_parse(
    command: Command, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`rlpipe COMMAND ARGS` runs `python -m <module> <argv>` (steps/rlpipe.py): the same check as a python line."""
    from steps.rlpipe import COMMANDS as RLPIPE
    from steps.rlpipe import resolve

    words = command.words
    assert words[1] in RLPIPE, f"{command}: no rlpipe command {words[1]!r}"
    module, argv = resolve(words[1], words[2:])
    monkeypatch.chdir(REPO)
    assert parse_only(module, argv, monkeypatch) is not None


# ---------------------------------------------------------------------------------------------
# in a fresh shell
# ---------------------------------------------------------------------------------------------


def fresh_shell(script: str, home: Path) -> subprocess.CompletedProcess[str]:
    """`script` in bash with an empty environment (HOME and the system PATH only), from the repo root."""
    return subprocess.run(
        ["env", "-i", f"HOME={home}", "PATH=/usr/bin:/bin", "bash", "-c", script],
        cwd=REPO, capture_output=True, text=True, timeout=FRESH_SHELL_S,
    )  # fmt: skip


def setup_line(command: Command) -> str:
    return "; ".join(s.split("#")[0].strip() for s in command.setup) or "true"


@pytest.mark.slow
def test_every_documented_module_starts_in_a_fresh_shell(tmp_path: Path) -> None:
    """`<setup>; python -m MODULE --help` for each (setup, module) pair of the docs: the environment the block
    sets up has every dependency (no `No module named 'draccus'`)."""
    pairs = sorted({(setup_line(c), c.words[2]) for c in PYTHON_COMMANDS})
    script = " && ".join(f"( {setup} && python -m {module} --help >/dev/null )" for setup, module in pairs)
    proc = fresh_shell(script, tmp_path)
    assert proc.returncode == 0, f"{pairs}:\n{proc.stderr[-3000:]}"


@pytest.mark.slow
def test_the_report_command_runs_literally_in_a_fresh_shell(tmp_path: Path) -> None:
    """The README's `python -m pipeline.report runs/demo`, on a small run root in place of runs/demo, writes
    `<run root>/report/index.html` as the docs say."""
    from pipeline.store import layout
    from pipeline.store.storage import RunStore
    from pipeline.telemetry.metrics import MetricsWriter

    (command,) = [c for c in PYTHON_COMMANDS if c.words[2] == "pipeline.report"]
    root = tmp_path / "run"
    store = RunStore(str(root))
    store.put_unique(layout.RUN_CONFIG, json.dumps({}).encode())
    writer = MetricsWriter(store, "learner", "l")
    writer.log({"step": 1, "wait_s": 1.0, "train_s": 3.0})
    writer.flush()
    line = command.line.split("#")[0].strip().replace("runs/demo", shlex.quote(str(root)))
    proc = fresh_shell(f"{setup_line(command)}; {line}", tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == str(root / "report" / "index.html")
    assert (root / "report" / "index.html").exists()


@pytest.mark.slow
def test_a_step_process_with_jax_platforms_unset_logs_no_tpu_line(tmp_path: Path) -> None:
    """Started outside make (JAX_PLATFORMS unset), a step process picks its platforms without probing a TPU:
    no `Unable to initialize backend 'tpu' … libtpu.so` on stderr, at the INFO level a step logs at."""
    probe = (
        "import sys; sys.argv[:1] = ['-m']\n"  # what `python -m steps.<name>` looks like while steps/ is imported
        "import steps, os, logging\n"
        "logging.basicConfig(level='INFO')\n"
        "import jax; jax.devices()\n"
        "print(os.environ['JAX_PLATFORMS'])\n"
    )
    proc = fresh_shell(f"{ACTIVATE} && python -c {shlex.quote(probe)}", tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tpu" not in proc.stderr.lower(), proc.stderr[-3000:]
    from steps import default_jax_platforms

    assert proc.stdout.strip() == default_jax_platforms()  # "cpu" where no GPU plugin is installed


def test_jax_platforms_set_by_the_user_is_left_alone() -> None:
    from steps import default_jax_platforms, step_process_defaults

    for value in ("", "cuda", "cpu"):
        environ = {"JAX_PLATFORMS": value}
        step_process_defaults(environ)
        assert environ["JAX_PLATFORMS"] == value
    environ = {}
    step_process_defaults(environ)
    assert environ.get("JAX_PLATFORMS") == default_jax_platforms()
