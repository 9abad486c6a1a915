"""The real-task recipe, smaller: SFT warm start (`steps.sft`) then RL (`steps.run`) on reasoning-gym's
basic_arithmetic; held-out greedy accuracy on 256 problems (item seeds never drawn for training) must rise by >= 5
points over the SFT policy's (policy 0 of the RL run), fixed seeds.

The recipe's own configs with 50 RL steps instead of 75 (docs/benchmarks.md, "Held-out gain on a real task").
Measured on the 2-core VM (2026-11-26), held-out success by RL step: 0.168 at policy 0; 0.164 / 0.188 / 0.223 /
0.270 / 0.316 at steps 10 / 20 / 30 / 40 / 50 (one run evaluated every 10 steps); other runs: 0.289 at 50 (+12
points), and 0.191-0.227 at step 25 (+2 to +5.5 points: too few steps for the margin). 40 steps gave +10.2 points
in one run and +2.7 (0.168 -> 0.195) in a clean-clone CI run, so the test keeps 50.
CPU: SFT 18 s, RL 166 s for 50 steps with six evaluations (two evaluations here). 2026-11-29 (the no-signal fill
fixes, docs/guides/sft-and-recipe.md "Where the generated rows go"): 0.168 -> 0.289, 171 CPU-s for the test process
and its children (/usr/bin/time -v), 5 min 52 s wall beside a `make recipe` run (load ~10)."""

from __future__ import annotations

import glob
import os
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from jobs import run_sft_then_rl
from test_guide_commands import command_blocks, page_folder, run_block

REPO = Path(__file__).resolve().parents[1]
SFT_PAGE, SFT_BLOCK = "docs/guides/sft-and-recipe.md", "make sft SFT_CONFIG="
"""The guide block this test runs for the SFT warm start (tests/test_guide_commands.py lists it as run here)."""
RL_STEPS = 50
"""RL steps (the recipe has 75); held-out success is evaluated at policy 0 and at this step."""


def _success(run: Path, step: int) -> float:
    (f,) = glob.glob(str(run / "evals" / f"step-{step:08d}" / "arithmetic.summary.parquet"))
    return float(pq.read_table(f).to_pylist()[0]["success_rate"])


@pytest.mark.slow
# Its own bound, above the suite's 900 s (meant for hangs): its SFT and 50 RL steps took 500 s of a suite run under
# twice CI's load (two clean-clone suites side by side on the 2-core VM), where the tool recipe's test passed
# 900 s. Each of its programs is bounded at 900 s below.
@pytest.mark.timeout(1800)
def test_recipe_rl_gains_held_out_accuracy(tmp_path: Path) -> None:
    # The SFT warm start is the guide's own block, run as written (docs/guides/sft-and-recipe.md, "The SFT step")
    # in a fresh page folder: its run root, runs/basic_arithmetic_sft there, is the RL run's initial policy.
    (block,) = [b for b in command_blocks() if b.page == SFT_PAGE and SFT_BLOCK in b.text]
    cwd = page_folder(tmp_path)
    run_block(block, cwd)
    sft_cfg = yaml.safe_load((REPO / "configs" / "basic_arithmetic_sft.yaml").read_text())
    rl = yaml.safe_load((REPO / "configs" / "basic_arithmetic.yaml").read_text())
    rl["store"]["run_root"] = str(tmp_path / "rl")
    rl["model"]["init_policy"] = str(cwd / sft_cfg["store"]["run_root"])
    rl["train"]["num_train_steps"] = RL_STEPS
    rl["curriculum"]["eval_frequency"] = RL_STEPS
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "HF_HUB_OFFLINE": "1", "PYTHONHASHSEED": "0"}
    run_sft_then_rl(tmp_path, None, rl, env, timeout=900)
    p0, final = _success(tmp_path / "rl", 0), _success(tmp_path / "rl", RL_STEPS)
    print(f"held-out success: policy 0 {p0:.3f}, policy {RL_STEPS} {final:.3f}")
    assert p0 > 0
    assert final >= p0 + 0.05, (p0, final)
