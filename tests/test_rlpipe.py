"""`rlpipe COMMAND`: the console command the environment installs, the exit codes it passes on, the make targets
that call it, and the scheduler wrapper of the GCS guide, run against real exit codes.

- `.venv/bin/rlpipe --help` lists every command; every program target of the Makefile runs `rlpipe <command>`;
- every code of the table that a step reaches through `steps.cli.run_command` comes out of `rlpipe` unchanged
  (in process, through the dispatcher's own `run_module`; the real programs through `rlpipe` and `python -m` are in
  tests/test_exit_codes.py, the signals in tests/test_interrupts.py);
- the documented `rlpipe-cron` wrapper (parsed from docs/guides/gcs-and-ray.md) retries 75 (a refused storage
  endpoint), alerts at once on 2 (a bad flag) and 8 (a read-only run root, `RLPIPE_INJECT_STORAGE_FAULT`) and stays
  silent on 0 (a finished run); the documented CronJob fails at once exactly on the codes the job runner never
  restarts;
- `make replay` without FROM says what to pass in one line; a per-step target on an existing run reads its run.json
  when CONFIG is not given (and CONFIG given still wins).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from jobs import FinishedJob
from makefile import MAKEFILE, REPO

from pipeline.process.exits import LABELS, NEVER_RESTARTED, Exit
from pipeline.store.faults import FAULT_INJECTION_ENV
from pipeline.store.lease import Lease
from pipeline.store.storage import RunStore
from steps.rlpipe import COMMANDS, run_module

TEST_CONFIG = REPO / "configs/test_cats.yaml"
RLPIPE = Path(sys.executable).parent / "rlpipe"
GUIDE = REPO / "docs/guides/gcs-and-ray.md"


def rlpipe(*args: str, env: dict[str, str] | None = None, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    """`.venv/bin/rlpipe ARGS` (the installed console command), output captured."""
    return subprocess.run([str(RLPIPE), *args], cwd=cwd, env={**os.environ, **(env or {})}, capture_output=True,
                          text=True, timeout=300)  # fmt: skip


def error_lines(proc: subprocess.CompletedProcess[str]) -> list[str]:
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]


def bounded_batches_root(root: Path) -> None:
    """A run root with run.json (test_cats.yaml) made by a bounded BatchMaker that finds nothing to do (no JAX)."""
    proc = rlpipe("batches", "--config_path", str(TEST_CONFIG), "--run_root", str(root), "--max_batches", "1",
                  "--polling.bounded_wait_s", "0.2")  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]


# ---------------------------------------------------------------------------------------------- the command
def test_rlpipe_is_installed_and_every_make_program_target_runs_it() -> None:
    assert RLPIPE.is_file(), "make setup installs the console command (pyproject.toml [project.scripts])"
    proc = rlpipe("--help")
    assert proc.returncode == 0, proc.stderr
    listed = re.findall(r"^  (\w+) ", proc.stdout, re.M)
    assert listed == [*COMMANDS, "recipe"], proc.stdout
    recipes = re.findall(r"^([a-z-]+):.*\n\t(.+)$", MAKEFILE.read_text(), re.M)
    called = {target: m.group(1) for target, line in recipes if (m := re.search(r"\$\(VENV\)/bin/rlpipe (\w+)", line))}
    assert set(called) == {*COMMANDS, "recipe"}, called  # every program target, by the command of its name
    assert all(target == command for target, command in called.items()), called
    proc = rlpipe("nope")
    assert proc.returncode == Exit.CONFIG and error_lines(proc) == [
        f"error: invalid config: rlpipe 'nope': not a command; one of {', '.join([*COMMANDS, 'recipe'])}"
    ]


@pytest.mark.parametrize("code", [Exit.OK, *sorted(set(Exit) - {Exit.OK, Exit.FAILED, Exit.WATCHDOG, Exit.TERMINATED})])
def test_every_code_a_step_ends_with_comes_out_of_rlpipe_unchanged(
    code: Exit, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """The dispatcher runs the program in its own process as `python -m` does: the program's exit code is the
    command's (1 is Python's own for a traceback, 3 the watchdog's `os._exit`, 143 the SIGTERM handler's: none
    passes through the dispatcher's code; SIGTERM's is in tests/test_interrupts.py)."""
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    assert run_module("exit_probe", [str(int(code))]) == code
    err = capfd.readouterr().err.strip().splitlines()
    if code != Exit.OK:
        assert err and err[-1].startswith(f"error: {LABELS[code]}: "), err


# ---------------------------------------------------------------------------------------------- real programs
def _job(name: str, root: Path, *flags: str) -> list[str]:
    return [name, "--config_path", str(TEST_CONFIG), "--run_root", str(root), *flags]


UNREACHABLE = {"STORAGE_EMULATOR_HOST": "127.0.0.1:1", "RLPIPE_STORAGE_OPTIONS": '{"token": "anon"}',
               "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}  # fmt: skip
"""A gs:// endpoint that refuses connections (nothing listens on port 1): storage unavailable, 75."""


