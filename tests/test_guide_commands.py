"""Every command block of docs/guides/*.md and docs/reference/*.md runs as written, each page's blocks in their
order in a new shell, on a fresh run root of that page's own: a scratch folder that holds only links to the
checkout's `configs/` and `.venv/`, so the `runs/…`, `runs/…-hf` paths the pages write land there.

What is a command block (docs/testing.md, "Commands in the docs"): a fenced block whose language is `bash`, `sh`,
`shell` or `console`, unless its first line is `#!` (the text of a script to save, e.g. the GCS guide's
`rlpipe-cron`). Every other block is not run: `yaml`, `python`, `text` (output, file trees, crontab lines). Every
fence of these pages names its language, and no command is written as an indented block, so nothing escapes the
rule (`test_every_block_declares_what_it_is`).

Each command block is in `WHERE` (checked both ways: every block is listed, every entry names a block): run here
(the test that runs it), run by another test (named), run by the long tier (`LONG`: a test of
tests/test_guides_long.py, `make test-guides`, not in `make test`), or not run, with the reason. A block
is run by `run_block`: its `make …` lines as the Makefile's recipe lines (`tests/makefile.py`: `make` itself would
first re-sync the environment), every other line as typed, all in one `bash -e` from the page's folder with the
Makefile's environment (and the test XLA flags tests/conftest.py sets, as for every process a test starts). A
page's blocks that build on each other (a run, then its replay and export) share that folder, as a user following
the page would. Each block is then checked by its effect.

The pages that use `runs/demo` (the run the README's `make demo` leaves) get their own copy of the session's finished
test job (`default_job`: configs/test_cats.yaml, 6 learner steps) at `runs/demo`.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from jobs import FinishedJob
from makefile import REPO, make_env, recipe_command

from pipeline.store import layout
from pipeline.store.storage import RunStore

GENERATED = REPO / "docs" / "reference" / "configuration.md"
PAGES = sorted(p for d in ("guides", "reference") for p in (REPO / "docs" / d).glob("*.md") if p != GENERATED)
COMMAND_LANGUAGES = ("bash", "sh", "shell", "console")
FENCE = re.compile(r"^([ \t]*)```(\S*)[^\n]*\n(.*?)^[ \t]*```", re.S | re.M)
BLOCK_TIMEOUT_S = 600


@dataclass(frozen=True)
class Block:
    page: str
    """The page, relative to the repo."""
    language: str
    text: str

    @property
    def is_command(self) -> bool:
        return self.language in COMMAND_LANGUAGES and not self.text.startswith("#!")

    def __str__(self) -> str:
        first = next((ln for ln in self.text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")), "")
        return f"{self.page}: {first.strip()[:80]}"


def page_blocks(page: Path) -> list[Block]:
    """Every fenced block of `page`, in order."""
    rel = str(page.relative_to(REPO))
    return [Block(rel, lang, textwrap.dedent(text)) for _, lang, text in FENCE.findall(page.read_text())]


def command_blocks() -> list[Block]:
    return [b for page in PAGES for b in page_blocks(page) if b.is_command]


HERE = "run here: "
ELSEWHERE = "run by "
NOT_RUN = "not run: "
LONG = "long tier: "
"""Run as written by the named test of tests/test_guides_long.py (`make test-guides`, not in `make test`: recipes
of CPU-minutes to CPU-hours, the judge on its fixed port 8000 in a network namespace of its own)."""
LONG_TESTS = REPO / "tests" / "test_guides_long.py"
WHERE: dict[tuple[str, str], str] = {
    ("docs/guides/configuration.md", "--run_root runs/gspo"): HERE + "test_configuration_guide",
    ("docs/guides/configuration.md", "--run_root runs/lessons"): HERE + "test_configuration_guide",
    ("docs/guides/critic-ppo.md", "make run CONFIG=configs/demo_cats_critic.yaml"): HERE + "test_critic_ppo_guide",
    ("docs/guides/lora.md", "--run_root runs/lora"): HERE + "test_lora_guide",
    ("docs/guides/reasoning-tasks.md", "make evaluate RUN=runs/demo"): HERE + "test_reasoning_tasks_guide",
    ("docs/reference/exit-codes.md", "rlpipe learn --run_root runs/demo"): HERE + "test_exit_codes_reference",
    ("docs/reference/run-root.md", "cat runs/demo/quarantine"): HERE + "test_run_root_reference",
    ("docs/guides/gcs-and-ray.md", "make run RUN=gs://rlpipe/run1"): ELSEWHERE
    + "tests/test_readme_gcs.py (parsed from the guide, on the GCS emulator that `make gcs-emulator` starts)",
    ("docs/guides/gcs-and-ray.md", "steps.run step learn"): ELSEWHERE
    + "tests/test_readme_gcs.py (parsed from the guide; CFG, ROOT and N set as a scheduler would, on the emulator)",
    ("docs/guides/reasoning-tasks.md", "pipeline.environments.bpe_training --check"): ELSEWHERE
    + "tests/test_bpe_tokenizer.py (the same command in a fresh process)",
    ("docs/guides/reasoning-tasks.md", "bench.bench_tokenizer"): LONG + "test_bench_tokenizer_reproduces_the_table",
    ("docs/guides/reasoning-tasks.md", "make recipe RECIPE=prime_factorization"): LONG
    + "test_prime_factorization_recipe",
    ("docs/guides/environments.md", ".tools/bin/uv add --editable"): LONG
    + "test_uv_add_keeps_a_local_package_installed",
    ("docs/guides/bring-your-environment.md", "configs/verifiers_example.yaml"): LONG + "test_verifiers_example_job",
    ("docs/guides/bring-your-environment.md", "configs/agent_example.yaml"): LONG + "test_agent_example_job",
    ("docs/guides/bring-your-environment.md", "python -m steps.serve --run_root runs/judge_example"): LONG
    + "test_judge_example_on_port_8000",
    ("docs/guides/bring-your-environment.md", "make serve RUN=runs/judge_example"): LONG
    + "test_judge_example_on_port_8000",
    ("docs/reference/steps.md", "make rescore RUN=runs/judge_example"): LONG + "test_judge_example_on_port_8000",
    ("docs/guides/sft-and-recipe.md", "make sft SFT_CONFIG="): ELSEWHERE
    + "tests/test_recipe.py (as written, in a page folder of its own: its run root is the RL run's initial policy)",
    ("docs/guides/sft-and-recipe.md", "make recipe"): LONG + "test_basic_arithmetic_recipe",
    ("docs/guides/tool-use-recipe.md", "pipeline.environments.tool_transcripts"): ELSEWHERE
    + "tests/test_tool_recipe.py (the same command in a fresh process)",
    ("docs/guides/tool-use-recipe.md", "make recipe RECIPE=tool_calculator"): LONG + "test_tool_calculator_recipe",
    ("docs/guides/tool-use-recipe.md", "configs/tool_calculator_agent.yaml"): LONG + "test_tool_calculator_agent",
    ("docs/guides/tool-use-recipe.md", "configs/tool_calculator_verifiers.yaml"): LONG
    + "test_tool_calculator_verifiers",
    ("docs/guides/distillation.md", "--store.run_root runs/cats-teacher"): LONG
    + "test_distillation_teacher_then_student",
}
"""Every command block of the pages -> where it is run (keyed by its page and a text unique to the block)."""


def where(block: Block) -> str:
    keys = [k for k in WHERE if k[0] == block.page and k[1] in block.text]
    assert len(keys) == 1, f"{block}: {len(keys)} entries of WHERE match it: {keys}"
    return WHERE[keys[0]]


def blocks_of(page: str, test: str, kind: str = HERE) -> list[Block]:
    """The command blocks of `page` that `test` runs (`kind`: HERE, or LONG for tests/test_guides_long.py), in
    page order."""
    out = [b for b in command_blocks() if b.page == page and where(b) == kind + test]
    assert out, f"{page} has no block for {test}"
    return out


# ---------------------------------------------------------------------------------------------
# the rule (no processes)
# ---------------------------------------------------------------------------------------------


def test_every_block_declares_what_it_is() -> None:
    """Every fence names its language, and no command hides in an indented block."""
    for page in PAGES:
        text = page.read_text()
        unnamed = [b for b in page_blocks(page) if not b.language]
        assert not unnamed, f"{page}: a fence without a language (```text for output): {unnamed[0].text[:80]!r}"
        outside = FENCE.sub("", text)
        indented = re.findall(r"^(?: {4,}|\t)(?:make|python|rlpipe|source|\.venv/bin/)\b.*$", outside, re.M)
        assert not indented, f"{page}: a command in an indented block (fence it as ```bash): {indented[0]!r}"


def test_every_command_block_is_accounted_for() -> None:
    blocks = command_blocks()
    assert len(blocks) >= 10, [str(b) for b in blocks]
    for block in blocks:
        where(block)
    for (page, key), what in WHERE.items():
        matching = [b for b in blocks if b.page == page and key in b.text]
        assert len(matching) == 1, f"WHERE entry ({page}, {key!r}) matches {len(matching)} command blocks"
        assert what.startswith((HERE, ELSEWHERE, NOT_RUN, LONG)), what
        if what.startswith(HERE):
            assert what.removeprefix(HERE) in globals(), f"no test {what}"
        if what.startswith(LONG):
            test = what.removeprefix(LONG)
            assert re.search(rf"^def {test}\(", LONG_TESTS.read_text(), re.M), f"no test {test} in {LONG_TESTS}"


# ---------------------------------------------------------------------------------------------
# running blocks
# ---------------------------------------------------------------------------------------------


def page_folder(tmp_path: Path) -> Path:
    """A fresh folder for one page's commands: links to the checkout's configs/ and .venv/, nothing else."""
    folder = tmp_path / "cwd"
    folder.mkdir()
    for name in ("configs", ".venv"):
        (folder / name).symlink_to(REPO / name)
    return folder


def shell_line(line: str) -> str:
    """`line` as the shell runs it: each `make TARGET VAR=…` part of it (parts joined by `&&`) as the target's
    recipe line (`tests/makefile.py`), any other line unchanged."""
    words = shlex.split(line, comments=True)
    if words[:1] != ["make"]:
        return line
    parts: list[list[str]] = [[]]
    for w in words:
        parts.append([]) if w == "&&" else parts[-1].append(w)
    commands = []
    for part in parts:
        assert part[:1] == ["make"] and len(part) >= 2, line
        variables = dict(w.split("=", 1) for w in part[2:])
        commands.append(shlex.join(recipe_command(part[1], **variables)))
    return " && ".join(commands)


def block_lines(block: Block) -> list[str]:
    """The block's non-blank lines as the shell runs them (`shell_line`)."""
    return [shell_line(ln) for ln in block.text.splitlines() if ln.strip()]


