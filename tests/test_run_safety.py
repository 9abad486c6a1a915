"""What keeps a user from harming or misreading a run: refusals, storage options, replay.

- a job-level field that differs from run.json is refused by `steps.run step NAME` and by a step started
  directly, unless `--allow_config_change true` (then recorded in run.json's history);
- read-only commands (report, evaluate, export, replay) on a typo'd run root: one line naming the path, exit 2,
  nothing created (local and gs://);
- storage options from `--store.storage_options` and `$RLPIPE_STORAGE_OPTIONS` (report on the emulator); an
  unreachable endpoint fails at once, naming it; `make gcs-emulator`'s program serves and prints its env lines;
- `make demo` refuses an existing run root unless FRESH=1; a run (`steps.run`, `step learn`) refuses a non-empty
  folder that is not a run root; exact-answer data that cannot be read is refused before anything starts;
- `steps.replay` of a finished job's last slots from its checkpoint is bitwise equal to the committed policy
  and writes nothing into the run root; curriculum state files end with a newline.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from pathlib import Path

import draccus
import pytest
from gcs_emulator import GcsEmulator
from jobs import FinishedJob

from pipeline.config import RLJobConfig
from pipeline.jobs.job import RLJob
from pipeline.process.exits import LABELS, Exit
from pipeline.run_contract import run_record
from pipeline.store import layout
from pipeline.store.storage import RunStore

ROOT = Path(__file__).resolve().parents[1]
TEST_CONFIG = ROOT / "configs/test_cats.yaml"


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """`python ARGS` in the repository root, output captured."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=full_env
    )


