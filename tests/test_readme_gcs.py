"""The docs' "Running on GCS" guide (docs/guides/gcs-and-ray.md) and trackers commands (the trackers paragraph of
docs/reference/metrics.md), run as written against the GCS emulator, each checked by its effect. The commands are
parsed from the docs themselves, so the documentation and this test cannot drift:

- `make gcs-emulator` (its Makefile recipe) starts the emulator; the `export` lines it prints are the guide's;
- the guide's emulator block (`export …` lines, then `make run RUN=gs://rlpipe/run1 && make report …`) with the
  trackers section's `ARGS="--tracker.type tensorboard"`, on a short job: every step's log is under the gs:// run
  root (read back with the guide's `python -c "import fsspec…" URL` line), the report has every plot the docs
  name, and the tracker's event file holds the learner's loss, the batches' reward and staleness, the rollout
  throughput and the final policy's evaluation;
- the guide's scheduled-jobs block (`python -m steps.run step learn|batches|rollout|evaluate …`) on a second
  gs:// run root: the bounded steps, run side by side, make a complete short run and stop on their own.

One job per run root (module-scoped fixtures). The Makefile recipes run as `tests/makefile.py` gives them (make
itself would re-sync the environment first); `make run` and `make report` run in a scratch folder with the
checkout on PYTHONPATH, so that the relative paths they write (`./trackers`, `runs/run1-report`) land there and
not in the checkout. Local run roots: `test_readme_commands`, `test_job_progress`, `test_job_e2e`.
"""

from __future__ import annotations

import glob
import re
import shlex
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from jobs import check_finished_run, job_config
from makefile import REPO, make_env, recipe_command
from test_job_e2e import check_step_logs
from test_readme_commands import _Page, docs_text, readme_report_plots

from pipeline.store import layout
from pipeline.store.storage import RunStore

pytestmark = pytest.mark.slow

NUM_STEPS = 2
SCHEDULED_STEPS = 1
"""Learner steps of the scheduled-jobs run: one step is a complete run, and each step more is a round more of the
block's four lines (a round moves the run on by at least one learner step): round 1 publishes policy 0 and fills
slot 1, round 2 trains it (the learner finishes), round 3 starts with the learner finished and stops every line."""
STEP_TIMEOUT_S = 600
MAX_ROUNDS = 6
README = docs_text()  # README.md and every page under docs/
GCS_GUIDE = REPO / "docs" / "guides" / "gcs-and-ray.md"


def readme_section(title: str) -> str:
    """The GCS guide, which opens with the `# title` heading (its `##` subsections included)."""
    guide = GCS_GUIDE.read_text()
    assert guide.startswith(f"# {title}\n"), f"{GCS_GUIDE} does not open with '# {title}'"
    return guide


GCS = readme_section("Running on GCS, as scheduled jobs, and on a Ray cluster")
BASH_BLOCKS = [textwrap.dedent(b) for b in re.findall(r"^[ \t]*```bash\n(.*?)^[ \t]*```", GCS, re.S | re.M)]


def emulator_block() -> tuple[dict[str, str], list[list[str]]]:
    """The README's emulator block: ({NAME: value} of its `export` lines, the make commands of its last line)."""
    (block,) = [b for b in BASH_BLOCKS if "export STORAGE_EMULATOR_HOST" in b]
    exports: dict[str, str] = {}
    commands: list[list[str]] = []
    for line in block.splitlines():
        words = shlex.split(line, comments=True)
        if words[:1] == ["export"]:
            name, _, value = words[1].partition("=")
            exports[name] = value
        elif words[:1] == ["make"]:
            command: list[str] = []
            for w in [*words, "&&"]:
                if w == "&&":
                    commands.append(command)
                    command = []
                else:
                    command.append(w)
    assert set(exports) >= {"STORAGE_EMULATOR_HOST", "RLPIPE_STORAGE_OPTIONS"} and len(commands) == 2, block
    return exports, commands


def make_variables(words: list[str], target: str) -> dict[str, str]:
    """`make TARGET VAR=value …` as {VAR: value}, checking the target."""
    assert words[:2] == ["make", target], words
    return dict(w.split("=", 1) for w in words[2:])


def scheduled_block() -> list[list[str]]:
    """The docs' scheduled-jobs block as argv lists in its order, its shell variables (`CFG`, `ROOT`, `N`) left in."""
    (block,) = [b for b in BASH_BLOCKS if "steps.run step learn" in b]
    commands = [shlex.split(line, comments=True) for line in block.splitlines()]
    steps = [c for c in commands if c[:4] == ["python", "-m", "steps.run", "step"]]
    assert [c[4] for c in steps] == ["learn", "rollout", "batches", "evaluate"], steps
    return steps