def run_script(
    what: object,
    script: str,
    cwd: Path,
    *,
    env: dict[str, str] | None = None,
    timeout_s: float = BLOCK_TIMEOUT_S,
    prefix: tuple[str, ...] = (),
) -> subprocess.CompletedProcess[str]:
    """`script` in one `bash -e` from `cwd` (`env`: default the Makefile's environment), started as `prefix` +
    `bash -c` (e.g. `unshare …`), in a session of its own: past `timeout_s` the whole session is killed (the steps a
    job started with it) and the test fails. Asserts it exits 0 without a traceback; returns the finished process."""
    proc = subprocess.Popen([*prefix, "bash", "-c", f"set -e\n{script}"], cwd=cwd, env=env or make_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"{what}: still running after {timeout_s:.0f} s\n{out[-2000:]}\n{err[-4000:]}") from None
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    assert done.returncode == 0, f"{what}: exit {done.returncode}\n{script}\n{out[-2000:]}\n{err[-4000:]}"
    assert "Traceback" not in err, f"{what}\n{err[-4000:]}"
    return done


def run_block(block: Block, cwd: Path, **kw: Any) -> subprocess.CompletedProcess[str]:
    """The block in one `bash -e` from `cwd` (the Makefile's environment), each line as typed (make lines as
    their recipes); asserts it exits 0 and returns the finished process. `kw`: `run_script`'s."""
    return run_script(block, "\n".join(block_lines(block)), cwd, **kw)