def error_lines(proc: subprocess.CompletedProcess[str]) -> list[str]:
    """The stderr lines that are not log records (a refusal must be exactly one)."""
    return [ln for ln in proc.stderr.splitlines() if ln.strip() and " INFO " not in ln and " WARNING " not in ln]


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """{relative path: (size, mtime_ns)} of every file under `root`."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


# ---------------------------------------------------------------------------------------------
# without a job
# ---------------------------------------------------------------------------------------------


READ_ONLY_COMMANDS = {
    "report": lambda r: ["-m", "pipeline.report", r],
    "evaluate": lambda r: ["-m", "steps.run", "step", "evaluate", "--config_path", str(TEST_CONFIG), "--run_root", r],
    "evaluate (direct)": lambda r: ["-m", "steps.evaluate", "--store.run_root", r],
    "export": lambda r: ["-m", "steps.export", "--store.run_root", r, "--out", r + "-hf"],
    "replay": lambda r: ["-m", "steps.replay", "--store.run_root", r, "--from_step", "2"],
}


@pytest.mark.parametrize("command", sorted(READ_ONLY_COMMANDS))
def test_read_only_command_refuses_a_typod_run_root(tmp_path: Path, command: str) -> None:
    # a path that does not exist for some commands, an existing folder without run.json for the others
    missing = command in ("report", "evaluate (direct)", "replay")
    run_root = tmp_path / "nonexistent" / "run" if missing else tmp_path / "empty"
    if not missing:
        run_root.mkdir()
    proc = cli(*READ_ONLY_COMMANDS[command](str(run_root)))
    assert proc.returncode == Exit.CONFIG, proc.stderr
    (line,) = error_lines(proc)
    assert line.startswith(f"error: {LABELS[Exit.CONFIG]}: "), line  # the one error shape, the report's too
    assert str(run_root) in line and "run.json" in line
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "nonexistent").exists()
    assert missing or list(run_root.iterdir()) == []
    assert not Path(f"{run_root}-hf").exists()


def test_report_takes_storage_options_from_flag_and_env(tmp_path: Path, gcs_endpoint: GcsEmulator) -> None:
    emu = gcs_endpoint
    url = f"gs://{emu.bucket}/report-{uuid.uuid4().hex[:8]}"
    cfg = draccus.parse(RLJobConfig, config_path=str(TEST_CONFIG), args=[])
    RunStore(url, emu.storage_options).put_unique(layout.RUN_CONFIG, json.dumps(run_record(cfg)).encode())
    flag = json.dumps(emu.storage_options)
    by_flag = cli("-m", "pipeline.report", url, "--out", str(tmp_path / "a"), "--store.storage_options", flag)
    assert by_flag.returncode == 0, by_flag.stderr
    assert (tmp_path / "a" / "index.html").exists()
    by_env = cli("-m", "pipeline.report", url, "--out", str(tmp_path / "b"), env={"RLPIPE_STORAGE_OPTIONS": flag})
    assert by_env.returncode == 0, by_env.stderr
    assert (tmp_path / "b" / "index.html").exists()
    # a typo'd gs:// run root is refused like a local one, and nothing is created there
    missing = f"gs://{emu.bucket}/no-such-run"
    proc = cli("-m", "pipeline.report", missing, "--store.storage_options", flag)
    assert proc.returncode == Exit.CONFIG and missing in error_lines(proc)[0]
    assert RunStore(missing, emu.storage_options).list("") == []


@pytest.mark.parametrize(
    ("command", "settings", "named", "code"),
    [
        # a host name that does not exist: a configuration error (2, never restarted by the job runner)
        (
            "pipeline.report",
            {"flag": {"endpoint_url": "http://nonexistent.invalid:1"}},
            "'nonexistent.invalid'",
            Exit.CONFIG,
        ),
        (
            "steps.make_batches",
            {"flag": {"endpoint_url": "http://nonexistent.invalid:1"}},
            "nonexistent.invalid",
            Exit.CONFIG,
        ),
        # nothing listening: storage unavailable (75, restarted with backoff by the job runner)
        (
            "steps.make_batches",
            {"env": {"STORAGE_EMULATOR_HOST": "127.0.0.1:1"}},
            "STORAGE_EMULATOR_HOST",
            Exit.STORAGE_UNAVAILABLE,
        ),
        (
            "pipeline.report",
            {"env": {"STORAGE_EMULATOR_HOST": "127.0.0.1:1"}},
            "STORAGE_EMULATOR_HOST",
            Exit.STORAGE_UNAVAILABLE,
        ),
    ],
)
def test_unreachable_endpoint_fails_fast_naming_it(command: str, settings: dict, named: str, code: int) -> None:
    flag = ["--store.storage_options", json.dumps(settings["flag"])] if "flag" in settings else []
    env = {"RLPIPE_STORAGE_OPTIONS": '{"token": "anon"}', **settings.get("env", {})}
    args = [command, "gs://bucket/run"] if command == "pipeline.report" else [command, "--store.run_root", "gs://b/r"]
    t0 = time.monotonic()
    proc = cli("-m", *args, *flag, env=env, timeout=120)
    waited = time.monotonic() - t0
    assert proc.returncode == code, proc.stderr
    (line,) = error_lines(proc)
    assert named in line and ("does not resolve" if code == Exit.CONFIG else "connection refused") in line, line
    # gcsfs's retries of a transient error would take minutes; this bound only shows none happened
    assert waited < 60, f"took {waited:.0f}s"


def test_gcs_emulator_program_serves_and_prints_its_env(monkeypatch: pytest.MonkeyPatch) -> None:
    proc = subprocess.Popen(  # --port 0: a port it picks (retried when taken), printed
        [sys.executable, "tests/gcs_emulator.py", "--port", "0", "--bucket", "mine"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline().strip() for _ in range(5)]
        exports = dict(ln.removeprefix("export ").split("=", 1) for ln in lines if ln.startswith("export "))
        assert re.fullmatch(r"http://127\.0\.0\.1:[1-9]\d*", exports["STORAGE_EMULATOR_HOST"]), exports
        for name, value in exports.items():
            monkeypatch.setenv(name, value.strip("'"))
        store = RunStore("gs://mine/run1")  # endpoint and token from the environment alone
        store.put_unique("hello.txt", b"hi")
        assert store.list("") == ["hello.txt"] and store.get("hello.txt") == b"hi"
    finally:
        proc.terminate()
        assert proc.wait(timeout=20) == 0


def test_demo_refuses_an_existing_run_root_unless_fresh(tmp_path: Path) -> None:
    from steps.demo import prepare_run_root

    run_root = tmp_path / "demo"
    run_root.mkdir()
    (run_root / "run.json").write_text("{}")
    proc = cli("-m", "steps.demo", "--config_path", str(TEST_CONFIG), "--run_root", str(run_root))
    assert proc.returncode == Exit.CONFIG, proc.stderr
    (line,) = error_lines(proc)
    assert str(run_root) in line and "FRESH=1" in line
    assert (run_root / "run.json").exists()
    prepare_run_root(str(run_root), keep=True, fresh=False)
    assert (run_root / "run.json").exists()
    prepare_run_root(str(run_root), keep=False, fresh=True)
    assert not run_root.exists()
    prepare_run_root(str(run_root), keep=False, fresh=False)  # absent: nothing to refuse


def exact_answer_config(tmp_path: Path, data: str) -> Path:
    """configs/test_cats.yaml with its one lesson replaced by an exact-answer lesson `qa` reading `data`."""
    import yaml

    cfg = yaml.safe_load(TEST_CONFIG.read_text())
    env = {"env_class": "pipeline.environments.exact_answer.ExactAnswerEnv", "env_args": {"path": data}}
    cfg["curriculum"]["lessons"] = {"qa": {"lesson_id": "qa", "env": env}}
    path = tmp_path / "qa.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


BAD_DATA = {
    "missing": ("missing.jsonl", None, "no such file"),
    "folder": ("data", "folder", "is a folder"),
    "csv": ("data.csv", "prompt,answer\n2+2,4\n", "unsupported format (.csv)"),
    "bad json": ("bad.jsonl", '{"prompt": "2+2", "answer": "4"}\n{not json\n', "line 2: invalid JSON"),
    "no answer column": ("q.jsonl", '{"prompt": "2+2", "reply": "4"}\n', "['answer']"),
}


@pytest.mark.parametrize(
    ("case", "command"), [(case, "job") for case in sorted(BAD_DATA)] + [("missing", "step rollout")]
)
def test_unreadable_exact_answer_data_is_refused_before_anything_starts(
    tmp_path: Path, case: str, command: str
) -> None:
    name, content, why = BAD_DATA[case]
    data = tmp_path / name
    if content == "folder":
        data.mkdir()
        (data / "train.jsonl").write_text('{"prompt": "2+2", "answer": "4"}\n')
    elif content is not None:
        data.write_text(content)
    run_root = tmp_path / "run"
    step = ["step", "rollout"] if command == "step rollout" else []
    t0 = time.monotonic()
    args = ["--config_path", str(exact_answer_config(tmp_path, str(data))), "--run_root", str(run_root)]
    proc = cli("-m", "steps.run", *step, *args, timeout=60)
    assert proc.returncode == Exit.CONFIG, proc.stderr
    assert time.monotonic() - t0 < 20
    (line,) = error_lines(proc)
    assert "curriculum.lessons.qa.env.env_args.path=" in line and str(data) in line and why in line, line
    assert not run_root.exists()  # nothing started: no run.json, no logs/


def test_a_run_refuses_a_non_empty_folder_that_is_not_a_run_root(tmp_path: Path) -> None:
    from steps.run import refuse_foreign_folder

    mine = tmp_path / "my-files"
    mine.mkdir()
    (mine / "thesis.tex").write_text("keep me")
    before = snapshot(mine)
    for step in ([], ["step", "learn"]):
        proc = cli("-m", "steps.run", *step, "--config_path", str(TEST_CONFIG), "--run_root", str(mine), timeout=60)
        assert proc.returncode == Exit.CONFIG, proc.stderr
        (line,) = error_lines(proc)
        assert str(mine) in line and "not a run root" in line and "thesis.tex" in line, line
        assert snapshot(mine) == before and sorted(os.listdir(mine)) == ["thesis.tex"]
    # accepted: absent, empty, only hidden entries, a run root, or a folder only rlpipe made
    for entries in ([], [".DS_Store"], ["run.json", "thesis.tex"], ["logs", "policies"]):
        root = tmp_path / f"ok-{len(entries)}-{uuid.uuid4().hex[:6]}"
        root.mkdir()
        for e in entries:
            (root / e).write_text("x")
        refuse_foreign_folder(RunStore(str(root)))
    refuse_foreign_folder(RunStore(str(tmp_path / "absent")))


# ---------------------------------------------------------------------------------------------
# one finished job (6 learner steps, checkpoints every 2, keep 2: checkpoints 4 and 6)
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def finished_run(default_job: FinishedJob) -> Path:
    """The run root of the session's test job (shared with other files: read only, copy it to change it)."""
    return default_job.root