def readme_command(pattern: str) -> list[str]:
    """The docs' inline command (in backticks) that matches `pattern`, as words."""
    m = re.search(rf"`({pattern})`", README)
    assert m, f"the docs show no command matching {pattern!r}"
    return shlex.split(m.group(1))


# ---------------------------------------------------------------------------------------------
# the emulator, started by `make gcs-emulator`
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def monkeypatch_module() -> Iterator[pytest.MonkeyPatch]:
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@dataclass
class Emulator:
    env: dict[str, str]
    """The process environment with the emulator's printed `export` lines applied."""
    printed: dict[str, str]
    bucket: str


@pytest.fixture(scope="module")
def emulator(monkeypatch_module: pytest.MonkeyPatch) -> Iterator[Emulator]:
    monkeypatch_module.setenv("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")  # this process's own RunStores
    # GCS_PORT=0: the emulator picks a port (retried when taken) and prints it in its export lines
    proc = subprocess.Popen(recipe_command("gcs-emulator", GCS_PORT="0"), cwd=REPO, env=make_env(),
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline().strip() for _ in range(5)]
        printed = {}
        for line in lines:
            if line.startswith("export "):
                name, _, value = shlex.split(line)[1].partition("=")
                printed[name] = value
        bucket = re.search(r"gs://([\w-]+)/", lines[-1])
        assert bucket and printed, lines
        yield Emulator({**make_env(), **printed, "PYTHONPATH": str(REPO)}, printed, bucket.group(1))
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_the_emulator_prints_the_readme_export_lines(emulator: Emulator) -> None:
    exports, commands = emulator_block()
    assert set(emulator.printed) == set(exports)
    for name, value in exports.items():
        expected = value.replace(":4443", f":{emulator.env['STORAGE_EMULATOR_HOST'].rsplit(':', 1)[1]}")
        assert emulator.printed[name] == expected, name
    assert make_variables(commands[0], "run")["RUN"].startswith(f"gs://{emulator.bucket}/")


def store_of(emulator: Emulator, url: str) -> RunStore:
    """A RunStore of `url` on the emulator the README's exports point at."""
    return RunStore(url, {"endpoint_url": emulator.printed["STORAGE_EMULATOR_HOST"], "token": "anon"})


# ---------------------------------------------------------------------------------------------
# the emulator block: make run (with a tracker) && make report
# ---------------------------------------------------------------------------------------------


@dataclass
class MadeRun:
    url: str
    store: RunStore
    cwd: Path
    output: str
    report_dir: Path


@pytest.fixture(scope="module")
def made_run(emulator: Emulator, tmp_path_factory: pytest.TempPathFactory) -> MadeRun:
    tmp = tmp_path_factory.mktemp("readme-gcs-run")
    _, (run_words, report_words) = emulator_block()
    run_vars, report_vars = make_variables(run_words, "run"), make_variables(report_words, "report")
    url = run_vars["RUN"]
    assert report_vars["RUN"] == url
    tracker_args = make_variables(readme_command(r'make run ARGS="--tracker\.type [a-z]+"'), "run")["ARGS"]
    # kl_coef > 0: the learner logs KL, so every learner plot the README names is drawn
    config = job_config(tmp, url, **{"train.num_train_steps": str(NUM_STEPS), "loss.kl_coef": "0.01"})
    proc = subprocess.run(recipe_command("run", CONFIG=str(config), **{**run_vars, "ARGS": tracker_args}), cwd=tmp,
                          env=emulator.env, capture_output=True, text=True, timeout=STEP_TIMEOUT_S)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = subprocess.run(recipe_command("report", **report_vars), cwd=tmp, env=emulator.env,
                            capture_output=True, text=True, timeout=STEP_TIMEOUT_S)  # fmt: skip
    assert report.returncode == 0, report.stderr[-3000:]
    out = shlex.split(report_vars["ARGS"])
    report_dir = tmp / out[out.index("--out") + 1]
    assert report.stdout.strip().splitlines()[-1] == str(report_dir / "index.html")
    return MadeRun(url, store_of(emulator, url), tmp, proc.stderr, report_dir)