REAL_CASES = [
    ("bounded batches, nothing to do", Exit.OK, ""),
    ("negative max_rollouts", Exit.CONFIG, "error: invalid config: max_rollouts=-5: must be >= 1 or null"),
    ("run root is a file", Exit.CONFIG, "error: invalid config: store.run_root="),
    ("held BatchMaker lease", Exit.LEASE_HELD, "error: lease held: lease 'batchmaker'"),
    ("held gc lease", Exit.LEASE_HELD, "error: lease held: lease 'gc'"),
    ("damaged run.json", Exit.DAMAGED_INPUT, "error: damaged input: run.json"),
    ("read-only run root: batches", Exit.STORAGE_FAULT, "error: storage fault: "),
    ("read-only run root: report", Exit.STORAGE_FAULT, "error: storage fault: "),
    ("refused endpoint: batches", Exit.STORAGE_UNAVAILABLE, "error: storage unavailable: "),
    ("refused endpoint: report", Exit.STORAGE_UNAVAILABLE, "error: storage unavailable: "),
]
"""(condition, code, how its one line starts): the cheap real conditions (no JAX) of every code a real program
reaches before it imports JAX; 4 (a learner's wait) and the in-process codes are covered above through the same
dispatcher, 130 and 143 by tests/test_interrupts.py."""