def contract(root: Path) -> dict:
    """The resolved job config run.json records."""
    return json.loads((root / layout.RUN_CONFIG).read_text())["config"]


def learner_done(root: Path, steps: int) -> None:
    store = RunStore(str(root))
    assert store.exists(layout.LEARNER_DONE), f"{root}: the learner did not finish"
    assert store.exists(layout.policy_marker(steps)) and not store.exists(layout.policy_marker(steps + 1))


# ---------------------------------------------------------------------------------------------
# the guides
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_configuration_guide(tmp_path: Path) -> None:
    """`--loss.type gspo` starts from GSPO's own defaults, the further `--loss.aggregation` on top; a lesson field
    set on the command line changes that field alone."""
    cwd = page_folder(tmp_path)
    gspo, lessons = blocks_of("docs/guides/configuration.md", "test_configuration_guide")
    run_block(gspo, cwd)
    learner_done(cwd / "runs/gspo", 2)
    loss = contract(cwd / "runs/gspo")["loss"]
    assert loss["type"] == "gspo" and loss["aggregation"] == "sequence", loss
    assert (loss["clip_low"], loss["clip_high"]) == (3e-4, 4e-4), loss  # GSPO's, not the YAML's RLOO values

    run_block(lessons, cwd)
    learner_done(cwd / "runs/lessons", 2)
    curriculum = contract(cwd / "runs/lessons")["curriculum"]
    sampling = curriculum["lessons"]["cats"]["sampling_params"]
    assert sampling == {**curriculum["default_sampling"], "n_prompts": 8}, sampling