def learner_yaml(run_root: Path, path: Path) -> Path:
    """The learner step's config file as the job runner writes it for this run root."""
    cfg = draccus.parse(RLJobConfig, config_path=str(TEST_CONFIG), args=["--store.run_root", str(run_root)])
    path.write_text(draccus.dump(RLJob(cfg).to_worker_configs()["learner"]) or "")
    return path


@pytest.mark.slow
def test_replay_of_the_last_slots_is_bitwise_equal(finished_run: Path, tmp_path: Path) -> None:
    before = snapshot(finished_run)
    scratch = tmp_path / "scratch"
    proc = cli(
        "-m", "steps.replay", "--store.run_root", str(finished_run), "--from_step", "4", "--to_step", "6",
        "--scratch", str(scratch),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "bitwise equal" in proc.stdout
    assert (scratch / layout.policy_marker(6)).exists()
    assert snapshot(finished_run) == before  # nothing written into the run root
    # the comparison reports differing tensors by name (policy 5 is not policy 6)
    from pipeline.environments.tokenizer import load_tokenizer
    from policy import model as M
    from policy import policy_format as pf
    from policy.replay import compare, recorded_learner_config

    store = RunStore(str(finished_run))
    spec = recorded_learner_config(store).model
    p5 = pf.read_policy(store, 5, spec, M.model_vocab_size(load_tokenizer(spec.tokenizer)))
    p6 = pf.read_policy(store, 6, spec, int(p5.Vocab.size))
    diffs = compare(p6, p5)
    assert diffs and all(v > 0 for v in diffs.values())
    assert compare(p6, p6) == {}


@pytest.mark.slow
def test_drifted_job_field_is_refused_unless_allowed(finished_run: Path, tmp_path: Path) -> None:
    # on a copy of the finished run (the shared one stays as the job left it for the other tests)
    copy = tmp_path / "copy"
    shutil.copytree(finished_run, copy)
    run_json = (copy / "run.json").read_bytes()
    via_run = cli(
        "-m", "steps.run", "step", "learn", "--config_path", str(TEST_CONFIG), "--run_root", str(copy),
        "--optimizer.learning_rate", "0.5", "--max_steps", "1",
    )  # fmt: skip
    direct_yaml = learner_yaml(copy, tmp_path / "learner.yaml")
    direct = cli("-m", "steps.learn", "--config_path", str(direct_yaml), "--optimizer.learning_rate", "0.5")
    for proc in (via_run, direct):
        assert proc.returncode == Exit.CONFIG, proc.stderr[-4000:]
        (line,) = error_lines(proc)
        assert "optimizer.learning_rate=0.5" in line and "0.003" in line and "--allow_config_change" in line
    assert (copy / "run.json").read_bytes() == run_json
    # allowed: the learner starts (nothing left to train) and run.json records the change
    allowed = cli(
        "-m", "steps.learn", "--config_path", str(learner_yaml(copy, tmp_path / "copy.yaml")),
        "--optimizer.learning_rate", "0.5", "--allow_config_change", "true",
    )  # fmt: skip
    assert allowed.returncode == 0, allowed.stderr[-4000:]
    record = json.loads((copy / "run.json").read_text())
    (entry,) = record["history"]
    assert entry["by"] == "steps.learn"
    assert entry["changes"] == [{"field": "optimizer.learning_rate", "from": 0.003, "to": 0.5}]
    assert record["config"]["optimizer"]["learning_rate"] == 0.5


@pytest.mark.slow
def test_curriculum_state_files_end_with_a_newline(finished_run: Path) -> None:
    states = sorted((finished_run / layout.CURRICULUM).glob("state-*.json"))
    assert states
    for path in states:
        text = path.read_text()
        assert text.endswith("}\n") and text.count("\n") > 3, path