@pytest.mark.parametrize(("case", "code", "starts"), REAL_CASES, ids=[c[0] for c in REAL_CASES])
def test_the_real_programs_exit_through_rlpipe_with_their_own_code(
    case: str, code: Exit, starts: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """The conditions of tests/test_exit_codes.py (where `python -m steps.<module>` and `python -m steps.run step
    <name>` give these codes and lines) through `rlpipe <command>`: the same code, the same one line."""
    root = tmp_path / "run"
    bounded = ("--max_batches", "1", "--polling.bounded_wait_s", "0.2")
    env: dict[str, str] = {}
    if case == "bounded batches, nothing to do":
        args = _job("batches", root, *bounded)
    elif case == "negative max_rollouts":
        args = _job("rollout", root, "--max_rollouts", "-5")
    elif case == "run root is a file":
        root.write_text("not a folder")
        args = _job("run", root)  # the job (test_exit_codes: also each step)
    elif case == "held BatchMaker lease":
        root = request.getfixturevalue("held_lease")
        args = _job("batches", root, "--max_batches", "1")
    elif case == "held gc lease":
        bounded_batches_root(root)
        lease = Lease(RunStore(str(root)), "gc", "gc-other", ttl_s=120.0)
        lease.acquire()
        request.addfinalizer(lease.release)
        args = ["gc", "--store.run_root", str(root)]
    elif case == "damaged run.json":
        bounded_batches_root(root)
        (root / "run.json").write_text('{"run_schema_version": 1, "conf')  # cut
        args = _job("batches", root, *bounded)
    elif case.startswith("read-only"):
        bounded_batches_root(root)
        env = {FAULT_INJECTION_ENV: "EROFS:"}
        args = _job("batches", root, "--max_batches", "1") if case.endswith("batches") else ["report", str(root)]
    else:
        env = UNREACHABLE
        args = ["report", "gs://bucket/run"] if case.endswith("report") else ["batches", "--run_root", "gs://b/r"]
    proc = rlpipe(*args, env=env)
    assert proc.returncode == code, proc.stderr[-3000:]
    lines = error_lines(proc)
    if code == Exit.OK:
        assert lines == [], lines
    else:
        assert len(lines) == 1 and lines[0].startswith(starts), proc.stderr[-3000:]


# ---------------------------------------------------------------------------------------------- from a scheduler
def documented_wrapper() -> str:
    """The `rlpipe-cron` script of the GCS guide's scheduled-jobs section."""
    blocks = re.findall(r"^```sh\n(#!/bin/sh\n# rlpipe-cron .*?)^```", GUIDE.read_text(), re.S | re.M)
    assert len(blocks) == 1, "docs/guides/gcs-and-ray.md has one `rlpipe-cron` block"
    return blocks[0]


def documented_cron_lines() -> list[str]:
    """The crontab lines of the guide (`m h dom mon dow command`)."""
    return re.findall(r"^(\S+ \* \* \* \* cd \S+ && \./rlpipe-cron .+)$", GUIDE.read_text(), re.M)


@pytest.fixture
def cron_wrapper(tmp_path: Path) -> Path:
    path = tmp_path / "rlpipe-cron"
    path.write_text(documented_wrapper())
    path.chmod(0o755)
    return path


def run_wrapper(
    wrapper: Path, tmp_path: Path, *command: str, env: dict[str, str] | None = None
) -> tuple[int, str, list[str]]:
    """(exit code, stderr, alert lines) of `rlpipe-cron COMMAND` with 3 tries, no pause between them, and an alert
    command that appends its line to a file."""
    alerts = tmp_path / "alerts.txt"
    alerts.unlink(missing_ok=True)
    alert = tmp_path / "alert.sh"
    alert.write_text(f'#!/bin/sh\necho "$*" >> {alerts}\n')
    alert.chmod(0o755)
    knobs = {"RLPIPE_TRIES": "3", "RLPIPE_RETRY_S": "0", "RLPIPE_ALERT": str(alert)}
    proc = subprocess.run([str(wrapper), *command], cwd=REPO, env={**os.environ, **knobs, **(env or {})},
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    return proc.returncode, proc.stderr, alerts.read_text().splitlines() if alerts.exists() else []


def test_the_cron_lines_call_rlpipe_commands_through_the_wrapper() -> None:
    lines = documented_cron_lines()
    assert len(lines) >= 3, lines
    for line in lines:
        words = line.split()
        assert words[words.index("./rlpipe-cron") + 1] == ".venv/bin/rlpipe", line
        assert words[words.index("./rlpipe-cron") + 2] in COMMANDS, line


def test_the_cron_wrapper_retries_75_and_alerts_on_2_and_8(cron_wrapper: Path, tmp_path: Path) -> None:
    # 75: the storage endpoint refuses connections (nothing listens on port 1), every try
    unreachable = {"STORAGE_EMULATOR_HOST": "127.0.0.1:1", "RLPIPE_STORAGE_OPTIONS": '{"token": "anon"}',
                   "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}  # fmt: skip
    rc, err, alerts = run_wrapper(cron_wrapper, tmp_path, str(RLPIPE), "report", "gs://bucket/run", env=unreachable)
    assert rc == Exit.STORAGE_UNAVAILABLE, err[-3000:]
    assert err.count("error: storage unavailable: ") == 3, err[-3000:]  # RLPIPE_TRIES=3: tried three times
    assert alerts == [f"rlpipe: exit 75 from: {RLPIPE} report gs://bucket/run"]

    # 2: a bad flag is never retried
    root = tmp_path / "run"
    rc, err, alerts = run_wrapper(cron_wrapper, tmp_path, str(RLPIPE), "rollout", "--config_path", str(TEST_CONFIG),
                                  "--run_root", str(root), "--max_rollouts", "-5")  # fmt: skip
    assert rc == Exit.CONFIG and err.count("error: invalid config: max_rollouts=-5") == 1, err[-3000:]
    assert len(alerts) == 1 and alerts[0].startswith("rlpipe: exit 2 from: "), alerts

    # 8: a read-only run root is never retried either
    bounded_batches_root(root)
    batches = [str(RLPIPE), "batches", "--run_root", str(root), "--max_batches", "1", "--polling.bounded_wait_s", "0.2"]
    rc, err, alerts = run_wrapper(cron_wrapper, tmp_path, *batches, env={FAULT_INJECTION_ENV: "EROFS:"})
    assert rc == Exit.STORAGE_FAULT and err.count("error: storage fault: ") == 1, err[-3000:]
    assert len(alerts) == 1 and alerts[0].startswith("rlpipe: exit 8 from: "), alerts


@pytest.mark.slow
def test_the_cron_wrapper_is_silent_on_a_finished_run(
    cron_wrapper: Path, default_job: FinishedJob, tmp_path: Path
) -> None:
    """The guide's learner line on a run whose learner finished: exit 0, no alert (and no JAX: test_early_exit)."""
    root = tmp_path / "run"
    shutil.copytree(default_job.root, root, ignore=shutil.ignore_patterns("leases", "logs"))
    rc, err, alerts = run_wrapper(cron_wrapper, tmp_path, str(RLPIPE), "learn", "--run_root", str(root),
                                  "--max_steps", "50")  # fmt: skip
    assert rc == 0 and "already trained 6 steps; nothing to do" in err, err[-3000:]
    assert alerts == []


def test_the_cronjob_fails_at_once_exactly_on_the_codes_never_restarted() -> None:
    (block,) = [b for b in re.findall(r"^```yaml\n(.*?)^```", GUIDE.read_text(), re.S | re.M) if "CronJob" in b]
    spec = yaml.safe_load(block)["spec"]["jobTemplate"]["spec"]
    (rule,) = spec["podFailurePolicy"]["rules"]
    assert rule["action"] == "FailJob" and rule["onExitCodes"]["operator"] == "In"
    assert sorted(rule["onExitCodes"]["values"]) == sorted(NEVER_RESTARTED)
    (container,) = spec["template"]["spec"]["containers"]
    assert container["command"][0] == ".venv/bin/rlpipe" and container["command"][1] in COMMANDS
    assert rule["onExitCodes"]["containerName"] == container["name"]


# ---------------------------------------------------------------------------------------------- make targets
def make(*args: str) -> subprocess.CompletedProcess[str]:
    """`make ARGS` as a user types it (the environment assumed set up: `-o setup` skips re-checking it)."""
    return subprocess.run(["make", "--no-print-directory", "-o", "setup", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300)  # fmt: skip


def test_make_replay_without_from_says_what_to_pass(tmp_path: Path) -> None:
    proc = make("replay", f"RUN={tmp_path}")
    assert proc.returncode == 2, proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert "FROM is not set: make replay" in line and "FROM=<checkpoint step>" in line and "[TO=<last slot>]" in line


def test_a_per_step_target_on_an_existing_run_reads_its_run_json(tmp_path: Path) -> None:
    """`make batches RUN=…` without CONFIG on a run made with configs/test_cats.yaml runs that run's job (the
    default CONFIG, configs/demo_cats.yaml, differs from it in train and curriculum: it would be refused); a CONFIG
    given is still the config, checked against run.json."""
    root = tmp_path / "run"
    bounded_batches_root(root)
    args = "ARGS=--max_batches 1 --polling.bounded_wait_s 0.2"
    proc = make("batches", f"RUN={root}", args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"job config: {root}/run.json (no --config_path given)" in proc.stderr
    assert "BatchMaker done: 0 batches written by this process" in proc.stderr
    proc = make("batches", f"RUN={root}", "CONFIG=configs/demo_cats.yaml", args)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "error: invalid config: " in proc.stderr and "differs from run.json" in proc.stderr
