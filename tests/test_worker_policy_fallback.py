"""A rollout worker whose newest policy is damaged falls back to the newest older intact one (the documented
recovery, as the learner's checkpoint fallback): each damaged policy is quarantined with its reason and named in one
warning line, and the worker samples with the older policy instead of exiting 7. With no intact policy left it
still ends in one `damaged input` line, exit 7. Run through the real `python -m steps.rollout`."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import draccus
import pyarrow.parquet as pq
from jobs import ROOT, TEST_CONFIG

from pipeline.config import RLJobConfig
from pipeline.environments.tokenizer import load_tokenizer
from pipeline.jobs.job import RLJob
from pipeline.process.exits import LABELS, Exit
from pipeline.store import layout
from pipeline.store.storage import RunStore
from policy.model import build_model, model_vocab_size
from policy.policy_format import write_policy


def rollout_config(root: Path, tmp: Path) -> tuple[Path, RLJobConfig]:
    """The job's rollout step config on `root` (configs/test_cats.yaml) as a YAML file."""
    cfg = draccus.parse(RLJobConfig, config_path=str(TEST_CONFIG), args=[])
    cfg = dataclasses.replace(cfg, store=dataclasses.replace(cfg.store, run_root=str(root)))
    configs = RLJob(cfg).to_worker_configs()["rollout"]
    path = tmp / "rollout.yaml"
    path.write_text(str(draccus.dump(configs[0] if isinstance(configs, list) else configs)))
    return path, cfg


def rollout(config: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "steps.rollout", "--config_path", str(config), "--follow", "false",
         "--max_rollouts", "16"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=240,
    )  # fmt: skip


def test_worker_falls_back_to_the_newest_intact_policy(tmp_path: Path) -> None:
    root = tmp_path / "run"
    config, cfg = rollout_config(root, tmp_path)
    store = RunStore(str(root))
    model = build_model(cfg.model, model_vocab_size(load_tokenizer(cfg.model.tokenizer)))
    for step in range(3):
        write_policy(store, step, model)
    # policy 2: a weights file cut short (size/sha256 differ from COMMITTED); policy 1: COMMITTED cut mid-JSON
    weights = sorted(p for p in (root / layout.policy_dir(2)).iterdir() if p.name != "COMMITTED")[0]
    weights.write_bytes(weights.read_bytes()[:100])
    marker = root / layout.policy_marker(1)
    marker.write_bytes(marker.read_bytes()[:20])

    proc = rollout(config)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if "is damaged and set aside" in ln]
    assert len(lines) == 2, proc.stderr[-3000:]
    assert "policy 2 is damaged" in lines[0] and "falling back to policy 1" in lines[0], lines[0]
    assert "policy 1 is damaged" in lines[1] and "falling back to policy 0" in lines[1], lines[1]
    rel_weights = f"{layout.policy_dir(2)}/{weights.name}"
    assert store.is_quarantined(rel_weights) and store.is_quarantined(layout.policy_marker(1))
    reason = store.get_json(layout.quarantine_record(rel_weights))["reason"]
    assert "size" in reason or "sha256" in reason, reason
    assert "'<json>'" in store.get_json(layout.quarantine_record(layout.policy_marker(1)))["reason"]
    # it sampled with policy 0 and committed its rows under rollouts/step-0 (nothing under the damaged steps)
    files = sorted((root / layout.ROLLOUTS).rglob("*.parquet"))
    assert files and all(f.parent.name == "step-00000000" for f in files), files
    steps = {s for f in files for s in pq.read_table(f).column("policy_step").to_pylist()}
    assert steps == {0}

    # every policy damaged: one `damaged input` line, exit 7 (nothing older to fall back to)
    first = sorted(p for p in (root / layout.policy_dir(0)).iterdir() if p.name != "COMMITTED")[0]
    first.write_bytes(first.read_bytes()[:100])
    proc = rollout(config)
    assert proc.returncode == Exit.DAMAGED_INPUT, proc.stderr[-3000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith(f"error: {LABELS[Exit.DAMAGED_INPUT]}: "), proc.stderr[-3000:]
    assert layout.policy_dir(0) in errors[0], errors[0]
