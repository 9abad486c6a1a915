"""The tool-use recipe, shorter: SFT on generated calculator transcripts (`steps.sft`), then RL (`steps.run`) on
`ChatCalculatorEnv` (two turns: call the calculator, answer with its result; answers up to six digits); held-out
greedy success on the lesson's 256 fixed problems (training draws skip them) must rise by >= MARGIN (5 points)
over the SFT policy's (policy 0 of the RL run), fixed seeds. A failed evaluation example counts as a miss.

The recipe's own configs, its optimizer included (learning rate 0.002 after 5 warmup steps, cosine decay to
0.0002 at the last step), with 12 RL steps of 256 rollouts instead of 40; docs/guides/tool-use-recipe.md. A learner
that learns nothing keeps policy 0's greedy answers (+0 points); a collapsed RL run scores 0.000 (sampling at
temperature 0.7, or a learning rate of 0.003 at 8 steps: 0.000 in one of two runs). Measured on the 2-core VM
(2026-11-29, beside other jobs), ten runs with SFT: 0.168 at policy 0, then +9.8, +9.8, +9.0, +8.2, +8.6, +9.4,
+9.4, +8.2, +8.2 and +7.8 points at step 12; on 2026-11-30 one run in a side-by-side pair of suites collapsed at
policy 7 (0.168 -> 0.000; docs/testing.md, not fixed).

The failure mode: one update near the peak rate (its gradient norm ordinary) makes the policy leave out the
`{"expression": ...}` object of the call (`"arguments": "155710+55"`: no call, reward 0) or not close it with `>`
(the first turn cut at 32 tokens); the next step's gradient norm spikes (2.2, 1.9; 3.45 in a collapsed run; the
rewarded rows' call tokens have become unlikely), and where rewards fall to 0 everywhere no group has a reward
spread left to pull the policy back. The test ran 2 warmup steps before (the peak rate from step 3): its steps 2 to
4 made the run's largest policy changes (mean |delta log p| per sampled token between successive policies 0.085 to
0.116 at policy 3; with 5 warmup steps at most 0.058 in nine runs, 0.107 at the tenth's break) and the break came at
policy 4, while training rewards were 5 to 10%: one run in about six collapsed (0.168 -> 0.000), others broke and
recovered (+5.9 with 56% of policy 4's first turns without the object); passes +5.9 to +10.9. With 5 warmup steps
the break came later or not at all: 93% of policy 7's episodes without the object in one of the ten runs above
(training rewards 15 to 18% around it; it recovered at policy 8, +8.2), first turns cut at 32 tokens (20 to 27%) at
policies 6 to 8 in another (+8.2).
8 steps (2 warmup steps; about 60 s of CPU less) were too close to the margin: +7.4, +5.9, +4.3 and +5.9; 12 steps of
128 rollouts +4.7, +4.3, +0.8 and +4.7. The asynchronous pipeline does not repeat a run exactly."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml
from jobs import TEST_XLA_FLAGS, run_sft_then_rl

REPO = Path(__file__).resolve().parents[1]
RL_STEPS = 12
"""RL steps (the recipe has 40); held-out success is evaluated at policy 0 and at this step."""
MARGIN = 0.05
"""The held-out gain asserted (5 points), 4 below the lowest measured run (module docstring)."""


def held_out_success(run: Path, step: int) -> float:
    """Successes over the problems asked for (scored + failed) at policy `step`."""
    (row,) = pq.read_table(run / "evals" / f"step-{step:08d}" / "calc.summary.parquet").to_pylist()
    asked = row["n_examples"] + row["n_failures"]
    assert asked == 256, row
    return float(row["success_rate"]) * row["n_examples"] / asked


@pytest.mark.slow
# Its own bound, above the suite's 900 s (meant for hangs): SFT then 12 RL steps are ~10 minutes of CPU on two
# cores, and under twice CI's load (two clean-clone suites side by side on the 2-core VM) the test passed 900 s in
# both suites while still training. Each of its two programs is bounded at 1,500 s below.
@pytest.mark.timeout(2400)
def test_tool_recipe_rl_gains_held_out_success(tmp_path: Path) -> None:
    sft = yaml.safe_load((REPO / "configs" / "tool_calculator_sft.yaml").read_text())
    rl = yaml.safe_load((REPO / "configs" / "tool_calculator.yaml").read_text())
    sft["store"]["run_root"] = str(tmp_path / "sft")
    sft["source"]["paths"] = [str(REPO / p) for p in sft["source"]["paths"]]
    rl["store"]["run_root"] = str(tmp_path / "rl")
    rl["model"]["init_policy"] = str(tmp_path / "sft")
    rl["train"]["num_train_steps"] = RL_STEPS
    rl["curriculum"]["eval_frequency"] = RL_STEPS
    # the recipe's optimizer as it is: 5 warmup steps (2 broke the call format early, when rewards were low)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "HF_HUB_OFFLINE": "1", "PYTHONHASHSEED": "0"}
    # The step programs run without the test processes' unoptimised XLA flags: sampling two-turn episodes is
    # run-time bound here, and unoptimised code made 20 RL steps take over 15 minutes on the loaded 2-core VM.
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "").replace(TEST_XLA_FLAGS, "").strip()
    run_sft_then_rl(tmp_path, sft, rl, env, timeout=1500)
    p0, final = held_out_success(tmp_path / "rl", 0), held_out_success(tmp_path / "rl", RL_STEPS)
    print(f"held-out success: policy 0 {p0:.3f}, policy {RL_STEPS} {final:.3f}")
    assert p0 > 0
    assert final >= p0 + MARGIN, (p0, final)


def test_sft_transcripts_file_is_what_the_generator_writes() -> None:
    """The guide's command, as written, in a fresh process from the repository root."""
    command = (
        ".venv/bin/python -m pipeline.environments.tool_transcripts --out configs/tool_calculator_sft.jsonl --check"
    )
    assert command in (REPO / "docs" / "guides" / "tool-use-recipe.md").read_text()
    done = subprocess.run(["bash", "-c", command], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


def test_transcripts_are_the_episodes_the_environment_pays_for() -> None:
    """A policy that replays a generated transcript plays a rewarded two-turn episode whose tokens are exactly the
    transcript's (so SFT trains on what RL samples); training draws never hit the held-out problems; the per-turn
    metrics say where episodes ended."""
    from pipeline.environments.base import SampleSpec
    from pipeline.environments.chat_calculator import CALCULATOR_TOOL, ChatCalculatorEnv
    from pipeline.environments.scripted import ScriptedContext
    from pipeline.environments.tokenizer import load_tokenizer
    from pipeline.environments.tool_transcripts import transcript
    from pipeline.sft_data import chat_example

    tok = load_tokenizer("builtin:bpe")
    env = ChatCalculatorEnv(max_turns=2, n_terms=2, max_operand=999)

    def script(prompt_text: str) -> str:  # the transcript's assistant turns, in order
        expr = prompt_text.split("What is ")[1].split("?")[0]
        turns = [m for m in transcript(env, expr) if m["role"] == "assistant"]
        if "<bos>tool\n" not in prompt_text:
            call = turns[0]["tool_calls"][0]["function"]
            return f'<tool_call>{{"name": "{call["name"]}", "arguments": {call["arguments"]}}}</tool_call>'
        return str(turns[1]["content"])

    res = env.sample(ScriptedContext(tok, script), SampleSpec(4, 1, 1.0, 48, None, "train"), np.random.default_rng(0))
    assert res.failures == [] and len(res.groups) == 4
    for g in res.groups:
        (r,) = g.rollouts
        assert r.episode_reward == 1.0 and r.example_id not in set(env.eval_problems)
        ex = chat_example(tok, transcript(env, r.example_id), [CALCULATOR_TOOL])
        assert ex.tokens == r.prompt_tokens + r.response_tokens
        assert ex.loss_mask[len(r.prompt_tokens) :] == r.response_loss_mask
    m = res.metrics
    assert m["ended_at_turn2_mean"] == 1.0 and m["reward_at_turn2_mean"] == 1.0 and m["ended_at_turn1_total"] == 0
    assert m["turns_mean"] == 2.0 and m["tool_calls_mean"] == 1.0 and m["tool_errors_total"] == 0

    many = ChatCalculatorEnv(max_turns=2, n_terms=1, max_operand=300, n_eval=64)  # 64 of only 300 problems
    assert not set(many.problems(2000, np.random.default_rng(0), "train")) & set(many.eval_problems)


def test_tool_use_section_shows_per_turn_metrics(tmp_path: Path) -> None:
    from pipeline import report
    from pipeline.store.storage import RunStore
    from pipeline.telemetry.metrics import MetricsWriter

    w = MetricsWriter(RunStore(str(tmp_path / "run")), "rollout", "w0")
    for step, (ended1, reward2) in enumerate([(0.5, 0.25), (0.5, 0.25), (0.0, 0.5), (0.0, 0.5)]):
        w.log({"event": "write", "lesson_id": "calc", "policy_step": step, "mean_reward": reward2,
               "env/turns_mean": 2.0 - ended1, "env/tool_calls_mean": 1.0 - ended1, "env/tool_errors_mean": 0.25,
               "env/parse_failure_mean": 0.0, "env/ended_at_turn1_mean": ended1, "env/reward_at_turn1_mean": 0.0,
               "env/ended_at_turn2_mean": 1.0 - ended1, "env/reward_at_turn2_mean": reward2})  # fmt: skip
    w.flush()
    page = Path(report.build_report(str(tmp_path / "run"), str(tmp_path / "out"))).read_text()
    m = re.search(r"<h2>Tool use</h2>(.*?)</section>", page, re.S)
    assert m, "no Tool use section"
    rows = [re.findall(r"<td>(.*?)</td>", tr) for tr in re.findall(r"<tr>(.*?)</tr>", m.group(1))]
    # steps, turns, calls, errors, no answer, ended at 1, reward if ended at 1, ended at 2, reward if ended at 2
    assert ["0", "1.5", "0.5", "0.25", "0", "0.5", "0", "0.5", "0.5"] in rows, rows
    assert ["3", "2", "1", "0.25", "0", "0", "-", "1", "0.5"] in rows, rows
    assert '<img alt="tool_use"' in m.group(1)
    empty = Path(report.build_report(str(tmp_path / "none"), str(tmp_path / "out2"))).read_text()
    assert re.search(r"<h2>Tool use</h2>\s*<p class=\"nodata\">", empty)
