"""What `python -m steps.run` settles before anything starts: a lesson none of whose prompts fits is refused at job
start; a command-line value YAML cannot read (`--inference.command "{python} -m …"`) is the string it says; and a
step started with step-level overrides records them in run.json instead of refusing its own overrides."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from jobs import ROOT, TEST_CONFIG

from pipeline.config import ConfigError, RLJobConfig
from pipeline.config.model import ServerInferenceConfig
from pipeline.process.exits import Exit
from pipeline.store import layout
from steps.cli import parse_config

SERVER_COMMAND = "{python} -m policy.inference.adapters.levanter_server --run_root {run_root} --port {port}"


def steps_run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "steps.run", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def error_lines(proc: subprocess.CompletedProcess[str]) -> list[str]:
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]


def test_a_lesson_none_of_whose_prompts_fits_is_refused_at_job_start(tmp_path: Path) -> None:
    """Refused before anything starts; the built-in tokenizer's check imports no transformers (`BuiltinTokenizer`),
    and a chat lesson's prompts, which need the chat template, are checked too."""
    root = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "steps.run", "--config_path", str(TEST_CONFIG),
                           "--run_root", str(root), "--inference.max_seq_len", "2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == Exit.CONFIG, proc.stderr[-3000:]
    (line,) = error_lines(proc)
    assert line.startswith("error: invalid config: inference.max_seq_len=2: no prompt of lesson 'cats' fits: "), line
    assert not root.exists()  # nothing started, nothing created
    imported = set(re.findall(r"^import time: .*\| +([\w.]+)$", proc.stderr, re.M))
    assert "tokenizers" in imported and "transformers" not in imported

    from pipeline.jobs.job import RLJob
    from steps.run import check_prompts, parse_job

    chat = ["--config_path", str(TEST_CONFIG), "--curriculum.lessons.cats.chat", "true"]
    check_prompts(RLJob(parse_job(chat)))
    with pytest.raises(ConfigError, match=r"inference\.max_seq_len=12: no prompt of lesson 'cats' fits: .* 1[4-9]\.\."):
        check_prompts(RLJob(parse_job([*chat, "--inference.max_seq_len", "12"])))  # plain prompts fit 12
    check_prompts(RLJob(parse_job(["--config_path", str(TEST_CONFIG), "--inference.max_seq_len", "12"])))


def test_a_server_command_with_placeholders_is_a_plain_string_on_the_command_line(tmp_path: Path) -> None:
    server = ["--inference.type", "server", "--inference.adapter", "levanter", "--inference.command"]
    cfg = parse_config(RLJobConfig, ["--config_path", str(TEST_CONFIG), *server, SERVER_COMMAND])
    assert isinstance(cfg.inference, ServerInferenceConfig) and cfg.inference.command == SERVER_COMMAND
    cfg = parse_config(RLJobConfig, ["--config_path", str(TEST_CONFIG), *server[:-1], "--inference.command={python}"])
    assert isinstance(cfg.inference, ServerInferenceConfig) and cfg.inference.command == "{python}"
    # through the real program: the command is taken; the one error is the bad bound given after it
    proc = steps_run("step", "rollout", "--config_path", str(TEST_CONFIG), "--run_root", str(tmp_path / "run"),
                     *server, SERVER_COMMAND, "--max_rollouts", "-5")  # fmt: skip
    assert proc.returncode == Exit.CONFIG, proc.stderr[-3000:]
    (line,) = error_lines(proc)
    assert "max_rollouts" in line and "-5" in line, line
    # a value YAML cannot read given to a number field: one line naming the field, exit 2
    proc = steps_run("--config_path", str(TEST_CONFIG), "--run_root", str(tmp_path / "run2"), "--train.max_lag", "{x")
    assert proc.returncode == Exit.CONFIG, proc.stderr[-3000:]
    (line,) = error_lines(proc)
    assert "max_lag" in line, line


def test_a_step_records_its_own_overrides_in_run_json(tmp_path: Path) -> None:
    root = tmp_path / "run"
    bounded = ["--max_batches", "1", "--follow", "false", "--polling.bounded_wait_s", "0.5"]
    step = ["step", "batches", "--config_path", str(TEST_CONFIG), "--run_root", str(root)]
    proc = steps_run(*step, "--train.num_train_steps", "3", *bounded)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not error_lines(proc)
    recorded = json.loads((root / layout.RUN_CONFIG).read_text())["config"]
    assert recorded["train"]["num_train_steps"] == 3
    proc = steps_run(*step, "--train.num_train_steps", "3", *bounded)  # the same contract: accepted
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = steps_run(*step, "--train.num_train_steps", "4", *bounded)  # a different one: refused, naming the field
    assert proc.returncode == Exit.CONFIG, proc.stderr[-3000:]
    (line,) = error_lines(proc)
    assert "train.num_train_steps" in line and "run.json" in line, line