def test_make_run_on_gcs_completes_and_logs_every_step_under_the_run_root(
    made_run: MadeRun, emulator: Emulator
) -> None:
    check_finished_run(made_run.store, num_steps=NUM_STEPS, max_lag=1)
    check_step_logs(made_run.store, made_run.output, NUM_STEPS)
    # read back with the README's one-liner (the learner's newest log)
    (learner_log,) = made_run.store.list(f"{layout.LOGS}/learner")
    url = f"{made_run.url}/{learner_log}"
    words = readme_command(r'python -c "import fsspec[^"]*" URL')
    argv = [sys.executable if w == "python" else url if w == "URL" else w for w in words]
    proc = subprocess.run(argv, env=emulator.env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"trained slot {NUM_STEPS} " in proc.stdout
    assert not (made_run.cwd / "run").exists()  # nothing local but the tracker files and the report


def test_make_report_of_a_gcs_run_has_every_plot_the_readme_names(made_run: MadeRun) -> None:
    page = _Page()
    page.feed((made_run.report_dir / "index.html").read_text())
    drawn = [alt for alts in page.images.values() for alt in alts]
    missing = [name for name in readme_report_plots() if name not in drawn]
    assert not missing, f"plots the README names but the report of the gs:// run lacks: {missing}"
    assert (made_run.report_dir / "plots" / "reward.png").exists()


def test_the_tracker_holds_reward_staleness_loss_and_the_final_evaluation(made_run: MadeRun) -> None:
    """`--tracker.type tensorboard` on a gs:// run root: one event file under ./trackers/<run name>/."""
    from test_trackers import tfevents_scalars

    name = made_run.url.rstrip("/").rsplit("/", 1)[-1]
    files = glob.glob(str(made_run.cwd / "trackers" / name / "events.out.tfevents.*"))
    assert len(files) == 1, files
    scalars = tfevents_scalars(files[0])
    assert sorted(scalars["learner/loss"]) == list(range(1, NUM_STEPS + 1))
    for key in ("batches/mean_reward", "batches/staleness_mean", "rollout/rows_per_s", "eval/cats/mean_reward"):
        assert scalars.get(key), (key, sorted(scalars))
    assert float(NUM_STEPS) in scalars["eval/cats/policy_step"].values()  # the final policy's, after the learner


# ---------------------------------------------------------------------------------------------
# the scheduled-jobs block on a second run root
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def scheduled_run(emulator: Emulator, tmp_path_factory: pytest.TempPathFactory) -> tuple[RunStore, list[str]]:
    """The docs' scheduled-jobs block run as a scheduler would: its lines one after another, in their order, round
    after round, with CFG = a short job (its `polling.bounded_wait_s` short, as a job config may set it), ROOT = a
    gs:// root, N = 1, until a round starts with the learner finished. Returns the store and each line's last
    stderr line."""
    tmp = tmp_path_factory.mktemp("readme-gcs-scheduled")
    url = f"gs://{emulator.bucket}/runs/scheduled"
    config = job_config(tmp, url, **{"train.num_train_steps": str(SCHEDULED_STEPS), "polling.bounded_wait_s": "2"})
    values = {"$CFG": str(config), "$ROOT": url, "$N": "1"}
    store = store_of(emulator, url)

    def argv(words: list[str]) -> list[str]:
        out = [sys.executable if w == "python" else w for w in words]
        for var, value in values.items():
            out = [w.replace(var, value) for w in out]
        return out

    last_lines = []
    for _ in range(MAX_ROUNDS):
        finished = store.exists(layout.policy_marker(SCHEDULED_STEPS))
        for words in scheduled_block():
            proc = subprocess.run(argv(words), cwd=REPO, env=emulator.env, capture_output=True, text=True,
                                  timeout=STEP_TIMEOUT_S)  # fmt: skip
            assert proc.returncode == 0, (words[4], proc.stderr[-3000:])
            assert "Traceback" not in proc.stderr, (words[4], proc.stderr[-3000:])
            last_lines.append(f"{words[4]}: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else ''}")
        if finished:  # this round started with the learner finished: every line ended on its own
            return store, last_lines
    raise AssertionError(f"the run did not finish in {MAX_ROUNDS} rounds: {last_lines}")


def test_the_scheduled_steps_make_a_complete_run_and_stop_on_their_own(
    scheduled_run: tuple[RunStore, list[str]],
) -> None:
    store, last_lines = scheduled_run
    print(f"{len(last_lines) // 4} rounds: {last_lines}")
    check_finished_run(store, num_steps=SCHEDULED_STEPS, max_lag=1)
    files = [r for d in store.list(layout.ROLLOUTS) for r in store.list_committed(d)]
    assert files and all("/job1." in f for f in files), files  # --worker_id job$N with N=1
    # evaluate --all true: every committed policy
    assert all(store.exists(layout.eval_summary_file(s, "cats")) for s in range(SCHEDULED_STEPS + 1))