@pytest.mark.slow
def test_critic_ppo_guide(tmp_path: Path) -> None:
    """A 4-step critic-PPO run, its bitwise replay of slots 3-4 from checkpoint 2 (exit 0 only when bitwise), and
    the HF export of its newest policy."""
    cwd = page_folder(tmp_path)
    (block,) = blocks_of("docs/guides/critic-ppo.md", "test_critic_ppo_guide")
    proc = run_block(block, cwd)
    root = cwd / "runs/demo-critic"
    learner_done(root, 4)
    assert contract(root)["loss"]["type"] == "ppo_critic"
    assert "bitwise" in (proc.stdout + proc.stderr).lower(), proc.stderr[-3000:]
    export = cwd / "runs/demo-critic-hf"
    assert (export / "config.json").exists() and (export / "model.safetensors").exists()


@pytest.mark.slow
def test_lora_guide(tmp_path: Path) -> None:
    """A 2-step LoRA run publishing adapters, then its export: the merged HF folder and the PEFT folder with its
    base (a model trained from scratch)."""
    cwd = page_folder(tmp_path)
    (block,) = blocks_of("docs/guides/lora.md", "test_lora_guide")
    run_block(block, cwd)
    root = cwd / "runs/lora"
    learner_done(root, 2)
    assert contract(root)["model"]["lora"]["publish"] == "adapters"
    out = cwd / "runs/lora-hf"
    assert (out / "config.json").exists()
    assert (out / "peft" / "adapter_config.json").exists() and (out / "peft" / "adapter_model.safetensors").exists()
    assert (out / "peft" / "base" / "config.json").exists()


# ---------------------------------------------------------------------------------------------
# the pages that use the README's runs/demo
# ---------------------------------------------------------------------------------------------

DEMO_STEPS = 6
"""Learner steps of the session's `default_job` (configs/test_cats.yaml as it is)."""


def demo_copy(default_job: FinishedJob, tmp_path: Path) -> Path:
    """A fresh page folder holding a copy of the session's finished test job at `runs/demo`, where the README's
    `make demo` leaves its run (the shared job itself is never written to)."""
    cwd = page_folder(tmp_path)
    shutil.copytree(default_job.root, cwd / "runs/demo", symlinks=True)
    return cwd


@pytest.mark.slow
def test_reasoning_tasks_guide(default_job: FinishedJob, tmp_path: Path) -> None:
    """`make evaluate … --all true` scores every committed policy; `make report` writes the report."""
    cwd = demo_copy(default_job, tmp_path)
    (block,) = blocks_of("docs/guides/reasoning-tasks.md", "test_reasoning_tasks_guide")
    proc = run_block(block, cwd)
    store = RunStore(str(cwd / "runs/demo"))
    assert all(store.exists(layout.eval_summary_file(s, "cats")) for s in range(DEMO_STEPS + 1))
    assert (cwd / "runs/demo/report/index.html").exists()
    assert proc.stdout.strip().splitlines()[-1].endswith("runs/demo/report/index.html"), proc.stdout[-2000:]


@pytest.mark.slow
def test_exit_codes_reference(default_job: FinishedJob, tmp_path: Path) -> None:
    """`rlpipe learn --run_root runs/demo --max_steps 5` reads the run's job config from its run.json; on a run
    whose learner finished it has nothing to do and exits 0 without training."""
    cwd = demo_copy(default_job, tmp_path)
    (block,) = blocks_of("docs/reference/exit-codes.md", "test_exit_codes_reference")
    run_block(block, cwd)
    learner_done(cwd / "runs/demo", DEMO_STEPS)


@pytest.mark.slow
def test_run_root_reference(default_job: FinishedJob, tmp_path: Path) -> None:
    """`cat runs/demo/quarantine/*.json` prints one {"path", "reason", "time"} record per object set aside."""
    cwd = demo_copy(default_job, tmp_path)
    store = RunStore(str(cwd / "runs/demo"))
    rollout = next(r for d in store.list(layout.ROLLOUTS) for r in store.list_committed(d))
    store.quarantine(rollout, "truncated parquet")  # as a reader that found it damaged sets it aside
    (block,) = blocks_of("docs/reference/run-root.md", "test_run_root_reference")
    proc = run_block(block, cwd)
    record = json.loads(proc.stdout)  # one object set aside: one record
    assert {"path", "reason", "time"} <= set(record) and record["path"] == rollout, record
    assert record["reason"] == "truncated parquet"
